"""Rotary embedding plus KV-cache write in one C pass (kernels/cpu/rope.c) against the
model's torch path: the same bits in q, in the cache slots written, and nowhere else."""
from __future__ import annotations

import pytest
import torch

from batchinfer import LLM, SamplingParams
from batchinfer.attention.torch_backend import write_kv
from batchinfer.kernels import cpu
from batchinfer.model.rope import RotaryEmbedding, apply_rotary


@pytest.fixture(scope="module")
def rope_write(built_or_skip):
    return cpu.rope.RopeKernel(built_or_skip(cpu.rope, "the CPU rope op"))


def case(dtype, num_tokens, num_heads, num_kv_heads, head_dim, seed=0):
    """qk and v as strided views of one fused qkv product, cos/sin for random positions,
    NaN caches and shuffled slots."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
           * 3).to(dtype)
    qk_width = (num_heads + num_kv_heads) * head_dim
    qk = qkv[:, :qk_width].view(num_tokens, num_heads + num_kv_heads, head_dim)
    v = qkv[:, qk_width:].view(num_tokens, num_kv_heads, head_dim)
    rope = RotaryEmbedding(head_dim, 4096, {"rope_theta": 10000.0, "rope_type": "default"},
                           dtype)
    cos, sin = rope.lookup(torch.randint(0, 4096, (num_tokens,), generator=gen))
    block_size, num_blocks = 16, -(-num_tokens // 16) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    return qk, v, cos, sin, slots, k_cache, v_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens, num_heads, num_kv_heads, head_dim", [
    (1, 8, 4, 32),      # the bench's tiny shape, one decode
    (37, 9, 3, 64),     # SmolLM2-135M
    (5, 4, 1, 128),     # Llama-style head_dim
])
def test_gives_the_torch_paths_bits(rope_write, dtype, num_tokens, num_heads, num_kv_heads,
                                    head_dim):
    qk, v, cos, sin, slots, k_cache, v_cache = case(dtype, num_tokens, num_heads, num_kv_heads,
                                                    head_dim)
    rotated = apply_rotary(qk, cos, sin)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv(rotated[:, num_heads:], v, k_ref, v_ref, slots)

    q = rope_write(qk, v, cos, sin, slots, k_cache, v_cache)
    assert q.is_contiguous() and torch.equal(q, rotated[:, :num_heads])
    # equal where written, NaN (untouched) everywhere else
    assert torch.equal(k_cache.nan_to_num(7.0), k_ref.nan_to_num(7.0))
    assert torch.equal(v_cache.nan_to_num(7.0), v_ref.nan_to_num(7.0))
    assert int(k_cache.isnan().flatten(0, 1).all(-1).all(-1).sum()) == k_cache.shape[0] * 16 - num_tokens


def test_negative_slots_store_nothing(rope_write):
    """Padding rows (slot -1, as in a CUDA-graph batch) get q rotated and write no KV."""
    qk, v, cos, sin, slots, k_cache, v_cache = case(torch.float32, 6, 8, 4, 32)
    slots[[1, 4]] = -1
    rotated = apply_rotary(qk, cos, sin)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    write_kv(rotated[keep, 8:], v[keep], k_ref, v_ref, slots[keep])
    q = rope_write(qk, v, cos, sin, slots, k_cache, v_cache)
    assert torch.equal(q, rotated[:, :8])
    assert torch.equal(k_cache.nan_to_num(7.0), k_ref.nan_to_num(7.0))
    assert torch.equal(v_cache.nan_to_num(7.0), v_ref.nan_to_num(7.0))
    assert int(k_cache.isnan().flatten(0, 1).all(-1).all(-1).sum()) == k_cache.shape[0] * 16 - 4


def test_rejects_what_it_does_not_handle(rope_write):
    qk, v, cos, sin, slots, k_cache, v_cache = case(torch.float32, 4, 8, 4, 32)
    assert cpu.rope.supports(qk)
    assert not cpu.rope.supports(qk.half())                         # float16
    assert not cpu.rope.supports(torch.zeros(4, 12, 48))            # head_dim % 32
    bad = slots.clone()
    bad[2] = k_cache.shape[0] * k_cache.shape[1]                    # one past the cache
    with pytest.raises(ValueError, match="outside the cache"):
        rope_write(qk, v, cos, sin, bad, k_cache, v_cache)
    bad[2] = -2                                                     # only -1 means "skip"
    with pytest.raises(ValueError, match="outside the cache"):
        rope_write(qk, v, cos, sin, bad, k_cache, v_cache)
    with pytest.raises(ValueError, match="out of contract"):
        rope_write(qk, v, cos, sin, slots.int(), k_cache, v_cache)  # int32 slots
    with pytest.raises(ValueError, match="out of contract"):
        rope_write(qk, v.bfloat16(), cos, sin, slots, k_cache, v_cache)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_output_is_the_same_without_it(llama_dir, monkeypatch, dtype):
    prompts = ["The quick brown fox", "Batch inference on a CPU", "a b c d e f g"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)

    def run():
        outs = LLM(model=str(llama_dir), dtype=dtype).generate(prompts, params)
        return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in outs]

    with_op = run()
    monkeypatch.setattr(cpu.rope, "available", lambda: False)
    assert run() == with_op
