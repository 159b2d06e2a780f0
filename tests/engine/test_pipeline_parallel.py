"""Pipeline parallelism on CPU: stages in real processes (gloo), each holding a range of the
decoder layers and their KV cache, give the tokens of one process (float32), through greedy
and seeded sampling, prompt logprobs, prefix-cache hits, chunked prefill and preemption;
with tensor parallelism inside each stage too."""
from __future__ import annotations

import json

import numpy as np
import pytest

from batchinfer import LLM, SamplingParams
from batchinfer.engine.pipeline import micro_batches
from batchinfer.model.parallel import stage_layers

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SAMPLED = [
    GREEDY,
    SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=1.0, top_k=20, n=2),  # the engine's generator
    SamplingParams(max_tokens=10, temperature=0.0, logprobs=2, prompt_logprobs=1, ignore_eos=True),
]
SHARED = list(range(3, 40))
PROMPTS = [[1, 17, 42, 99, 7], SHARED + [5, 6], SHARED + [8], list(range(100, 170))]


def _run(llm: LLM) -> tuple[list, dict]:
    got = []
    for params in SAMPLED:
        for out in llm.generate(PROMPTS, params):
            got.append([(c.token_ids, c.text, c.finish_reason,
                         [sorted(d) for d in c.logprobs or []]) for c in out.outputs])
            got.append([sorted(d) if d else d for d in out.prompt_logprobs or []])
    return got, llm.stats()


def test_stage_layers_split_evenly():
    assert [list(stage_layers(30, 4, s)) for s in range(4)] == [
        list(range(0, 7)), list(range(7, 14)), list(range(14, 22)), list(range(22, 30))]
    assert [list(stage_layers(3, 2, s)) for s in range(2)] == [[0], [1, 2]]
    with pytest.raises(ValueError, match="pipeline_parallel_size 4 exceeds the model's 3 layers"):
        stage_layers(3, 4, 0)


def test_micro_batches_are_contiguous_and_balanced():
    assert micro_batches(np.array([1, 1, 1, 1]), 2) == [(0, 2), (2, 4)]
    assert micro_batches(np.array([1, 1, 1, 100]), 2) == [(0, 3), (3, 4)]
    assert micro_batches(np.array([100, 1, 1]), 4) == [(0, 1), (1, 2), (2, 3)]
    assert micro_batches(np.array([5]), 4) == [(0, 1)]
    for sizes in ([3] * 17, [1] * 5 + [40, 7, 300], list(range(1, 30))):
        parts = micro_batches(np.array(sizes), 4)
        assert parts[0][0] == 0 and parts[-1][1] == len(sizes) and len(parts) == 4
        assert all(a < b for a, b in parts) and all(p[1] == q[0] for p, q in zip(parts, parts[1:]))


@pytest.mark.slow
@pytest.mark.parametrize("model, kwargs", [
    ("llama", dict(pipeline_parallel_size=2)),                 # tied LM head on the last stage
    ("gemma3", dict(pipeline_parallel_size=2)),                # 3 layers: 1 + 2
    ("qwen3_moe", dict(pipeline_parallel_size=3)),             # a layer per stage, experts
    ("glm4_moe", dict(pipeline_parallel_size=2)),              # dense stage, MoE stage
    ("deepseek_v3", dict(pipeline_parallel_size=2)),           # latent caches per stage
    ("phi4_mini", dict(pipeline_parallel_size=2, tensor_parallel_size=2)),  # 4 processes
    ("llama", dict(pipeline_parallel_size=2, num_kv_blocks=6, max_num_seqs=4)),  # preemption
    ("mistral", dict(pipeline_parallel_size=2, max_num_batched_tokens=24)),  # chunked prefill
    ("qwen3", dict(pipeline_parallel_size=2, kv_cache_dtype="fp8", quantization="fp8")),
])
def test_stages_match_one_process(request, model, kwargs):
    path = str(request.getfixturevalue(f"{model}_dir"))
    sizing = {k: v for k, v in kwargs.items() if k not in ("pipeline_parallel_size",
                                                           "tensor_parallel_size")}
    sizing.setdefault("num_kv_blocks", 64)
    expected, stats1 = _run(LLM(path, dtype="float32", device="cpu", **sizing))
    llm = LLM(path, dtype="float32", device="cpu", **{**kwargs, **sizing})
    try:
        workers = llm.llm_engine.tensor_parallel.workers
        assert len(workers) == kwargs["pipeline_parallel_size"] * kwargs.get(
            "tensor_parallel_size", 1) - 1
        got, stats2 = _run(llm)
    finally:
        llm.shutdown()
    assert got == expected
    assert stats2["prefix_cache_hit_tokens"] == stats1["prefix_cache_hit_tokens"] > 0
    assert stats2["num_preemptions"] == stats1["num_preemptions"]
    if sizing["num_kv_blocks"] == 6:
        assert stats1["num_preemptions"] > 0
    # each stage holds only its layers: rank 0's weights are fewer than one process's
    assert stats2["weight_bytes"] < stats1["weight_bytes"]


def test_too_many_stages_is_refused_before_starting(llama_dir):
    with pytest.raises(ValueError, match="pipeline_parallel_size 3 exceeds the model's 2 layers"):
        LLM(str(llama_dir), device="cpu", num_kv_blocks=16, pipeline_parallel_size=3)


@pytest.mark.slow
def test_job_with_two_stages(tmp_path, llama_dir):
    from click.testing import CliRunner

    from batchinfer.job.cli import run
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"row {i} says"}) + "\n" for i in range(5)))
    outputs = {}
    for pp in ("1", "2"):
        result = CliRunner().invoke(run, [
            str(path), "--model", str(llama_dir), "-o", str(tmp_path / f"out{pp}"),
            "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "32", "--max-tokens",
            "6", "--ignore-eos", "--no-progress", "--pipeline-parallel-size", pp])
        assert result.exit_code == 0, result.output
        import pyarrow.dataset as ds
        table = ds.dataset(str(tmp_path / f"out{pp}")).to_table().to_pylist()
        outputs[pp] = sorted((r["id"], r["completion"], r["output_tokens"]) for r in table)
    assert len(outputs["2"]) == 5 and outputs["2"] == outputs["1"]
    # regex outputs are refused with stages, before any row runs
    bad = CliRunner().invoke(run, [
        str(path), "--model", str(llama_dir), "-o", str(tmp_path / "regex"), "--device", "cpu",
        "--num-kv-blocks", "32", "--no-progress", "--pipeline-parallel-size", "2",
        "--regex", "[a-z]+"])
    assert bad.exit_code == 2, bad.output
    assert "--regex and JSON-schema outputs are not supported with " \
        "--pipeline-parallel-size > 1" in bad.output
    assert not list((tmp_path / "regex").glob("**/*.parquet"))
