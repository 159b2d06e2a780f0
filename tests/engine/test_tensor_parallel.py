"""Tensor parallelism on CPU: two real processes in a gloo group, each holding half of the
heads and MLP columns, give the tokens of one process (float32: the all-reduce only
reorders sums), through greedy and seeded sampling, prompt logprobs, prefix-cache hits and
preemption."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

import fp8_checkpoints
from batchinfer import LLM, SamplingParams

pytestmark = pytest.mark.slow  # each test starts process groups

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SAMPLED = [
    GREEDY,
    SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=1.0, top_k=20, n=2),  # unseeded: the engine's generator
    SamplingParams(max_tokens=10, temperature=0.8, min_p=0.05, seed=3, repetition_penalty=1.3,
                   presence_penalty=0.5, frequency_penalty=0.3, logprobs=2, min_tokens=4,
                   stop=["e"], prompt_logprobs=2),
]
SHARED = list(range(3, 40))  # a 37-token prefix: two full blocks that later prompts reuse
PROMPTS = [[1, 17, 42, 99, 7], SHARED + [5, 6], SHARED + [8], list(range(100, 170))]


def _run(llm: LLM) -> tuple[list, list[float], dict]:
    got, values = [], []
    for params in SAMPLED:
        for out in llm.generate(PROMPTS, params):
            got.append([(c.token_ids, c.text, c.finish_reason) for c in out.outputs])
            if out.prompt_logprobs is not None:  # scored on rank 0 alone
                got.append((out.prompt_logprobs.token_ids, out.prompt_logprobs.ranks))
                values += out.prompt_logprobs.logprobs
    return got, values, llm.stats()


@pytest.mark.parametrize("model, kwargs", [
    ("llama", dict(num_kv_blocks=64)),                     # tied LM head, llama3 rope
    ("qwen2", dict(num_kv_blocks=64)),                     # q/k/v bias
    ("qwen3", dict(num_kv_blocks=64)),                     # q/k norm per head
    ("mistral", dict(num_kv_blocks=64)),                   # 64-token sliding window
    ("phi4_mini", dict(num_kv_blocks=64)),                 # fused tensors, partial rotary
    ("gemma3", dict(num_kv_blocks=64)),                    # rope per layer type, sandwich norms
    ("qwen3_moe", dict(num_kv_blocks=64)),                 # experts split, a dense layer
    ("glm4_moe", dict(num_kv_blocks=64)),                  # grouped routing, shared experts
    ("deepseek_v3", dict(num_kv_blocks=64)),               # latent attention split by heads
    ("llama", dict(num_kv_blocks=6, max_num_seqs=4)),      # preemption
])
def test_two_ranks_match_one(request, model, kwargs):
    path = str(request.getfixturevalue(f"{model}_dir"))
    expected, values1, stats1 = _run(LLM(path, dtype="float32", device="cpu", **kwargs))
    llm = LLM(path, dtype="float32", device="cpu", tensor_parallel_size=2, **kwargs)
    try:
        workers = llm.llm_engine.tensor_parallel.workers
        assert len(workers) == 1 and workers[0].is_alive()
        got, values2, stats2 = _run(llm)
    finally:
        llm.shutdown()
    assert got == expected
    assert values2 == pytest.approx(values1, abs=1e-4) and len(values1) > 0
    assert stats2["prefix_cache_hit_tokens"] == stats1["prefix_cache_hit_tokens"] > 0
    assert stats2["num_preemptions"] == stats1["num_preemptions"]
    if kwargs["num_kv_blocks"] == 6:
        assert stats1["num_preemptions"] > 0
    assert not workers[0].is_alive()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[1, 2, 3]], GREEDY)


# prefix-cache hits, prompts cut into chunks and preempted requests, all in one engine
TIGHT = dict(num_kv_blocks=8, max_num_seqs=4, max_num_batched_tokens=24)
REPLICATED = [GREEDY, SamplingParams(max_tokens=10, temperature=1.0, top_k=20, n=2, seed=5,
                                     ignore_eos=True)]


@pytest.mark.parametrize("model, size, form", [
    ("llama_kv1", 2, None),
    ("llama", 4, None),                               # 2 KV heads, each on 2 ranks
    ("llama_kv1", 2, "compressed-tensors-channel"),   # FP8 weights and scale rows
    ("deepseek_v3", 2, "compressed-tensors-channel"),  # the latent cache on every rank
])
def test_replicated_kv_heads_match_one(request, tmp_path, model, size, form):
    path = request.getfixturevalue(f"{model}_dir")
    if form is not None:
        path = fp8_checkpoints.write_fp8(path, tmp_path / form, form)
    kwargs = dict(dtype="float32", device="cpu", **TIGHT)
    one = LLM(str(path), **kwargs)
    expected = [[c.token_ids for c in out.outputs]
                for params in REPLICATED for out in one.generate(PROMPTS, params)]
    llm = LLM(str(path), tensor_parallel_size=size, **kwargs)
    try:
        # one KV head per rank, and blocks sized for it
        runner, kv_heads = llm.llm_engine.model_runner, one.llm_engine.model_config.num_key_value_heads
        assert runner.kv_shape[1] == 1
        assert runner.block_bytes * kv_heads == one.llm_engine.model_runner.block_bytes
        got = [[c.token_ids for c in out.outputs]
               for params in REPLICATED for out in llm.generate(PROMPTS, params)]
        stats = llm.stats()
    finally:
        llm.shutdown()
    assert got == expected
    assert stats["prefix_cache_hit_tokens"] == one.stats()["prefix_cache_hit_tokens"] > 0
    assert stats["num_preemptions"] == one.stats()["num_preemptions"] > 0


def test_indivisible_size_is_refused_before_starting(llama_dir):
    # test-llama has 4 query heads and 2 KV heads
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide the model's "
                                         r"num_attention_heads \(4\); use a divisor of it"):
        LLM(str(llama_dir), device="cpu", num_kv_blocks=16, tensor_parallel_size=3)


def test_one_parallel_engine_per_process_and_a_dead_worker(llama_dir):
    llm = LLM(str(llama_dir), device="cpu", num_kv_blocks=16, tensor_parallel_size=2)
    try:
        for size in (2, 1):  # the parallel layers' state belongs to the process
            with pytest.raises(RuntimeError, match="call shutdown"):
                LLM(str(llama_dir), device="cpu", num_kv_blocks=16, tensor_parallel_size=size)
        worker = llm.llm_engine.tensor_parallel.workers[0]
        os.kill(worker.pid, signal.SIGTERM)  # rank 0 stops the workers, not a signal
        os.kill(worker.pid, signal.SIGINT)
        assert len(llm.generate([[1, 2, 3]], GREEDY)[0].outputs[0].token_ids) == 12
        worker.kill()
        worker.join(10)
        with pytest.raises(RuntimeError, match="tensor-parallel worker is gone"):
            llm.generate([[1, 2, 3]], GREEDY)
    finally:
        llm.shutdown()
    # after shutdown the process can start another parallel engine
    llm = LLM(str(llama_dir), device="cpu", num_kv_blocks=16, tensor_parallel_size=2)
    try:
        assert len(llm.generate([[1, 2, 3]], GREEDY)[0].outputs[0].token_ids) == 12
    finally:
        llm.shutdown()


_KILL_WHILE_JOINING = """
import faulthandler, sys, time
faulthandler.dump_traceback_later(240, exit=True)  # a hang shows where, before the timeout
from batchinfer import LLM
from batchinfer.engine import tensor_parallel

wait_for = tensor_parallel.TensorParallelGroup._wait_for

def kill_after_joining(self, stage):
    wait_for(self, stage)
    if stage == "joining":
        for worker in self.workers:
            worker.kill()

tensor_parallel.TensorParallelGroup._wait_for = kill_after_joining
start = time.monotonic()
try:
    LLM(sys.argv[1], device="cpu", num_kv_blocks=16, tensor_parallel_size=2)
except tensor_parallel.WorkerError as e:
    print(f"{time.monotonic() - start:.1f}", e)
"""


def test_a_worker_dying_while_the_group_forms_fails_the_start(llama_dir):
    # A worker that dies inside its own join must not leave rank 0 waiting for the
    # rendezvous timeout (30 minutes). Killed inside the join, or just after it (rank 0's
    # first collective then breaks): either way a WorkerError within seconds. In a process
    # of its own: a join that rank 0 gives up stays blocked until it times out.
    try:
        done = subprocess.run([sys.executable, "-u", "-c", _KILL_WHILE_JOINING, str(llama_dir)],
                              capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as e:  # whether it hung before its answer or after
        out, err = (x.decode() if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr))
        pytest.fail(f"no exit within 300 s; stdout: {out!r}; stderr: {err[-3000:]}")
    assert done.returncode == 0, done.stderr[-2000:]
    seconds, message = done.stdout.strip().splitlines()[-1].split(" ", 1)
    assert float(seconds) < 60
    assert re.match(r"tensor-parallel worker batchinfer-tp1 exited \(exit code -9\) while",
                    message), message


def test_a_step_rank0_leaves_part_way_stops_the_engine(llama_dir, monkeypatch):
    llm = LLM(str(llama_dir), device="cpu", num_kv_blocks=16, tensor_parallel_size=2)
    try:
        model = llm.llm_engine.model_runner.model

        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt
        monkeypatch.setattr(model, "compute_logits", interrupted)
        with pytest.raises(KeyboardInterrupt):
            llm.generate([[1, 2, 3]], GREEDY)
        monkeypatch.undo()
        # the worker may still be inside the step's collectives: no silent wrong tokens
        with pytest.raises(RuntimeError, match="out of step"):
            llm.generate([[1, 2, 3]], GREEDY)
    finally:
        llm.shutdown()
    assert not llm.llm_engine.tensor_parallel


def test_job_with_two_ranks(tmp_path, llama_dir):
    from click.testing import CliRunner

    from batchinfer.job.cli import run
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"row {i} says"}) + "\n" for i in range(5)))
    outputs = {}
    for tp in ("1", "2"):
        result = CliRunner().invoke(run, [
            str(path), "--model", str(llama_dir), "-o", str(tmp_path / f"out{tp}"),
            "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "32", "--max-tokens",
            "6", "--ignore-eos", "--no-progress", "--tensor-parallel-size", tp])
        assert result.exit_code == 0, result.output
        import pyarrow.dataset as ds
        table = ds.dataset(str(tmp_path / f"out{tp}")).to_table().to_pylist()
        outputs[tp] = sorted((r["id"], r["completion"], r["output_tokens"]) for r in table)
    assert len(outputs["2"]) == 5 and outputs["2"] == outputs["1"]
