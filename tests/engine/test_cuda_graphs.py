"""Decode steps through CUDA graphs: the sizes captured, when they are captured (tensor
parallelism included), the padded static-buffer forward pass (checked on CPU with the
Triton kernels interpreted, capture=False), and on GPUs the captured graphs against eager
execution, in one process and across two."""
from __future__ import annotations

import random

import pytest
import torch

from batchinfer import LLM, SamplingParams
from batchinfer.engine.cuda_graphs import capture_sizes, captures_decode_graphs
from batchinfer.model.parallel import TensorParallel

def cuda_only(test):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(),
                                              reason="needs CUDA")(test))


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(12) == [1, 2, 4, 8, 12]
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256
    assert all(b - a == 8 for a, b in zip(sizes[3:], sizes[4:]))
    assert capture_sizes(4096)[-1] == 512  # larger batches run eagerly


def test_tensor_parallel_ranks_capture_graphs_too(monkeypatch):
    monkeypatch.setattr(TensorParallel, "size", 2)
    cuda = torch.device("cuda", 1)
    assert captures_decode_graphs(cuda, enforce_eager=False, backend="triton", graph_safe=True)
    assert not captures_decode_graphs(cuda, enforce_eager=True, backend="triton",
                                      graph_safe=True)
    assert not captures_decode_graphs(cuda, enforce_eager=False, backend="torch",
                                      graph_safe=True)
    assert not captures_decode_graphs(cuda, enforce_eager=False, backend="triton",
                                      graph_safe=False)
    assert not captures_decode_graphs(torch.device("cpu"), enforce_eager=False,
                                      backend="triton", graph_safe=True)
    # before capture, every rank meets once in an all-reduce
    reduced = []
    monkeypatch.setattr(TensorParallel, "all_reduce", reduced.append)
    TensorParallel.warm_up(torch.device("cpu"))
    assert len(reduced) == 1


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 900) for _ in range(rng.randrange(5, 60))] for _ in range(n)]


def _params(n: int) -> list[SamplingParams]:
    # different lengths, so the decode batch shrinks through sizes that need padding
    return [SamplingParams(max_tokens=2 + i, temperature=0.0, ignore_eos=True)
            for i in range(n)]


def _generate(llm: LLM, n: int) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(n), _params(n))]


def _cpu_llm(model_dir, static: bool, **kwargs) -> LLM:
    """A CPU engine on the interpreted Triton kernels; with static=True its decode steps take
    the padded static-buffer path (what a graph replays) without capture."""
    llm = LLM(model=str(model_dir), attention_backend="triton", dtype="float32", block_size=8,
              num_kv_blocks=96, device="cpu", **kwargs)
    if static:
        runner = llm.llm_engine.model_runner
        runner.graphs = runner.build_decode_graphs(capture=False)
    return llm


@pytest.fixture
def many_splits(monkeypatch):
    """Split-KV as on a 132-SM GPU with 16-token splits: the static path, which sizes splits
    for max_model_len, then has empty splits past every sequence's end."""
    from batchinfer.kernels.triton import decode
    monkeypatch.setattr(decode, "sm_count", lambda device: 132)
    monkeypatch.setattr(decode, "MIN_TOKENS_PER_SPLIT", 16)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU form of the check")
@pytest.mark.parametrize("fixture", ["llama_dir", "mistral_dir"])
def test_padded_static_forward_matches_plain_steps(fixture, request, many_splits):
    """capture=False runs exactly what a graph would replay: padding rows (no KV write,
    context 0) must leave every real row's tokens unchanged."""
    model_dir = request.getfixturevalue(fixture)
    kwargs = dict(max_num_seqs=7, max_model_len=160)  # up to 10 splits
    expected = _generate(_cpu_llm(model_dir, static=False, **kwargs), 7)
    llm = _cpu_llm(model_dir, static=True, **kwargs)
    runner = llm.llm_engine.model_runner
    assert runner.graphs.sizes == [1, 2, 4, 7]
    assert _generate(llm, 7) == expected
    # every decode step: batches of 7 down to 1 (6 and 5 padded to 7, 3 to 4)
    assert runner.num_graph_steps >= 7


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU form of the check")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_one_token_prompt_chunks_take_the_static_path(llama_dir, kv_cache_dtype):
    """With a 1-token budget prompts advance a token a step: every step is decode-shaped,
    and the steps inside a prompt sample nothing. (With an FP8 cache, the padding rows
    store nothing either.)"""
    prompts = _prompts(3, seed=5)
    prompts = [p[:9] for p in prompts]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    kwargs = dict(max_num_seqs=4, max_num_batched_tokens=1, kv_cache_dtype=kv_cache_dtype)
    plain = _cpu_llm(llama_dir, static=False, **kwargs)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    llm = _cpu_llm(llama_dir, static=True, **kwargs)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    # every prompt token, then the decodes (the first output token comes with the prompt)
    assert llm.llm_engine.model_runner.num_graph_steps >= sum(map(len, prompts))


@cuda_only
@pytest.mark.parametrize("fixture, kv_cache_dtype", [("llama_dir", "auto"),
                                                     ("mistral_dir", "auto"),
                                                     ("llama_dir", "fp8")])
def test_graphs_match_eager(fixture, kv_cache_dtype, request):
    model_dir = str(request.getfixturevalue(fixture))
    kwargs = dict(model=model_dir, dtype="float32", max_num_seqs=20, max_model_len=512,
                  kv_cache_dtype=kv_cache_dtype)
    eager = LLM(enforce_eager=True, **kwargs)
    assert eager.llm_engine.model_runner.graphs is None
    graphs = LLM(**kwargs)
    runner = graphs.llm_engine.model_runner
    assert runner.graphs is not None and sorted(runner.graphs.graphs) == [1, 2, 4, 8, 16, 20]
    assert _generate(graphs, 20) == _generate(eager, 20)
    assert runner.num_graph_steps >= 20


@cuda_only
def test_graphs_with_sampling_and_prefix_hits(llama_dir):
    """Seeded sampling and prefix-cache hits give the same tokens with and without graphs."""
    prefix = _prompts(1, seed=3)[0] * 2
    prompts = [prefix + p for p in _prompts(12, seed=4)]
    params = [SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=i) for i in range(12)]
    outs = []
    for eager in (True, False):
        llm = LLM(model=str(llama_dir), dtype="float32", max_num_seqs=16, max_model_len=512,
                  enforce_eager=eager)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        assert llm.stats()["prefix_cache_hit_tokens"] > 0
        assert (llm.llm_engine.model_runner.num_graph_steps > 0) == (not eager)
    assert outs[0] == outs[1]


@cuda_only
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("fixture", ["llama_dir", "llama_kv1_dir"])
def test_graphs_across_two_ranks_match_eager(fixture, request):
    """Each rank captures the same sizes; replays meet in the captured all-reduces."""
    kwargs = dict(model=str(request.getfixturevalue(fixture)), dtype="float32",
                  max_num_seqs=20, max_model_len=512, tensor_parallel_size=2)
    eager = LLM(enforce_eager=True, **kwargs)
    try:
        assert eager.llm_engine.model_runner.graphs is None
        expected = _generate(eager, 20)
    finally:
        eager.shutdown()
    llm = LLM(**kwargs)
    try:
        runner = llm.llm_engine.model_runner
        assert runner.graphs is not None and sorted(runner.graphs.graphs) == [1, 2, 4, 8, 16, 20]
        assert _generate(llm, 20) == expected
        assert runner.num_graph_steps >= 20
    finally:
        llm.shutdown()
