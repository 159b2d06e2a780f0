"""The rotary embedding gives transformers' bits, on the strided q/k views the model uses."""
from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import rotate_half

from batchinfer.model.rope import RotaryEmbedding, apply_rotary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_apply_rotary_matches_transformers_bitwise(dtype, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    num_q, num_kv, tokens = 8, 2, 37
    rope = RotaryEmbedding(head_dim, 4096, {"rope_type": "default", "rope_theta": 500000.0}, dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    cos, sin = rope.lookup(positions)
    # q and k as the model hands them over: views into the fused qkv projection's rows
    qkv = torch.randn(tokens, (num_q + 2 * num_kv) * head_dim, generator=gen).to(dtype)
    qk = qkv[:, :(num_q + num_kv) * head_dim].view(tokens, num_q + num_kv, head_dim)
    out = apply_rotary(qk, cos, sin)
    expected = qk * cos + rotate_half(qk) * sin
    assert out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out, expected)
