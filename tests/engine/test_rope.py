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


@pytest.mark.parametrize("scaling", [
    {"factor": 4.0, "original_max_position_embeddings": 128},           # Qwen2.5's form
    {"factor": 4.0, "original_max_position_embeddings": 128, "truncate": False},
    {"factor": 40.0, "original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2,
     "mscale": 1.0, "mscale_all_dim": 0.8},                              # DeepSeek's form
    {"factor": 8.0, "original_max_position_embeddings": 256, "attention_factor": 1.25},
    {"factor": 2.0, "original_max_position_embeddings": 32768, "partial_rotary_factor": 0.5},
])
def test_yarn_matches_transformers(scaling):
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    from batchinfer.model.config import ModelConfig
    from batchinfer.model.rope import _rotated_inv_freq, attention_scaling, rotary_dim
    hf = Qwen2Config(hidden_size=256, num_attention_heads=4, max_position_embeddings=1024,
                     rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, **scaling})
    theirs = Qwen2RotaryEmbedding(hf)
    params = ModelConfig.from_hf(hf).rope["full_attention"]
    rotary = rotary_dim(params, 64)
    assert torch.equal(_rotated_inv_freq(params, rotary), theirs.inv_freq)
    assert attention_scaling(params) == theirs.attention_scaling != 1.0
    if rotary == 64:  # the table as transformers' model computes it
        positions = torch.arange(1024)
        cos, sin = theirs(torch.zeros(1, dtype=torch.float32), positions[None])
        ours = RotaryEmbedding(64, 1024, params, torch.float32)
        torch.testing.assert_close(ours.cos, cos[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(ours.sin, sin[0], rtol=0, atol=1e-6)
