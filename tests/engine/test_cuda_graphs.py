"""Decode steps through CUDA graphs: the sizes captured, the padded static-buffer forward
pass (checked on CPU with the Triton kernels interpreted, capture=False), and on a GPU the
captured graphs against eager execution."""
from __future__ import annotations

import random

import pytest
import torch

from batchinfer import LLM, SamplingParams
from batchinfer.engine.cuda_graphs import capture_sizes

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(12) == [1, 2, 4, 8, 12]
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256
    assert all(b - a == 8 for a, b in zip(sizes[3:], sizes[4:]))
    assert capture_sizes(4096)[-1] == 512  # larger batches run eagerly


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 900) for _ in range(rng.randrange(5, 60))] for _ in range(n)]


def _params(n: int) -> list[SamplingParams]:
    # different lengths, so the decode batch shrinks through sizes that need padding
    return [SamplingParams(max_tokens=3 + 2 * i, temperature=0.0, ignore_eos=True)
            for i in range(n)]


def _generate(llm: LLM, n: int) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(n), _params(n))]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU form of the check")
@pytest.mark.parametrize("fixture", ["llama_dir", "mistral_dir"])
def test_padded_static_forward_matches_plain_steps(fixture, request):
    """capture=False runs exactly what a graph would replay: padding rows (no KV write,
    context 0) must leave every real row's tokens unchanged."""
    model_dir = str(request.getfixturevalue(fixture))
    kwargs = dict(model=model_dir, attention_backend="triton", dtype="float32", block_size=8,
                  max_num_seqs=7, num_kv_blocks=96, device="cpu")
    expected = _generate(LLM(**kwargs), 7)
    llm = LLM(**kwargs)
    runner = llm.llm_engine.model_runner
    runner.graphs = runner.build_decode_graphs(capture=False)
    assert runner.graphs.sizes == [1, 2, 4, 7]
    assert _generate(llm, 7) == expected
    assert runner.num_graph_steps >= 10


@cuda_only
@pytest.mark.parametrize("fixture", ["llama_dir", "mistral_dir"])
def test_graphs_match_eager(fixture, request):
    model_dir = str(request.getfixturevalue(fixture))
    kwargs = dict(model=model_dir, dtype="float32", max_num_seqs=20, max_model_len=512)
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
    assert outs[0] == outs[1]
