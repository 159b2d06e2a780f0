"""Engine flags of `batchinfer run` reach the engine under their EngineConfig names."""
from __future__ import annotations

import json

import pytest


class Loaded(Exception):
    pass


@pytest.mark.parametrize("flags, expected", [
    ([], {}),  # unset options are left to the engine's defaults
    (["--enforce-eager", "--attention-backend", "torch"],
     {"enforce_eager": True, "attention_backend": "torch"}),
    (["--kv-cache-dtype", "fp8"], {"kv_cache_dtype": "fp8"}),
])
def test_engine_flags_reach_the_engine(tmp_path, run_cli, monkeypatch, flags, expected):
    seen = {}

    def capture(model, kwargs):
        seen.update(kwargs)
        raise Loaded

    monkeypatch.setattr("batchinfer.job.runner.load_engine", capture)
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"prompt": "hi"}) + "\n")
    with pytest.raises(Loaded):  # the job stops where the engine would load
        run_cli(path, "-o", tmp_path / "out", *flags)
    assert {k: seen[k] for k in ("enforce_eager", "attention_backend", "kv_cache_dtype")
            if k in seen} == expected


def test_quantization_flag(tmp_path, run_cli, llama_dir):
    """--quantization fp8 runs the job on FP8 weights and is part of its identity; a flag
    the checkpoint cannot take exits 2 with one line, before any row runs."""
    import fp8_checkpoints
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"row {i}"}) + "\n" for i in range(4)))
    out = tmp_path / "out"
    assert run_cli(path, "-o", out, "--quantization", "fp8", "--limit", "2").exit_code == 0
    again = run_cli(path, "-o", out)
    assert again.exit_code == 2 and "quantization differ" in again.output, again.output
    assert run_cli(path, "-o", out, "-q", "fp8").exit_code == 0

    fp8_model = fp8_checkpoints.write_fp8(llama_dir, tmp_path / "fp8", "fp8-block")
    bad = run_cli(path, "-o", tmp_path / "out2", "--model", fp8_model, "--quantization", "fp8")
    assert bad.exit_code == 2, bad.output
    assert "already quantized (quant_method 'fp8'); drop --quantization" in bad.output
    assert len(bad.output.strip().splitlines()) == 1, bad.output
    assert not (tmp_path / "out2").exists() or not list((tmp_path / "out2").glob("*.parquet"))

    config = json.loads((fp8_model / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (fp8_model / "config.json").write_text(json.dumps(config))
    awq = run_cli(path, "-o", tmp_path / "out3", "--model", fp8_model)
    assert awq.exit_code == 2 and "quant_method 'awq'" in awq.output, awq.output
    assert run_cli(path, "-o", tmp_path / "out4", "-q", "int4").exit_code == 2


def test_async_scheduling_job_writes_what_the_job_without_it_writes(tmp_path, run_cli):
    import pyarrow.dataset as ds
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"row {i} " * (1 + i % 5)})
                            + "\n" for i in range(12)))
    tables = []
    for flags in ([], ["--async-scheduling"]):
        out = tmp_path / ("async" if flags else "sync")
        result = run_cli(path, "-o", out, "--temperature", "0", "--max-tokens", "7", *flags)
        assert result.exit_code == 0, result.output
        rows = ds.dataset(out, format="parquet").to_table().to_pylist()
        tables.append(sorted((r["id"], r["completion"], r["finish_reason"]) for r in rows))
    assert tables[0] == tables[1] and len(tables[0]) == 12


def test_async_scheduling_with_tensor_parallelism_exits_before_the_model_loads(tmp_path, run_cli):
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"prompt": "hi"}) + "\n")
    result = run_cli(path, "-o", tmp_path / "out", "--async-scheduling",
                     "--tensor-parallel-size", "2")
    assert result.exit_code == 2
    assert "--async-scheduling runs one engine process" in result.output, result.output
