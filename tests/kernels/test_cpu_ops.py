"""Fused elementwise ops for CPUs (kernels/cpu/ops.c) against torch's own sequence of
operations, in bfloat16 and float32, and the model layers that use them."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchinfer import LLM, SamplingParams
from batchinfer.kernels import cpu


@pytest.fixture(scope="module")
def ops(built_or_skip):
    return cpu.ops.OpsKernels(built_or_skip(cpu.ops, "the CPU ops"))


def torch_rms_norm(x, weight, eps):
    """transformers' LlamaRMSNorm for a bfloat16 input."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("shape", [(1, 16), (37, 576), (2, 9, 1536)])
def test_silu_mul_gives_torchs_bits(ops, shape):
    gen = torch.Generator().manual_seed(shape[-1])
    gate = (torch.randn(shape, generator=gen) * 6).bfloat16()
    up = torch.randn(shape, generator=gen).bfloat16()
    gate.view(-1)[:4] = torch.tensor([0.0, -0.0, 90.0, -90.0])  # zero and both exp clamps
    expected = F.silu(gate).mul(up)
    out = ops.silu_mul_(gate.clone(), up)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("scale", [1.0, 4.0, 12.0])
def test_gelu_tanh_mul_as_torch_computes_it(ops, scale):
    """Gemma's activation: bfloat16 as torch's F.gelu(approximate="tanh") * up but for a
    rare last-place difference (the float32 tanh is computed another way), the negative
    tail's -0 included; float32 within rounding."""
    gen = torch.Generator().manual_seed(int(scale))
    gate = torch.randn(300, 1152, generator=gen) * scale
    gate.view(-1)[:6] = torch.tensor([0.0, -0.0, 90.0, -90.0, -6.0, 12.0])
    up = torch.randn(300, 1152, generator=gen)
    expected = F.gelu(gate.bfloat16(), approximate="tanh").mul(up.bfloat16())
    out = ops.gelu_tanh_mul_(gate.bfloat16(), up.bfloat16())
    differ = out != expected
    assert differ.float().mean() < 1e-4
    ulp = (expected.float().abs() * 2 ** -7).clamp(min=1e-30)
    tail = 2 ** -23 * (gate.abs() * up.abs())  # 1 + tanh's own rounding, where it is all
    assert ((out.float() - expected.float()).abs()[differ]
            <= torch.maximum(ulp, tail)[differ]).all()
    assert out.view(-1)[3].item() == 0 and out.view(-1)[2] == expected.view(-1)[2]
    expected32 = F.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(ops.gelu_tanh_mul_(gate.clone(), up), expected32,
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape", [(1, 64), (300, 576), (2, 7, 256)])
def test_rms_norm_matches_transformers(ops, shape):
    gen = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(shape, generator=gen) * 4).bfloat16()
    weight = torch.randn(shape[-1], generator=gen).bfloat16()
    expected = torch_rms_norm(x, weight, 1e-5)
    out = ops.rms_norm(x, weight, 1e-5)
    # the float32 sum of squares adds in another order: at most a rare last-place difference
    differ = out != expected
    assert differ.float().mean() < 1e-3
    ulp = (expected.float().abs() * 2 ** -7).clamp(min=1e-30)
    assert ((out.float() - expected.float()).abs()[differ] <= ulp[differ]).all()


def test_rms_norm_with_the_residual_add_fused(ops):
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(300, 576, generator=gen) * 4).bfloat16()
    residual = (torch.randn(300, 576, generator=gen) * 4).bfloat16()
    weight = torch.randn(576, generator=gen).bfloat16()
    summed = residual + x
    expected = torch_rms_norm(summed, weight, 1e-5)
    out = ops.rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(residual, summed)  # updated in place, torch's bfloat16 add
    differ = out != expected
    assert differ.float().mean() < 1e-3
    with pytest.raises(ValueError, match="out of contract"):
        ops.rms_norm(x, weight, 1e-5, x)  # the residual may not be x itself


def assert_rms_close(out, expected):
    """bfloat16: at most a rare last-place difference (the sum of squares' order);
    float32: within rounding."""
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-30)
        return
    differ = out != expected
    assert differ.float().mean() < 1e-3
    ulp = (expected.float().abs() * 2 ** -7).clamp(min=1e-30)
    assert ((out.float() - expected.float()).abs()[differ] <= ulp[differ]).all()


def test_rms_norm_in_gemmas_order_with_a_float32_weight(ops):
    """bfloat16 x with a float32 weight (Gemma's 1 + w): the product is taken before the
    one rounding, not after rounding the normalised row."""
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(300, 1152, generator=gen) * 4).bfloat16()
    scale = 1.0 + torch.randn(1152, generator=gen) * 0.3
    xf = x.float()
    expected = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * scale).bfloat16()
    out = ops.rms_norm(x, scale, 1e-6, gemma_order=True)
    assert_rms_close(out, expected)
    llama_order = torch_rms_norm(x, scale.bfloat16(), 1e-6)
    assert (llama_order != expected).float().mean() > 0.05  # the two orders do differ
    with pytest.raises(ValueError, match="out of contract"):  # only when asked for
        ops.rms_norm(x, scale, 1e-6)
    with pytest.raises(ValueError, match="out of contract"):  # a bfloat16 order only
        ops.rms_norm(x.float(), scale, 1e-6, gemma_order=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_over_some_heads_of_a_projection_in_place(ops, dtype):
    """q's heads of a fused qkv output ([tokens, heads, head_dim] with a token stride of the
    whole row): normalised in place, every other element of the row untouched."""
    gen = torch.Generator().manual_seed(9)
    tokens, q_heads, kv_heads, head_dim = 37, 6, 2, 64
    qkv = (torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=gen) * 4).to(dtype)
    weight = torch.randn(head_dim, generator=gen).to(dtype)
    heads = qkv.view(tokens, q_heads + 2 * kv_heads, head_dim)
    before = qkv.clone()
    q = heads[:, :q_heads]
    xf = q.float()
    expected = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    fresh = ops.rms_norm(q, weight, 1e-6)  # a new contiguous tensor
    assert fresh.is_contiguous() and torch.equal(q, before.view_as(heads)[:, :q_heads])
    assert ops.rms_norm(q, weight, 1e-6, out=q) is q
    assert_rms_close(q, expected)
    assert torch.equal(q, fresh)
    assert torch.equal(heads[:, q_heads:], before.view_as(heads)[:, q_heads:])
    k = heads[:, q_heads::100]  # one head: any stride between heads
    assert k.shape[1] == 1 and k.stride(1) != head_dim
    xf = k.float()
    expected = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    assert_rms_close(ops.rms_norm(k, weight, 1e-6, out=k), expected)
    with pytest.raises(ValueError, match="out of contract"):  # heads not contiguous
        ops.rms_norm(heads[:, ::2], weight, 1e-6)
    with pytest.raises(ValueError, match="out of contract"):  # tokens' rows overlap
        ops.rms_norm(heads[:1].expand(3, -1, -1), weight, 1e-6)
    with pytest.raises(ValueError, match="out of contract"):  # the residual wants x contiguous
        ops.rms_norm(q, weight, 1e-6, torch.zeros(q.shape, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_model_norms_take_the_kernel_as_their_torch_form_computes(ops, monkeypatch, dtype):
    """RMSNorm and GemmaRMSNorm: the whole-row norm, the per-head in-place norm, and the
    torch fallback each give what the layer's torch form gives."""
    from batchinfer.model import ops as model_ops
    from batchinfer.model.llama import GemmaRMSNorm, RMSNorm
    gen = torch.Generator().manual_seed(3)
    qkv = (torch.randn(29, 8 * 32, generator=gen) * 3).to(dtype)
    heads = qkv.view(29, 8, 32)
    for cls in (RMSNorm, GemmaRMSNorm):
        norm = cls(32, 1e-6)
        norm.weight.data = (torch.randn(32, generator=gen) * 0.3).to(dtype)
        expected = model_ops.torch_rms_norm(heads[:, 2:5], norm.weight, norm.eps, norm.gemma)
        assert_rms_close(norm(heads[:, 2:5].contiguous()), expected)
        x = qkv.clone().view(29, 8, 32)
        assert_rms_close(norm.forward_(x[:, 2:5]), expected)
        assert torch.equal(x[:, 5:], heads[:, 5:])
        monkeypatch.setattr(cpu.ops, "available", lambda: False)
        x = qkv.clone().view(29, 8, 32)
        assert torch.equal(norm.forward_(x[:, 2:5]), expected)  # torch's own, copied in
        monkeypatch.undo()


@pytest.mark.parametrize("shape", [(1, 16), (37, 576), (2, 9, 1536)])
def test_float32_silu_mul_within_a_few_ulp_of_torch(ops, shape):
    gen = torch.Generator().manual_seed(shape[-1])
    gate = torch.randn(shape, generator=gen) * 6
    up = torch.randn(shape, generator=gen)
    gate.view(-1)[:4] = torch.tensor([0.0, -0.0, 90.0, -90.0])
    expected = F.silu(gate).mul(up)
    out = ops.silu_mul_(gate.clone(), up)
    # exp's polynomial differs from torch's in the last bits
    torch.testing.assert_close(out, expected, rtol=4e-7, atol=1e-30)


@pytest.mark.parametrize("residual", [False, True])
def test_float32_rms_norm_within_a_few_ulp_of_transformers(ops, residual):
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(300, 576, generator=gen) * 4
    res = torch.randn(300, 576, generator=gen) * 4
    weight = torch.randn(576, generator=gen)
    summed = res + x
    source = summed if residual else x
    expected = weight * (source * torch.rsqrt(source.pow(2).mean(-1, keepdim=True) + 1e-5))
    res_in = res.clone()
    out = ops.rms_norm(x, weight, 1e-5, res_in if residual else None)
    if residual:
        assert torch.equal(res_in, summed)  # the same float32 add as torch's
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-30)
    with pytest.raises(ValueError, match="out of contract"):  # one dtype for all
        ops.rms_norm(x, weight.bfloat16(), 1e-5)


def test_only_contiguous_bfloat16_or_float32_cpu_tensors_with_16_multiple_rows(ops):
    assert cpu.ops.supports(torch.zeros(4, 32, dtype=torch.bfloat16))
    assert cpu.ops.supports(torch.zeros(4, 32))                            # float32
    assert not cpu.ops.supports(torch.zeros(4, 32, dtype=torch.float16))
    assert not cpu.ops.supports(torch.zeros(4, 40, dtype=torch.bfloat16))  # 40 % 16
    assert not cpu.ops.supports(torch.zeros(4, 64, dtype=torch.bfloat16)[:, :32])
    with pytest.raises(ValueError, match="out of contract"):
        ops.rms_norm(torch.zeros(4, 32, dtype=torch.bfloat16), torch.zeros(16, dtype=torch.bfloat16), 1e-6)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("fixture", ["llama_dir", "qwen3_dir", "gemma3_dir"])
def test_engine_output_with_and_without_the_ops(fixture, request, monkeypatch, dtype):
    """Llama's norms; Qwen3's per-head q/k norms in place; Gemma 3's norms in its order."""
    model_dir = request.getfixturevalue(fixture)
    prompts = ["The quick brown fox", "Batch inference on a CPU", "a b c d e f g"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with_ops = [o.outputs[0].token_ids
                for o in LLM(model=str(model_dir), dtype=dtype).generate(prompts, params)]
    monkeypatch.setattr(cpu.ops, "available", lambda: False)
    without = [o.outputs[0].token_ids
               for o in LLM(model=str(model_dir), dtype=dtype).generate(prompts, params)]
    assert with_ops == without
