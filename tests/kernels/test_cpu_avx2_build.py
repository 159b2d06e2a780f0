"""The AVX2 build of the attention kernels (BATCHINFER_CPU_ARCH=x86-64-v3: 8-lane vectors,
16 registers, bfloat16 dot products as FMAs) against the native build, on a CPU with
AVX-512: the native build is held to float64 references by the other kernel tests, and
the AVX2 one must give its results: the same bits for the shared prefix and bfloat16
decode, within a few float32 ulp (one bfloat16 ulp) where sums run in another order with
the vector width. On an AVX2 CPU the native build is the AVX2 build and
the other tests cover it."""
from __future__ import annotations

import platform
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from batchinfer.kernels import cpu

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def builds(built_or_skip):
    """module -> (native library, AVX2 library), built once for the module."""
    if platform.machine() != "x86_64" or "AVX-512" not in cpu.build.vector_isa():
        pytest.skip("no AVX-512 here: the native build is the AVX2 build")
    native = {m: built_or_skip(m, m.__name__) for m in (cpu.decode, cpu.prefill,
                                                       cpu.shared_prefix)}
    saved = dict(cpu.build._built)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(cpu.build.ARCH_ENV, "x86-64-v3")
        cpu.build._built.clear()
        with ThreadPoolExecutor(len(native)) as pool:  # (build() is safe in threads)
            avx2 = dict(zip(native, pool.map(lambda m: cpu.build.build(m.SOURCE), native)))
    cpu.build._built.clear()
    cpu.build._built.update(saved)
    assert all(avx2.values()), avx2
    return {m: (native[m], avx2[m]) for m in native}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads, group, head_dim", [(4, 2, 32), (3, 3, 64), (2, 4, 128)])
def test_decode(builds, paged_batch, dtype, num_kv_heads, group, head_dim):
    native, avx2 = (cpu.decode.DecodeKernel(path) for path in builds[cpu.decode])
    seq_lens = [1, 17, 100, 257, 64]
    batch = paged_batch(seq_lens, [1] * len(seq_lens), block_size=16,
                        num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, dtype=dtype,
                        device=CPU)
    n = len(seq_lens)
    lo, hi = torch.tensor([0, 3, 16, 0, 5], dtype=torch.int32), \
        torch.tensor(seq_lens, dtype=torch.int32)
    results = []
    for kernel in (native, avx2):
        out = torch.empty(batch.query.shape, dtype=dtype)
        lse = torch.empty(n, batch.query.shape[1])
        kernel(batch.query, batch.k_cache, batch.v_cache, batch.meta.block_tables[:n], lo, hi,
               0.3, out, lse)
        results.append((out, lse))
    (out, lse), (out2, lse2) = results
    if dtype == torch.bfloat16:
        assert torch.equal(out, out2) and torch.equal(lse, lse2)
    else:
        torch.testing.assert_close(out2, out, atol=4e-7, rtol=4e-7)
        torch.testing.assert_close(lse2, lse, atol=4e-7, rtol=4e-7)


@pytest.mark.parametrize("dtype, dot", [(torch.float32, False), (torch.bfloat16, False),
                                        (torch.bfloat16, True)])
@pytest.mark.parametrize("num_kv_heads, group, head_dim", [(4, 2, 32), (3, 3, 64), (1, 3, 256)])
def test_prefill(builds, paged_batch, dtype, dot, num_kv_heads, group, head_dim):
    seq_lens, query_lens = [5, 40, 300, 70, 600], [5, 17, 300, 1, 45]
    batch = paged_batch(seq_lens, query_lens, block_size=16, num_kv_heads=num_kv_heads,
                        group=group, head_dim=head_dim, dtype=dtype, device=CPU)
    qsl = batch.meta.query_start_loc_cpu
    chunks = torch.tensor([[i, qsl[i], qsl[i + 1], lo, seq_lens[i]]
                           for i, lo in enumerate([0, 16, 0, 64, 257])], dtype=torch.int32)
    results = []
    for path in builds[cpu.prefill]:
        kernel = cpu.prefill.PrefillKernel(path)
        kernel.bf16_dot = dot
        out = torch.full(batch.query.shape, float("nan"), dtype=dtype)
        lse = torch.full(batch.query.shape[:2], float("nan"))
        kernel(batch.query, batch.k_cache, batch.v_cache, batch.meta.block_tables, chunks, 0.3,
               out, lse, None)
        results.append((out, lse))
    (out, lse), (out2, lse2) = results
    # sums in another order: a few float32 ulp, at most one bfloat16 ulp where they round
    ulp = 2 ** -7 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(out2, out, atol=ulp, rtol=ulp)
    torch.testing.assert_close(lse2, lse, atol=2e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_prefix(builds, dtype):
    native, avx2 = (cpu.shared_prefix.SharedPrefixKernel(path)
                    for path in builds[cpu.shared_prefix])
    avx2.use_bf16 = native.use_bf16 = True
    gen = torch.Generator().manual_seed(5)
    for tokens, keys, kv_heads, group, head_dim in [(37, 600, 3, 3, 64), (9, 130, 2, 4, 128)]:
        q = (torch.randn(tokens, kv_heads * group, head_dim, generator=gen) * 3).to(dtype)
        k, v = (torch.randn(keys, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
        out, lse = native(q, k, v, head_dim ** -0.5)
        out2, lse2 = avx2(q, k, v, head_dim ** -0.5)
        assert torch.equal(out, out2) and torch.equal(lse, lse2)
