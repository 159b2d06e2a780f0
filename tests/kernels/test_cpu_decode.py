"""The C paged-decode kernel (kernels/cpu/decode.c) against a float64 reference.

Caches come from the paged_batch fixture (on the CPU here): blocks in shuffled order and
NaN in every slot outside a context, so a read past a sequence's range, or a masked lane
that leaks, shows as NaN."""
from __future__ import annotations

import ctypes
import logging
import platform
import shutil
import subprocess
import tempfile

import pytest
import torch

from batchinfer.kernels import cpu

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def kernel(built_or_skip):
    return cpu.decode.DecodeKernel(built_or_skip(cpu.decode, "the CPU decode kernel"))


def reference(query, k_cache, v_cache, block_tables, lo, hi, scale):
    """(out, lse) in float64, one sequence at a time."""
    n, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(n, num_heads, head_dim, dtype=torch.float64)
    lse = torch.empty(n, num_heads, dtype=torch.float64)
    for i in range(n):
        pos = torch.arange(int(lo[i]), int(hi[i]))
        slots = block_tables[i, pos // block_size].long() * block_size + pos % block_size
        k = k_cache.view(-1, num_kv_heads, head_dim)[slots].double()
        v = v_cache.view(-1, num_kv_heads, head_dim)[slots].double()
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (query[i].double()[:, None, :] @ k.transpose(1, 2))[:, 0] * scale  # [H, L]
        lse[i] = torch.logsumexp(scores, dim=-1)
        out[i] = (torch.softmax(scores, dim=-1)[:, None, :] @ v)[:, 0]
    return out, lse


def run(kernel, batch, lo, hi, scale=0.3, query=None):
    query = batch.query if query is None else query
    n = query.shape[0]
    out = torch.empty(query.shape, dtype=query.dtype)
    lse = torch.empty(n, query.shape[1], dtype=torch.float32)
    kernel(query, batch.k_cache, batch.v_cache, batch.meta.block_tables[:n],
           torch.tensor(lo, dtype=torch.int32), torch.tensor(hi, dtype=torch.int32), scale,
           out, lse)
    return out, lse


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_kv_heads, group, head_dim, block_size", [
    (4, 2, 32, 16),    # the bench's tiny shape
    (3, 3, 64, 16),    # SmolLM2-135M
    (2, 4, 128, 16),   # Llama-style head_dim
    (2, 4, 64, 16),    # passes of 2 rows (3 would fit the registers, but must divide 4)
    (8, 4, 128, 16),   # a sequence's heads in two walks (their state over the budget)
    (1, 3, 256, 16),   # the largest head_dim
    (1, 1, 16, 8),     # blocks shorter than the 16-key chunk
    (5, 1, 48, 32),    # no GQA; blocks longer than a chunk
    (2, 16, 32, 16),   # the widest group the kernel takes
])
def test_matches_reference(kernel, paged_batch, dtype, tol, num_kv_heads, group, head_dim,
                           block_size):
    seq_lens = [1, 15, 16, 17, 33, 100, 257, 64]
    batch = paged_batch(seq_lens, [1] * len(seq_lens), block_size=block_size,
                        num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, dtype=dtype,
                        device=CPU)
    assert kernel.supports(dtype, num_kv_heads * group, num_kv_heads, head_dim)
    assert cpu.decode.supports(batch.query, num_kv_heads)
    # whole contexts, and ranges starting mid-block / at a block edge (a cascade's own part,
    # a sliding window)
    for lo in ([0] * len(seq_lens), [0, 3, 16, 1, 16, 37, 200, 63]):
        out, lse = run(kernel, batch, lo, seq_lens)
        ref_out, ref_lse = reference(batch.query, batch.k_cache, batch.v_cache,
                                     batch.meta.block_tables, lo, seq_lens, 0.3)
        torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
        torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_merges_a_partial_result_over_other_keys(kernel, paged_batch, dtype, tol):
    """init = (out, lse) over keys [0, mid), strided: the result is attention over [0, hi),
    as when a cascade's shared prefix is merged in; an init lse of -inf adds nothing."""
    seq_lens = [33, 100, 257, 64, 17]
    mid = [16, 37, 128, 0, 16]
    batch = paged_batch(seq_lens, [1] * len(seq_lens), block_size=16, num_kv_heads=3,
                        group=3, head_dim=64, dtype=dtype, device=CPU)
    first_out, first_lse = run(kernel, batch, [0] * len(seq_lens), mid)
    first_lse[3] = float("-inf")  # no keys before mid: the row's own part alone
    n = len(seq_lens)
    # laid out as the cascade's shared product leaves it: KV head major, so strided
    init_out = torch.empty(3, n, 3, 64, dtype=dtype).transpose(0, 1)
    init_lse = torch.empty(3, 3, n).permute(2, 0, 1)
    init_out.copy_(first_out.view(n, 3, 3, 64))
    init_lse.copy_(first_lse.view(n, 3, 3))
    out = torch.empty_like(batch.query)
    kernel(batch.query, batch.k_cache, batch.v_cache, batch.meta.block_tables[:n],
           torch.tensor(mid, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
           0.3, out, None, (init_out, init_lse))
    ref_out, _ = reference(batch.query, batch.k_cache, batch.v_cache, batch.meta.block_tables,
                           [0] * n, seq_lens, 0.3)
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="out of contract"):
        kernel(batch.query, batch.k_cache, batch.v_cache, batch.meta.block_tables[:n],
               torch.tensor(mid, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
               0.3, out, None, (first_out.view(n, 3, 3, 64), first_lse[:2].view(2, 3, 3)))


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("num_seqs", [3, 40])  # one KV head per work item / whole rows
def test_work_split_and_threads(kernel, paged_batch, num_threads, num_seqs):
    seq_lens = [(37 * i) % 300 + 1 for i in range(num_seqs)]
    batch = paged_batch(seq_lens, [1] * num_seqs, block_size=16, num_kv_heads=4, group=2,
                        head_dim=32, dtype=torch.float32, seed=num_seqs, device=CPU)
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        out, lse = run(kernel, batch, [0] * num_seqs, seq_lens)
    finally:
        torch.set_num_threads(before)
    ref_out, ref_lse = reference(batch.query, batch.k_cache, batch.v_cache,
                                 batch.meta.block_tables, [0] * num_seqs, seq_lens, 0.3)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)


def test_strided_query_rows(kernel, paged_batch):
    # the model hands over q as a view of the fused qkv projection: rows are strided
    seq_lens = [20, 70, 5]
    batch = paged_batch(seq_lens, [1, 1, 1], block_size=16, num_kv_heads=2, group=2,
                        head_dim=32, dtype=torch.float32, device=CPU)
    qkv = torch.randn(3, 4 * 32 + 2 * 2 * 32)
    query = qkv[:, :4 * 32].view(3, 4, 32)
    assert not query.is_contiguous()
    out, _ = run(kernel, batch, [0, 0, 0], seq_lens, query=query)
    ref_out, _ = reference(query, batch.k_cache, batch.v_cache, batch.meta.block_tables,
                           [0, 0, 0], seq_lens, 0.3)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)


def test_rejects_arguments_out_of_contract(kernel, paged_batch):
    batch = paged_batch([20], [1], block_size=16, num_kv_heads=2, group=2, head_dim=32,
                        dtype=torch.float32, device=CPU)
    with pytest.raises(ValueError, match="out of contract"):
        run(kernel, batch, [0], [20], query=batch.query.to(torch.bfloat16))
    with pytest.raises(ValueError, match="out of contract"):  # head_dim differs from the cache's
        run(kernel, batch, [0], [20], query=torch.randn(1, 4, 16))
    # ranges past the block table, negative starts, block ids past the cache
    width = batch.meta.block_tables.shape[1] * 16
    for lo, hi in (([0], [width + 1]), ([-1], [20]), ([5], [4])):
        with pytest.raises(ValueError, match="outside the cache"):
            run(kernel, batch, lo, hi)
    batch.meta.block_tables[0, 0] = batch.k_cache.shape[0]
    with pytest.raises(ValueError, match="outside the cache"):
        run(kernel, batch, [0], [20])
    # the check is made once per step (the same tensors serve every layer), but not
    # skipped for a cache of another block size, where the table covers fewer positions
    batch.meta.block_tables[0, 0] = 1
    tables, lo, hi = batch.meta.block_tables[:1], torch.tensor([0], dtype=torch.int32), \
        torch.tensor([20], dtype=torch.int32)
    out = torch.empty_like(batch.query)
    kernel(batch.query, batch.k_cache, batch.v_cache, tables, lo, hi, 0.3, out, None)
    small = torch.zeros(batch.k_cache.shape[0], 4, 2, 32)
    with pytest.raises(ValueError, match="outside the cache"):
        kernel(batch.query, small, small.clone(), tables, lo, hi, 0.3, out, None)
    assert not kernel.supports(torch.float16, 4, 2, 32)
    assert not kernel.supports(torch.float32, 4, 2, 0)
    assert not kernel.supports(torch.float32, 4, 2, 40)   # head_dim not a multiple of 16
    assert not kernel.supports(torch.float32, 64, 2, 32)  # 32 query heads per KV head


def test_a_nan_key_in_range_shows_in_the_output(kernel, paged_batch):
    # a NaN inside the attended range must not be silently weighted to zero
    batch = paged_batch([40], [1], block_size=16, num_kv_heads=1, group=2, head_dim=32,
                        dtype=torch.float32, device=CPU)
    block = int(batch.meta.block_tables[0, 1])
    batch.k_cache[block, 3, 0, 5] = float("nan")  # position 19
    out, lse = run(kernel, batch, [0], [40])
    assert out.isnan().all() and lse.isnan().all()
    out, lse = run(kernel, batch, [20], [40])  # the NaN lies outside [20, 40)
    assert not out.isnan().any() and not lse.isnan().any()


@pytest.mark.parametrize("wrapper", ["decode", "prefill", "shared_prefix", "ops", "rope",
                                     "sample", "logprobs"])
def test_switched_off_by_the_environment(fresh_loader, monkeypatch, wrapper):
    monkeypatch.setenv(cpu.build.ENV_SWITCH, "0")
    assert not getattr(cpu, wrapper).available()
    assert cpu.build.build(getattr(cpu, wrapper).SOURCE) is None


def test_supports_nothing_where_not_available(fresh_loader, monkeypatch):
    monkeypatch.setenv(cpu.build.ENV_SWITCH, "0")
    query, logits = torch.zeros(1, 4, 32), torch.zeros(2, 64)
    assert not cpu.decode.supports(query, 2)
    assert not cpu.prefill.supports(query, 2)
    assert not cpu.shared_prefix.supports(query, 2)
    assert not cpu.ops.supports(logits) and not cpu.ops.supports_heads(logits)
    assert not cpu.ops.supports_argmax(logits)
    assert not cpu.rope.supports(query)
    assert not cpu.sample.supports(logits)
    assert not cpu.logprobs.supports(logits, 1) and cpu.logprobs.max_k() == 0


def test_build_failure_falls_back_with_a_warning(fresh_loader, monkeypatch, caplog):
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    with caplog.at_level(logging.WARNING, logger=cpu.build.__name__):
        assert not cpu.decode.available()
    assert "torch path" in caplog.text
    assert not list(fresh_loader.rglob("*.so"))


def test_builds_into_the_cache_dir_once(fresh_loader, kernel):
    # (the small ops kernel: decode.c's build alone takes minutes with an AVX2 -march)
    assert cpu.ops.available()
    first = cpu.build.build(cpu.ops.SOURCE)
    assert first is not None and first.parent == fresh_loader / "kernels"
    cpu.build._built.clear()
    cpu.build._loaded.clear()
    assert cpu.build.build(cpu.ops.SOURCE) == first  # found again, not rebuilt elsewhere
    assert len(list((fresh_loader / "kernels").iterdir())) == 1


def test_a_read_only_cache_builds_in_the_temp_dir(fresh_loader, kernel, monkeypatch, tmp_path):
    real_compile = cpu.build._compile

    def compile_where_writable(compiler, source, runtime, target):
        if fresh_loader / "kernels" in target.parents:  # the cache root refuses writes
            raise PermissionError(13, "Permission denied", str(target.parent))
        real_compile(compiler, source, runtime, target)

    monkeypatch.setattr(cpu.build, "_compile", compile_where_writable)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    assert cpu.ops.available()
    built = cpu.build.build(cpu.ops.SOURCE)
    assert built is not None and (tmp_path / "tmp") in built.parents


@pytest.mark.parametrize("identity, amx", [
    ("flags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile\nvendor_id\t: GenuineIntel\n", True),
    ("flags\t\t: fpu avx512f avx512_bf16\nmodel name\t: amx_bf16 lookalike\n", False),
    ("flags\t\t: fpu avx512f amx_bf16x\n", False),
])
def test_amx_is_read_from_the_flags_line(monkeypatch, identity, amx):
    monkeypatch.setattr(cpu.build, "cpu_identity", lambda: identity)
    assert cpu.build.has_amx() is amx


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 -march levels")
def test_the_target_arch_is_chosen_by_the_environment(fresh_loader, monkeypatch, caplog):
    """BATCHINFER_CPU_ARCH=x86-64-v3 builds the AVX2 kernels (no 512-bit registers, no
    AVX512-BF16 instructions) on any x86-64 host, in a library of its own; a value that
    is no -march falls back to the torch path with a warning naming it."""
    monkeypatch.setenv(cpu.build.ARCH_ENV, "x86-64-v3")
    assert "-march=x86-64-v3" in cpu.build.compile_flags()
    avx2 = cpu.build.build(cpu.shared_prefix.SOURCE)
    assert avx2 is not None
    assert not ctypes.CDLL(str(avx2)).shared_prefix_bf16_available()
    objdump = shutil.which("objdump")
    if objdump:
        code = subprocess.run([objdump, "-d", str(avx2)], capture_output=True, text=True).stdout
        assert "ymm" in code and "zmm" not in code
    monkeypatch.setattr(cpu.build, "_built", {})
    monkeypatch.delenv(cpu.build.ARCH_ENV)
    assert cpu.build.build(cpu.shared_prefix.SOURCE) != avx2  # native: another build
    monkeypatch.setattr(cpu.build, "_built", {})
    monkeypatch.setenv(cpu.build.ARCH_ENV, "native; rm -rf /")
    with caplog.at_level(logging.WARNING, logger=cpu.build.__name__):
        assert cpu.build.build(cpu.shared_prefix.SOURCE) is None
    assert "BATCHINFER_CPU_ARCH" in caplog.text and "torch path" in caplog.text
