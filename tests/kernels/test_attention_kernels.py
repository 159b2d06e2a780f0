"""Each Triton kernel against its torch reference (under the interpreter on CPU).

The matrix dtype x block size x head_dim x GQA ratio x sliding window is covered
pairwise (every pair of values appears in some case) to keep the interpreter run short.
"""
from __future__ import annotations

import itertools
import os

import pytest
import torch

from batchinfer.kernels.triton import decode, prefill
from batchinfer.kernels.triton._launch import (
    SHARED_MEMORY_BYTES, SHARED_MEMORY_SLACK, attention_shared_memory)
from batchinfer.kernels.triton.decode import (
    choose_num_splits, decode_shared_memory, paged_decode_attention)
from batchinfer.kernels.triton.kv_write import write_kv
from batchinfer.kernels.triton.prefill import paged_prefill_attention, plan_prefill_tiles
from reference import ref_decode_attention, ref_prefill_attention, ref_write_kv

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Tolerance per dtype against the float32 reference. Under the interpreter every tile is
# multiplied in float32, so the only error left is the final rounding to the output dtype
# (relative half-ulp: 2^-24 float32, 2^-11 float16, 2^-8 bfloat16) plus summation order.
TOLERANCES = {torch.float32: dict(atol=2e-5, rtol=2e-5),
              torch.float16: dict(atol=1e-3, rtol=1e-3),
              torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}
if torch.cuda.is_available():
    # Compiled for a GPU, the probabilities are also rounded to float16/bfloat16 before
    # P @ V on the tensor cores: one more rounding of the dtype.
    TOLERANCES.update({torch.float16: dict(atol=4e-3, rtol=4e-3),
                       torch.bfloat16: dict(atol=3e-2, rtol=3e-2)})
WINDOW = 20
SCALE = 0.3

FACTORS = (tuple(DTYPES), (8, 16, 32), (48, 64, 80, 96, 128), (1, 4, 8), (None, WINDOW))
# (dtype, block_size, head_dim, GQA ratio, sliding window): a pairwise-covering subset.
CASES = [
    ("float32", 16, 64, 8, None), ("bfloat16", 32, 80, 4, WINDOW),
    ("float16", 8, 128, 8, WINDOW), ("float16", 32, 96, 1, None),
    ("float32", 16, 48, 1, WINDOW), ("bfloat16", 8, 48, 4, None),
    ("bfloat16", 8, 64, 1, WINDOW), ("float16", 16, 80, 4, None),
    ("float32", 32, 128, 4, None), ("bfloat16", 16, 96, 8, WINDOW),
    ("float32", 8, 96, 4, None), ("float16", 32, 48, 8, None),
    ("bfloat16", 16, 128, 1, None), ("float16", 32, 64, 4, WINDOW),
    ("float32", 8, 80, 8, None), ("float32", 16, 80, 1, None),
]
NUM_KV_HEADS = 2
# Decode contexts: a 1-token context, lengths that are not multiples of any block size.
DECODE_LENS = [1, 14, 37, 50]
# Prefill: a 1-token prompt, a 5-token chunk starting mid-block after 9 cached tokens,
# a whole 37-token prompt, 3 new tokens after a 47-token cached prefix.
PREFILL_SEQ_LENS = [1, 14, 37, 50]
PREFILL_QUERY_LENS = [1, 5, 37, 3]


def test_cases_cover_every_pair():
    covered = {(i, case[i], j, case[j]) for case in CASES
               for i, j in itertools.combinations(range(len(FACTORS)), 2)}
    for (i, a), (j, b) in itertools.combinations(enumerate(FACTORS), 2):
        for x, y in itertools.product(a, b):
            assert (i, x, j, y) in covered, (x, y)


def _batch(paged_batch, case, seq_lens, query_lens, seed=0):
    dtype, block_size, head_dim, group, _ = case
    return paged_batch(seq_lens, query_lens, block_size=block_size, num_kv_heads=NUM_KV_HEADS,
                       group=group, head_dim=head_dim, dtype=DTYPES[dtype], seed=seed)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_decode_matches_reference(paged_batch, case):
    window = case[4]
    b = _batch(paged_batch, case, DECODE_LENS, [1] * len(DECODE_LENS))
    m = b.meta
    ref = ref_decode_attention(b.query, b.k_cache, b.v_cache, m.block_tables, m.seq_lens,
                               SCALE, window)
    # One split, and three splits (some of them empty) merged by the reduction kernel.
    for num_splits in (1, 3):
        out = paged_decode_attention(b.query, b.k_cache, b.v_cache, m.block_tables, m.seq_lens,
                                     SCALE, window, num_splits=num_splits, block_n=16)
        assert out.dtype == b.query.dtype
        torch.testing.assert_close(out.float(), ref, **TOLERANCES[b.query.dtype])


@pytest.mark.parametrize("case", CASES, ids=str)
def test_prefill_matches_reference(paged_batch, case):
    window = case[4]
    b = _batch(paged_batch, case, PREFILL_SEQ_LENS, PREFILL_QUERY_LENS)
    m = b.meta
    ref = ref_prefill_attention(b.query, b.k_cache, b.v_cache, m.block_tables, m.seq_lens,
                                m.query_start_loc, SCALE, window)
    out = paged_prefill_attention(b.query, b.k_cache, b.v_cache, m.block_tables, m.seq_lens,
                                  m.query_start_loc, SCALE, window, block_m=32, block_n=16)
    torch.testing.assert_close(out.float(), ref, **TOLERANCES[b.query.dtype])


# a cap well inside the scores' range (std ~2.4 at SCALE and these shapes), so it bends most
SOFTCAP = 2.0


@pytest.mark.parametrize("case", CASES[:3], ids=str)
def test_soft_capped_scores_match_reference(paged_batch, case):
    window = case[4]
    b = _batch(paged_batch, case, PREFILL_SEQ_LENS, PREFILL_QUERY_LENS)
    m = b.meta
    ref = ref_prefill_attention(b.query, b.k_cache, b.v_cache, m.block_tables, m.seq_lens,
                                m.query_start_loc, SCALE, window, softcap=SOFTCAP)
    uncapped = ref_prefill_attention(b.query, b.k_cache, b.v_cache, m.block_tables,
                                     m.seq_lens, m.query_start_loc, SCALE, window)
    assert (ref - uncapped).abs().max() > 0.1
    out = paged_prefill_attention(b.query, b.k_cache, b.v_cache, m.block_tables, m.seq_lens,
                                  m.query_start_loc, SCALE, window, block_m=32, block_n=16,
                                  softcap=SOFTCAP)
    torch.testing.assert_close(out.float(), ref, **TOLERANCES[b.query.dtype])
    # each sequence's last token as a decode, in one split and in three
    last = torch.tensor(m.query_start_loc[1:].tolist()) - 1
    query = b.query[last].contiguous()
    for num_splits in (1, 3):
        out = paged_decode_attention(query, b.k_cache, b.v_cache, m.block_tables, m.seq_lens,
                                     SCALE, window, num_splits=num_splits, block_n=16,
                                     softcap=SOFTCAP)
        torch.testing.assert_close(out.float(), ref[last], **TOLERANCES[b.query.dtype])


@pytest.mark.parametrize("case", CASES[:6], ids=str)
def test_write_kv_matches_reference(paged_batch, case):
    b = _batch(paged_batch, case, [3, 19], [3, 11])
    slots = b.meta.slot_mapping.clone()
    slots[1] = -1  # padding tokens carry slot -1 and are not stored
    expected = (b.k_cache.clone(), b.v_cache.clone())
    ref_write_kv(-b.key, -b.value, *expected, slots)
    write_kv(-b.key, -b.value, b.k_cache, b.v_cache, slots)
    assert torch.equal(b.k_cache.nan_to_num(), expected[0].nan_to_num())
    assert torch.equal(b.v_cache.nan_to_num(), expected[1].nan_to_num())
    assert not torch.equal(b.k_cache.nan_to_num(), (-expected[0]).nan_to_num())


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_write_kv_casts_to_cache_dtype(paged_batch, cache_dtype):
    b = paged_batch([5], [5], block_size=8, num_kv_heads=2, group=1, head_dim=64,
                    dtype=torch.float32, cache_dtype=cache_dtype)
    key = b.key + torch.linspace(0, 1e-3, 64, device=b.key.device)
    b.k_cache.zero_()
    b.v_cache.zero_()
    write_kv(key, b.value, b.k_cache, b.v_cache, b.meta.slot_mapping)
    block = int(b.meta.block_tables[0, 0])
    expected = key.to(cache_dtype)
    assert torch.equal(b.v_cache[block, :5], b.value.to(cache_dtype))
    if cache_dtype == torch.float16:
        assert torch.equal(b.k_cache[block, :5], expected)
    else:
        # The interpreter truncates float32 -> bfloat16 where torch and the GPU round to
        # nearest, so allow one bfloat16 ulp (2^-7 relative).
        torch.testing.assert_close(b.k_cache[block, :5].float(), expected.float(),
                                   atol=0, rtol=2 ** -7)


def test_default_tile_sizes_and_noncontiguous_query(paged_batch):
    """The launchers' own tile choices, with a query that is a strided view (as after a
    fused QKV projection) and the decode/prefill split a mixed batch uses."""
    b = paged_batch([33, 70, 9, 90], [1, 1, 9, 40], block_size=16, num_kv_heads=2, group=4,
                    head_dim=80, dtype=torch.float16, seed=3)
    m = b.meta
    qkv = torch.cat([b.query, torch.zeros_like(b.query)], dim=1)
    query = qkv[:, :b.query.shape[1]]
    assert not query.is_contiguous()
    out = torch.full_like(b.query, float("nan"))
    paged_decode_attention(query[:2], b.k_cache, b.v_cache, m.block_tables[:2], m.seq_lens[:2],
                           SCALE, out=out[:2])
    paged_prefill_attention(query, b.k_cache, b.v_cache, m.block_tables, m.seq_lens,
                            m.query_start_loc, SCALE, out=out, first_seq=2)
    ref = ref_prefill_attention(b.query, b.k_cache, b.v_cache, m.block_tables, m.seq_lens,
                                m.query_start_loc, SCALE)
    torch.testing.assert_close(out.float(), ref, **TOLERANCES[torch.float16])


# The head sizes of the models batchinfer runs, and the (query, cache) dtypes.
HEAD_DIMS = (64, 80, 96, 112, 128, 192, 256)
QUERY_CACHE_DTYPES = {"float32": (torch.float32, torch.float32),
                      "bfloat16": (torch.bfloat16, torch.bfloat16),
                      "float16": (torch.float16, torch.float16),
                      "fp8-kv-bfloat16": (torch.bfloat16, torch.float8_e4m3fn),
                      "fp8-kv-float16": (torch.float16, torch.float8_e4m3fn),
                      "fp8-kv-float32": (torch.float32, torch.float8_e4m3fn)}


class LaunchRecorder:
    """Stands in for a kernel: records each launch's keyword arguments, runs nothing."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(kwargs)


@pytest.mark.parametrize("gpu", SHARED_MEMORY_BYTES, ids=str)
def test_decode_tiles_fit_shared_memory(monkeypatch, gpu):
    """The decode launcher's tiles (BLOCK_N, num_stages), for every head size, block size
    and dtype, fit each GPU's shared memory. Only the launch is recorded: nothing runs."""
    limit = SHARED_MEMORY_BYTES[gpu]
    kernel = LaunchRecorder()
    monkeypatch.setattr(decode, "_paged_decode_kernel", kernel)
    monkeypatch.setattr(decode, "check_inputs", lambda *args, **kwargs: None)
    monkeypatch.setattr(decode, "shared_memory_bytes", lambda device: limit)
    for head_dim, block_size, (name, (dtype, cache_dtype)), group in itertools.product(
            HEAD_DIMS, (16, 32, 64, 128), QUERY_CACHE_DTYPES.items(), (1, 8)):
        query = torch.zeros(1, group, head_dim, dtype=dtype)
        cache = torch.zeros(2, block_size, 1, head_dim, dtype=cache_dtype)
        paged_decode_attention(query, cache, cache, torch.zeros(1, 1, dtype=torch.int32),
                               torch.ones(1, dtype=torch.int32), SCALE, num_splits=1)
        kw = kernel.launches.pop()
        # Triton pipelines 3 stages unless told otherwise
        used = decode_shared_memory(kw["BLOCK_N"], kw.get("num_stages", 3), head_dim, group,
                                    cache.element_size(), query.element_size())
        assert kw["BLOCK_N"] >= 16
        assert used + SHARED_MEMORY_SLACK <= limit, (gpu, head_dim, block_size, name, group,
                                                     kw["BLOCK_N"], used)


@pytest.mark.parametrize("gpu", SHARED_MEMORY_BYTES, ids=str)
def test_prefill_tiles_fit_shared_memory(monkeypatch, gpu):
    """The prefill launcher's tiles (BLOCK_M, BLOCK_N, num_stages), for every head size,
    dtype and GQA group, fit each GPU's shared memory. Only the launch is recorded."""
    limit = SHARED_MEMORY_BYTES[gpu]
    kernel = LaunchRecorder()
    monkeypatch.setattr(prefill, "_paged_prefill_kernel", kernel)
    monkeypatch.setattr(prefill, "check_inputs", lambda *args, **kwargs: None)
    monkeypatch.setattr(prefill, "shared_memory_bytes", lambda device: limit)
    for head_dim, block_size, (name, (dtype, cache_dtype)), group in itertools.product(
            HEAD_DIMS, (16, 128), QUERY_CACHE_DTYPES.items(), (1, 4, 8, 16)):
        query = torch.zeros(1, group, head_dim, dtype=dtype)
        cache = torch.zeros(2, block_size, 1, head_dim, dtype=cache_dtype)
        one = torch.ones(1, dtype=torch.int32)
        paged_prefill_attention(query, cache, cache, torch.zeros(1, 1, dtype=torch.int32), one,
                                torch.tensor([0, 1], dtype=torch.int32), SCALE)
        kw = kernel.launches.pop()
        block_m, block_n = kw["BLOCK_M"], kw["BLOCK_N"]
        # Triton pipelines 3 stages unless told otherwise
        used = attention_shared_memory(block_m, block_n, kw.get("num_stages", 3), head_dim,
                                       cache.element_size(), query.element_size())
        assert block_n >= 16 and block_m >= max(16, group) and block_m % group == 0
        assert used + SHARED_MEMORY_SLACK <= limit, (gpu, head_dim, name, group, block_m,
                                                     block_n, used)


@pytest.mark.parametrize("dtype, head_dim, block_size", [(torch.float32, 256, 128),
                                                         (torch.bfloat16, 256, 32),
                                                         (torch.float16, 192, 64)], ids=str)
def test_decode_default_tiles_for_wide_heads(paged_batch, dtype, head_dim, block_size):
    """Gemma's head_dim 256 and large blocks, with the tiles the launcher picks."""
    b = paged_batch([1, 37, 140], [1, 1, 1], block_size=block_size, num_kv_heads=1, group=2,
                    head_dim=head_dim, dtype=dtype, seed=5)
    m = b.meta
    ref = ref_decode_attention(b.query, b.k_cache, b.v_cache, m.block_tables, m.seq_lens, SCALE)
    for num_splits in (1, 2):
        out = paged_decode_attention(b.query, b.k_cache, b.v_cache, m.block_tables,
                                     m.seq_lens, SCALE, num_splits=num_splits)
        torch.testing.assert_close(out.float(), ref, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype, head_dim, block_size", [(torch.float32, 256, 16),
                                                         (torch.bfloat16, 256, 32),
                                                         (torch.float16, 192, 8)], ids=str)
def test_prefill_default_tiles_for_wide_heads(paged_batch, dtype, head_dim, block_size):
    """Gemma's head_dim 256 with the tiles the launcher picks for the smallest shared
    memory (float32: 32 rows and one stage), chunks longer than a tile of queries."""
    b = paged_batch([1, 37, 90], [1, 37, 41], block_size=block_size, num_kv_heads=1, group=2,
                    head_dim=head_dim, dtype=dtype, seed=6)
    m = b.meta
    ref = ref_prefill_attention(b.query, b.k_cache, b.v_cache, m.block_tables, m.seq_lens,
                                m.query_start_loc, SCALE)
    out = paged_prefill_attention(b.query, b.k_cache, b.v_cache, m.block_tables, m.seq_lens,
                                  m.query_start_loc, SCALE)
    torch.testing.assert_close(out.float(), ref, **TOLERANCES[dtype])


def test_prefill_tile_plan():
    tile_seq, tile_q = plan_prefill_tiles([0, 1, 2, 7, 24], first_seq=2, block_q=4,
                                          device=torch.device("cpu"))
    assert tile_seq.tolist() == [2, 2, 3, 3, 3, 3, 3]
    assert tile_q.tolist() == [0, 4, 0, 4, 8, 12, 16]


def test_split_heuristic():
    # Llama-3-8B (8 KV heads) on a 132-SM GPU.
    assert choose_num_splits(1, 8, 8192, 132) == 32
    assert choose_num_splits(1, 8, 1024, 132) == 4
    assert choose_num_splits(32, 8, 8192, 132) == 1
    assert choose_num_splits(1, 8, 200, 132) == 1
    assert choose_num_splits(1, 1, 1 << 20, 132) == 64


@pytest.mark.parametrize("head_dim, dtype, match", [(72, torch.float32, "multiple of 16"),
                                                     (64, torch.float64, "float16, bfloat16")])
def test_rejects_unsupported_inputs(paged_batch, head_dim, dtype, match):
    b = paged_batch([4], [1], block_size=8, num_kv_heads=1, group=1, head_dim=head_dim,
                    dtype=dtype)
    m = b.meta
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(b.query, b.k_cache, b.v_cache, m.block_tables, m.seq_lens, SCALE)


@pytest.mark.large
@pytest.mark.skipif(os.environ.get("BATCHINFER_LARGE_TESTS") != "1",
                    reason="needs ~4.5 GiB of RAM; set BATCHINFER_LARGE_TESTS=1")
def test_offsets_past_2_pow_31_elements(device):
    """Blocks whose element offset (block * stride) does not fit in int32."""
    block_size, head_dim = 16, 16
    num_blocks = (1 << 31) // (block_size * head_dim) + 64
    cache = torch.empty(num_blocks, block_size, 1, head_dim, dtype=torch.float16, device=device)
    far = torch.tensor([[num_blocks - 3, num_blocks - 1]], dtype=torch.int32, device=device)
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(20, 1, head_dim, generator=gen, dtype=torch.float16).to(device)
    slots = torch.cat([far[0, 0] * block_size + torch.arange(16, device=device),
                       far[0, 1] * block_size + torch.arange(4, device=device)]).long()
    write_kv(key, key, cache, cache, slots)
    assert torch.equal(cache[num_blocks - 1, :4], key[16:])
    seq_lens = torch.tensor([20], dtype=torch.int32, device=device)
    query = torch.randn(1, 4, head_dim, generator=gen, dtype=torch.float16).to(device)
    out = paged_decode_attention(query, cache, cache, far, seq_lens, SCALE, num_splits=1)
    ref = ref_decode_attention(query, cache, cache, far, seq_lens, SCALE)
    torch.testing.assert_close(out.float(), ref, **TOLERANCES[torch.float16])
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=device)
    out = paged_prefill_attention(query, cache, cache, far, seq_lens, qsl, SCALE)
    torch.testing.assert_close(out.float(), ref, **TOLERANCES[torch.float16])


@pytest.mark.parametrize("num_splits", [0, 65])
def test_rejects_a_split_count_out_of_range(paged_batch, num_splits):
    b = paged_batch([4], [1], block_size=8, num_kv_heads=1, group=1, head_dim=16,
                    dtype=torch.float32)
    m = b.meta
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(b.query, b.k_cache, b.v_cache, m.block_tables, m.seq_lens, SCALE,
                               num_splits=num_splits)
