"""The C shared-prefix attention kernel (kernels/cpu/shared_prefix.c) against attention in
float32: float32 inputs within float32 rounding, bfloat16 inputs as closely as torch's flash
kernel gets on the same inputs."""
from __future__ import annotations

import platform

import pytest
import torch

from batchinfer.kernels import cpu


@pytest.fixture(scope="module")
def kernel(built_or_skip):
    """The kernel with bfloat16 on, on the AVX512-BF16 dot products or on FMAs, whichever
    the build has, also where the engine leaves bfloat16 to torch's flash kernel (AMX
    hosts, CPUs without the instructions)."""
    kernel = cpu.shared_prefix.SharedPrefixKernel(
        built_or_skip(cpu.shared_prefix, "the shared-prefix kernel"))
    kernel.use_bf16 = True
    return kernel


def exact(q, k, v, scale):
    """(out [T, Hkv, G, D], lse [T, Hkv, G]) in float32 (float64 products) from the inputs."""
    t, h, d = q.shape
    hkv = k.shape[1]
    s = torch.einsum("thgd,phd->thgp", q.double().view(t, hkv, h // hkv, d), k.double()) * scale
    out = torch.einsum("thgp,phd->thgd", torch.softmax(s, -1), v.double())
    return out.float(), s.logsumexp(-1).float()


def flash(q, k, v, scale):
    t, h, d = q.shape
    hkv = k.shape[1]
    qs = q.view(t, hkv, h // hkv, d).permute(1, 0, 2, 3).reshape(1, hkv, -1, d)
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qs, k.transpose(0, 1)[None], v.transpose(0, 1)[None], 0.0, False, scale=scale)[0]
    return out.view(hkv, t, h // hkv, d).transpose(0, 1)


# (tokens, keys, KV heads, group, head_dim): keys past one 64-key tile and one 512-key
# softmax block, and short of either; head sizes with 1 to 16 vectors of 16; MHA and GQA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, keys, kv_heads, group, head_dim", [
    (1, 5, 1, 1, 16), (7, 64, 2, 3, 48), (37, 100, 3, 3, 64), (300, 256, 4, 2, 32),
    (9, 513, 2, 4, 128), (5, 1100, 1, 2, 256), (130, 129, 8, 1, 80),
])
def test_matches_exact_attention(kernel, dtype, tokens, keys, kv_heads, group, head_dim):
    gen = torch.Generator().manual_seed(tokens * keys)
    # a strided query (rows of a wider tensor), scores spread over a wide range
    wide = torch.randn(tokens, kv_heads * group + 3, head_dim, generator=gen) * 3
    q = wide.to(dtype)[:, :kv_heads * group]
    k = torch.randn(keys, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(keys, kv_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    out, lse = kernel(q, k, v, scale)
    want, want_lse = exact(q, k, v, scale)
    assert out.dtype == dtype and out.shape == (tokens, kv_heads, group, head_dim)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    else:  # the output rounds to bfloat16 and its weights were rounded too, as flash's are
        err = (out.float() - want).abs().max().item()
        flash_err = (flash(q, k, v, scale).float() - want).abs().max().item()
        assert err <= 1.25 * flash_err + 1e-3


def test_out_of_contract_arguments_are_refused(kernel):
    q = torch.zeros(4, 6, 64, dtype=torch.bfloat16)
    k = torch.zeros(10, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out of contract"):
        kernel(q.half(), k.half(), k.half(), 0.1)             # float16: torch's path
    with pytest.raises(ValueError, match="out of contract"):
        kernel(q.float(), k, k, 0.1)                           # dtypes differ
    with pytest.raises(ValueError, match="out of contract"):
        kernel(q, k[:, :1], k, 0.1)                            # K and V shapes differ
    strided = torch.zeros(4, 64, 6).transpose(1, 2)            # [4, 6, 64], head_dim strided
    with pytest.raises(ValueError, match="out of contract"):
        kernel(strided, k.float(), k.float(), 0.1)
    assert not kernel.supports(torch.float32, 6, 2, 40)        # not a multiple of 16


def test_threads_calling_at_once_keep_their_own_scratch(kernel):
    """The call releases the GIL: two threads with different key counts must not lay their
    keys out in one buffer."""
    import threading
    gen = torch.Generator().manual_seed(3)
    cases = []
    for keys in (40, 700):  # calls long enough to overlap
        q = torch.randn(512, 4, 32, generator=gen)
        k, v = (torch.randn(keys, 2, 32, generator=gen) for _ in range(2))
        cases.append((q, k, v, exact(q, k, v, 0.2)[0]))
    errors = []

    def work(q, k, v, want):
        for _ in range(30):
            out, _ = kernel(q, k, v, 0.2)
            if not torch.allclose(out, want, rtol=1e-4, atol=1e-4):
                errors.append(k.shape[0])

    threads = [threading.Thread(target=work, args=case) for case in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_nan_key_reaches_every_row(kernel, dtype):
    """Every query row sees every shared key, so a NaN in one key's K shows in every row's
    output and log-sum-exp, as it does in torch's kernels."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(20, 4, 32, generator=gen).to(dtype)
    k = torch.randn(600, 2, 32, generator=gen).to(dtype)
    v = torch.randn(600, 2, 32, generator=gen).to(dtype)
    k[550, 1, 7] = float("nan")  # in the second 512-key block, KV head 1
    out, lse = kernel(q, k, v, 0.2)
    assert out[:, 1].isnan().all() and lse[:, 1].isnan().all()
    assert not out[:, 0].isnan().any() and not lse[:, 0].isnan().any()


def test_the_fma_form_gives_the_bfloat16_instructions_bits(kernel, monkeypatch):
    """Built without AVX512-BF16 (x86-64-v3: AVX2), bfloat16 runs its dot products as two
    FMAs in vdpbf16ps's order; on a CPU with the instructions both builds give the same
    bits, the AVX2 one in 8-lane vectors and register blocks of its own."""
    if not kernel.bf16_instructions or platform.machine() != "x86_64":
        pytest.skip("this build has no AVX512-BF16 instructions to compare with")
    monkeypatch.setattr(cpu.build, "_built", {})
    monkeypatch.setenv(cpu.build.ARCH_ENV, "x86-64-v3")
    avx2 = cpu.shared_prefix.SharedPrefixKernel(cpu.build.build(cpu.shared_prefix.SOURCE))
    assert not avx2.bf16_instructions
    avx2.use_bf16 = True
    gen = torch.Generator().manual_seed(5)
    for tokens, keys, kv_heads, group, head_dim in [(37, 600, 3, 3, 64), (9, 130, 2, 4, 128)]:
        q = (torch.randn(tokens, kv_heads * group, head_dim, generator=gen) * 3).bfloat16()
        k, v = (torch.randn(keys, kv_heads, head_dim, generator=gen).bfloat16() for _ in range(2))
        out, lse = kernel(q, k, v, head_dim ** -0.5)
        out2, lse2 = avx2(q, k, v, head_dim ** -0.5)
        assert torch.equal(out, out2) and torch.equal(lse, lse2)
