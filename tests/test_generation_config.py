"""A model's generation_config.json gives the sampling defaults (vLLM's --generation-config):
what no flag, job-file value, OpenAI body field or SamplingParams sets."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pyarrow.dataset as ds
import pytest
from click.testing import CliRunner

from batchinfer import LLM, SamplingParams
from batchinfer.model.generation_config import generation_defaults
from batchinfer.job.cli import run

sys.path.insert(0, str(Path(__file__).parent / "job"))
from jobtools import ENGINE_FLAGS, ENGINE_KWARGS  # noqa: E402

PROMPTS = ["The quick brown fox", "Once upon a time", "Numbers: 1 2 3"]
GREEDY = {"temperature": 0.0, "top_k": 1, "max_new_tokens": 5}


def with_generation_config(src: Path, dest: Path, **values) -> Path:
    """A copy of the checkpoint whose generation_config.json also holds `values`."""
    shutil.copytree(src, dest)
    path = dest / "generation_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | values))
    return dest


@pytest.fixture(scope="module")
def greedy_model(llama_dir: Path, tmp_path_factory) -> Path:
    return with_generation_config(llama_dir, tmp_path_factory.mktemp("gen") / "m", **GREEDY)


@pytest.fixture(scope="module")
def reference(llama_dir: Path) -> list[str]:
    llm = LLM(str(llama_dir), **ENGINE_KWARGS)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=5))
    return [o.outputs[0].text for o in outs]


def test_fields_are_read_as_vllm_reads_them(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": False, "temperature": 0.6, "top_p": 0.95, "top_k": 20.0, "min_p": 0,
         "repetition_penalty": 1.1, "max_new_tokens": 512, "eos_token_id": 2}))
    expected = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0,
                "repetition_penalty": 1.1, "max_tokens": 512}
    assert generation_defaults(tmp_path, "auto") == expected
    assert generation_defaults(None, str(tmp_path)) == expected  # a directory given
    assert generation_defaults(tmp_path, "vllm") == {}
    assert generation_defaults(tmp_path / "none", "auto") == {}  # no file: no defaults
    with pytest.raises(ValueError, match="no generation_config.json"):
        generation_defaults(None, str(tmp_path / "none"))


def test_a_file_that_is_not_json_is_named(tmp_path):
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON") as e:
        generation_defaults(tmp_path)
    assert str(e.value).startswith(str(tmp_path / "generation_config.json"))


@pytest.mark.parametrize("text, warning", [
    ('{"temperature": "hot"}', "temperature must be a number >= 0, got 'hot'; ignored"),
    ('{"temperature": -1}', "temperature must be a number >= 0, got -1; ignored"),
    ('{"top_p": 2}', "top_p must be a number in (0, 1]"),
    ('{"top_p": 0}', "top_p must be a number in (0, 1]"),
    ('{"max_new_tokens": 0}', "max_new_tokens must be an integer >= 1"),
    ('{"max_new_tokens": 1000000000000}', "max_new_tokens 1000000000000 exceeds the model's "
                                          "context (4096 tokens); ignored"),
])
def test_a_value_no_user_means_is_ignored_with_a_warning(tmp_path, capsys, text, warning):
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 4096}')
    (tmp_path / "generation_config.json").write_text(text[:-1] + ', "top_k": 3}')
    assert generation_defaults(tmp_path) == {"top_k": 3}
    err = capsys.readouterr().err
    assert f"batchinfer: warning: {tmp_path / 'generation_config.json'}: " in err
    assert warning in err, err


def test_llm_generate_without_params_uses_the_models_defaults(greedy_model, llama_dir,
                                                               reference):
    llm = LLM(str(greedy_model), **ENGINE_KWARGS)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.0, 1, 5)
    assert [o.outputs[0].text for o in llm.generate(PROMPTS)] == reference
    # a SamplingParams passed in is used as given
    sampled = llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=3, max_tokens=5))
    assert [o.outputs[0].text for o in sampled] != reference
    assert LLM(str(greedy_model), generation_config="vllm", **ENGINE_KWARGS) \
        .get_default_sampling_params() == SamplingParams()  # max_tokens 16, temperature 1
    from_dir = LLM(str(llama_dir), generation_config=str(greedy_model), **ENGINE_KWARGS)
    assert from_dir.get_default_sampling_params().max_tokens == 5


def test_llm_ignores_a_malformed_field(llama_dir, tmp_path):
    odd = with_generation_config(llama_dir, tmp_path / "m", top_k="many", temperature=0.0)
    defaults = LLM(str(odd), **ENGINE_KWARGS).get_default_sampling_params()
    assert (defaults.top_k, defaults.temperature) == (0, 0.0)  # top_k: SamplingParams' own


def invoke(model: Path, data: Path, out: Path, *args: str):
    return CliRunner().invoke(run, [str(data), "--model", str(model), "-o", str(out),
                                    *ENGINE_FLAGS, "--no-progress", *args])


def completions(out: Path) -> list[str]:
    table = ds.dataset(out).to_table().sort_by("id")
    return table.column("completion").to_pylist()


@pytest.fixture
def data(tmp_path) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def test_job_takes_the_models_defaults_and_flags_override_them(greedy_model, data, tmp_path,
                                                               reference):
    result = invoke(greedy_model, data, tmp_path / "a")
    assert result.exit_code == 0, result.output
    assert completions(tmp_path / "a") == reference
    assert "sampling defaults from the model's generation_config.json: temperature=0.0, " \
           "top_k=1, max_new_tokens=5" in result.stderr
    summary = json.loads((tmp_path / "a" / "__batchinfer__" / "summary.json").read_text())
    assert summary["sampling_from_model"] == {"temperature": 0.0, "top_k": 1, "max_tokens": 5}
    assert summary["sampling"]["max_tokens"] == 5
    # random weights seldom end a completion: the model's limit cut them, which is told
    assert "at the model's max_new_tokens (5, the model's generation_config.json)" in \
        summary["warnings"][0]

    # top_k 1 is greedy at any temperature: both are overridden
    result = invoke(greedy_model, data, tmp_path / "b", "--temperature", "1.0", "--top-k", "0",
                    "--seed", "3")
    assert result.exit_code == 0, result.output
    assert completions(tmp_path / "b") != reference
    assert "max_new_tokens=5" in result.stderr and "top_k=1" not in result.stderr

    result = invoke(greedy_model, data, tmp_path / "c", "--generation-config", "vllm",
                    "--max-tokens", "5", "--seed", "3")  # temperature 1: sampled
    assert result.exit_code == 0, result.output
    assert completions(tmp_path / "c") != reference
    assert "sampling defaults" not in result.stderr


def test_openai_body_fields_override_the_models_defaults(greedy_model, tmp_path, reference):
    data = tmp_path / "batch.jsonl"
    data.write_text("".join(json.dumps({
        "custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
        "body": {"prompt": p, **({"max_tokens": 2} if i == 0 else {})}}) + "\n"
        for i, p in enumerate(PROMPTS)))
    result = invoke(greedy_model, data, tmp_path / "out")
    assert result.exit_code == 0, result.output
    rows = ds.dataset(tmp_path / "out").to_table().sort_by("custom_id").to_pylist()
    assert [r["output_tokens"] for r in rows][0] == 2
    assert [r["completion"] for r in rows][1:] == reference[1:]


def test_a_changed_generation_config_is_another_job(greedy_model, data, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(greedy_model, model)
    assert invoke(model, data, tmp_path / "out").exit_code == 0
    with_generation_config(model, tmp_path / "m2", temperature=0.5)
    shutil.rmtree(model)
    (tmp_path / "m2").rename(model)
    result = invoke(model, data, tmp_path / "out")
    assert result.exit_code == 2
    assert "different job" in result.stderr and "sampling.temperature" in result.stderr


def test_job_without_max_tokens_runs_until_the_context_is_full(llama_dir, data, tmp_path):
    result = invoke(llama_dir, data, tmp_path / "out", "--max-model-len", "24",
                    "--temperature", "0", "--ignore-eos")
    assert result.exit_code == 0, result.output
    rows = ds.dataset(tmp_path / "out").to_table().to_pylist()
    assert all(r["finish_reason"] == "length" and r["prompt_tokens"] + r["output_tokens"] == 24
               for r in rows)
    summary = json.loads((tmp_path / "out" / "__batchinfer__" / "summary.json").read_text())
    assert summary["sampling"]["max_tokens"] is None
    [warning] = summary["warnings"]
    assert "3 of 3 completions (100.0%) ended by length with no --max-tokens" in warning
    assert f"batchinfer: warning: {warning}" in result.stderr
    # a limit given is not warned about
    result = invoke(llama_dir, data, tmp_path / "limited", "--max-tokens", "2")
    assert result.exit_code == 0 and "warning" not in result.stderr


def test_job_refuses_a_missing_generation_config_dir_before_rows_run(llama_dir, data,
                                                                     tmp_path):
    missing = tmp_path / "nowhere"
    result = invoke(llama_dir, data, tmp_path / "out", "--generation-config", str(missing))
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1
    assert f"--generation-config {missing}: no generation_config.json" in result.stderr
    assert not (tmp_path / "out").exists()
