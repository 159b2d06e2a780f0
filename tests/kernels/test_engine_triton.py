"""Greedy generation with attention_backend="triton" (interpreted on CPU) equals the torch
path, through chunked prefill, prefix-cache hits and mixed decode/prefill steps."""
from __future__ import annotations

import random

import pytest

from batchinfer import LLM, SamplingParams


@pytest.fixture(params=["llama", "mistral"])
def model_dir(request):
    """Tiny Llama (GQA, head_dim 32) and Mistral (sliding window 64, shorter than the
    prompts), the suite's session checkpoints."""
    return request.getfixturevalue(f"{request.param}_dir")


def _generate(model_dir, backend: str, **engine_args):
    llm = LLM(model=str(model_dir), attention_backend=backend, dtype="float32",
              block_size=8, num_kv_blocks=64, max_num_batched_tokens=24, max_num_seqs=4,
              enable_prefix_caching=True, **engine_args)
    rng = random.Random(0)
    prefix = [rng.randrange(3, 900) for _ in range(44)]
    first = prefix + [rng.randrange(3, 900) for _ in range(29)]
    shares_prefix = prefix + [rng.randrange(3, 900) for _ in range(21)]
    other = [rng.randrange(3, 900) for _ in range(37)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = llm.generate([first], params)
    # The second call hits the first prompt's cached blocks and mixes decodes of one
    # sequence with prefill chunks of the other.
    outs += llm.generate([shares_prefix, other], params)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs], llm.stats()


def test_greedy_generation_matches_torch_backend(model_dir):
    torch_ids, torch_cached, torch_stats = _generate(model_dir, "torch")
    triton_ids, triton_cached, triton_stats = _generate(model_dir, "triton")
    assert triton_ids == torch_ids
    assert all(len(ids) == 6 for ids in triton_ids)
    assert triton_cached == torch_cached
    assert triton_cached[1] >= 40  # prefix-cache hit: the shared prefix's full blocks
    assert triton_stats["prefix_cache_hit_tokens"] == torch_stats["prefix_cache_hit_tokens"] > 0


def test_fp8_cache_matches_torch_backend(llama_dir, monkeypatch):
    """kv_cache_dtype="fp8" through the Triton kernels, their KV write included (the CPU
    rope kernel, which writes the cache itself when it applies, is kept out of both runs),
    gives the torch path's tokens."""
    from batchinfer.kernels import cpu
    monkeypatch.setattr(cpu.rope, "supports", lambda qk, cache_dtype=None: False)
    torch_ids, torch_cached, torch_stats = _generate(llama_dir, "torch", kv_cache_dtype="fp8")
    triton_ids, triton_cached, triton_stats = _generate(llama_dir, "triton",
                                                        kv_cache_dtype="fp8")
    assert triton_stats["kv_cache_dtype"] == "float8_e4m3fn"
    assert triton_ids == torch_ids and triton_cached == torch_cached
    assert triton_cached[1] >= 40


@pytest.mark.parametrize("model", ["mixtral", "qwen3_moe", "glm4_moe"])
def test_moe_models_with_the_grouped_kernels_match_the_expert_loop(request, monkeypatch, model):
    """The fused MoE products (what CUDA runs), interpreted, give the expert loop's tokens.
    (Both with the experts' weights as loaded: on CPU they are otherwise packed for oneDNN,
    which only the loop can use.)"""
    from batchinfer.model import cpu_linear
    from batchinfer.model.moe import SparseMoE
    monkeypatch.setenv(cpu_linear.ENV_SWITCH, "0")
    cpu_linear.available.cache_clear()
    request.addfinalizer(cpu_linear.available.cache_clear)
    path = str(request.getfixturevalue(f"{model}_dir"))
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (5, 23, 40)]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    loop = LLM(model=path, device="cpu")
    expected = [o.outputs[0].token_ids for o in loop.generate(prompts, params)]
    llm = LLM(model=path, device="cpu")
    model_ = llm.llm_engine.model_runner.model
    blocks = [layer.mlp for layer in model_.model.layers if isinstance(layer.mlp, SparseMoE)]
    assert blocks and not model_.graph_safe
    for block in blocks:
        block.use_fused = True
    assert model_.graph_safe
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
