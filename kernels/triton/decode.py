"""Paged decode attention: one query token per sequence, K/V read straight from the blocks.

A program owns one (sequence, KV head) pair and serves all query heads of that KV head at
once (GQA), so every K/V tile is loaded once per group. The query heads are padded to 16
rows so both products are tensor-core sized tl.dot calls. With split-KV (flash-decoding)
the context is cut into num_splits ranges handled by separate programs, each writing an
unnormalised partial result, and a second kernel merges them. An FP8 cache (E4M3 codes,
kernels/fp8.py) is read as its codes' values, k_scale folded into the scores' scale and
v_scale applied to each program's result.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import fp8
from ._launch import (attention_shared_memory, check_inputs, dot_settings, fits_shared_memory,
                      next_power_of_2, shared_memory_bytes)
from ._paged import load_kv_tile, online_softmax_step, soft_cap

MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64
# (BLOCK_N, num_stages) in order of preference: the first whose tiles fit is taken.
TILE_CHOICES = ((64, 3), (64, 2), (32, 3), (32, 2), (16, 2))


# Arguments whose values change from step to step are not specialised on (Triton would
# otherwise compile variants for 1 and for multiples of 16 mid-run). SPLIT, and the merge
# kernel's S_PAD, still give one variant per power of two of the split count.
@triton.jit(do_not_specialize=["window", "num_splits", "stride_bt"])
def _paged_decode_kernel(
    out_ptr,           # [num_seqs, num_heads, head_dim] (not SPLIT)
    part_acc_ptr,      # [num_seqs, num_heads, num_splits, head_dim] float32, contiguous (SPLIT)
    part_max_ptr,      # [num_seqs, num_heads, num_splits] float32, contiguous (SPLIT)
    part_sum_ptr,      # [num_seqs, num_heads, num_splits] float32, contiguous (SPLIT)
    q_ptr,             # [num_seqs, num_heads, head_dim]
    k_cache_ptr,       # [num_blocks, block_size, num_kv_heads, head_dim] (FP8: uint8 codes)
    v_cache_ptr,       # [num_blocks, block_size, num_kv_heads, head_dim] (FP8: uint8 codes)
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,      # [num_seqs] int32
    scale_log2,        # softmax scale * log2(e) (* k_scale: FP8)
    v_scale,           # FP8: values are read times v_scale
    softcap_log2,      # soft-capping's cap * log2(e) (SOFTCAP)
    window,            # sliding window W (USE_WINDOW)
    num_splits,        # context ranges per sequence (SPLIT)
    stride_qs, stride_qh, stride_qd,
    stride_os, stride_oh, stride_od,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,     # scores x become cap * tanh(x / cap) (Gemma 2)
    SPLIT: tl.constexpr,
    DOT_F32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    start = lo
    end = seq_len
    if SPLIT:
        chunk = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
        start = lo + split * chunk
        end = tl.minimum(start + chunk, seq_len)

    rows = tl.arange(0, G_PAD)
    row_ok = rows < GROUP
    heads = kv_head * GROUP + rows
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    block_row = block_tables_ptr + seq * stride_bt
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_vh
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        pos_ok = pos < end
        k, v = load_kv_tile(block_row, k_head, v_head, pos, pos_ok, d, d_ok, q,
                            stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
                            BLOCK_SIZE, DOT_F32, FP8)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        if SOFTCAP:
            s = soft_cap(s, softcap_log2)
        s = tl.where(pos_ok[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION)

    if FP8:
        acc = acc * v_scale
    if SPLIT:
        part = (seq * (GROUP * tl.num_programs(1)) + heads) * num_splits + split
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc,
                 mask=row_ok[:, None] & d_ok[None, :])
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + d[None, :] * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def _split_kv_reduce_kernel(
    out_ptr,           # [num_seqs, num_heads, head_dim]
    part_acc_ptr,      # [num_seqs, num_heads, num_splits, head_dim] float32, contiguous
    part_max_ptr,      # [num_seqs, num_heads, num_splits] float32, contiguous
    part_sum_ptr,      # [num_seqs, num_heads, num_splits] float32, contiguous
    num_splits,
    stride_os, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    S_PAD: tl.constexpr,        # num_splits rounded up to a power of two
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, S_PAD)
    split_ok = splits < num_splits
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    part = (seq * tl.num_programs(1) + head) * num_splits + splits
    m = tl.load(part_max_ptr + part, mask=split_ok, other=float("-inf"))
    l = tl.load(part_sum_ptr + part, mask=split_ok, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :],
                  mask=split_ok[:, None] & d_ok[None, :], other=0.0)
    m_max = tl.max(m, 0)
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_ref)
    total = tl.sum(w * l, 0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=d_ok)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Split-KV heuristic: split only when (sequence, KV head) programs cannot fill the GPU.

    With at least `num_sms` programs every SM already streams K/V, so one split is best.
    Otherwise aim for about two programs per SM, while keeping each split at least
    MIN_TOKENS_PER_SPLIT tokens long (the merge costs a second launch and a round trip
    through float32 partials) and at most MAX_SPLITS splits.
    """
    programs = num_seqs * num_kv_heads
    if programs == 0 or programs >= num_sms:
        return 1
    wanted = math.ceil(2 * num_sms / programs)
    by_length = max_seq_len // MIN_TOKENS_PER_SPLIT
    return max(1, min(wanted, by_length, MAX_SPLITS))


def decode_shared_memory(block_n: int, num_stages: int, head_dim: int, group: int,
                         cache_bytes: int, dot_bytes: int) -> int:
    """Bytes of shared memory the decode kernel's tiles take (attention_shared_memory),
    its query rows the GQA group padded to at least 16."""
    return attention_shared_memory(max(16, next_power_of_2(group)), block_n, num_stages,
                                   head_dim, cache_bytes, dot_bytes)


def decode_tile_sizes(head_dim: int, group: int, cache_bytes: int, dot_bytes: int,
                      shared_memory: int, block_n: int | None = None) -> tuple[int, int]:
    """(BLOCK_N, num_stages): the first of TILE_CHOICES (with BLOCK_N = block_n when given)
    whose tiles (decode_shared_memory) fit `shared_memory` (fits_shared_memory). Wide
    heads and float32 get narrower tiles and fewer stages; the block size does not enter,
    as tiles need not line up with blocks."""
    choices = TILE_CHOICES if block_n is None else [(block_n, s) for s in (3, 2, 1)]
    for n, stages in choices:
        if fits_shared_memory(decode_shared_memory(n, stages, head_dim, group, cache_bytes,
                                                   dot_bytes), shared_memory):
            return n, stages
    raise ValueError(f"decode tiles for head_dim={head_dim} with {cache_bytes}-byte cache "
                     f"elements do not fit {shared_memory} bytes of shared memory")


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the interpreter runs programs one after another


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           sliding_window: int | None = None, out: torch.Tensor | None = None,
                           max_seq_len: int | None = None, num_splits: int | None = None,
                           block_n: int | None = None, scratch: dict | None = None,
                           k_scale: float = 1.0, v_scale: float = 1.0,
                           softcap: float | None = None) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context.

    query [num_seqs, num_heads, head_dim]; the query of sequence i sits at position
    seq_lens[i] - 1 and its K/V are already in the cache. Grid: (num_seqs, num_kv_heads,
    num_splits) where num_splits comes from choose_num_splits unless given; with more than
    one split the partials are merged by merge_split_kv. Each program walks its range in
    tiles of block_n keys (default: decode_tile_sizes for the device's shared memory),
    looking up the block of every key, so tiles need not line up with blocks.
    `scratch` (e.g. the step's AttentionMetadata.cache) keeps the partial buffers across
    layers. An FP8 cache's keys and values are read times k_scale and v_scale. softcap:
    scores (after the scale) become softcap * tanh(scores / softcap). Returns
    `out` ([num_seqs, num_heads, head_dim], allocated when None).
    """
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    check_inputs(_paged_decode_kernel, head_dim, query, caches=(k_cache, v_cache))
    from_fp8 = fp8.is_fp8(k_cache)
    if from_fp8:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    else:
        k_scale = v_scale = 1.0
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        if sliding_window is not None:
            max_seq_len = min(max_seq_len, sliding_window)
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, sm_count(query.device))
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    block_n, num_stages = decode_tile_sizes(head_dim, group, k_cache.element_size(),
                                            query.element_size(),
                                            shared_memory_bytes(query.device), block_n)
    dot_f32, precision = dot_settings(_paged_decode_kernel, query.dtype)
    d_pad = next_power_of_2(head_dim)
    split = num_splits > 1
    if split:
        shape = (num_seqs, num_heads, num_splits)
        key = ("decode_partials", shape, head_dim, query.device)
        buffers = scratch.get(key) if scratch is not None else None
        if buffers is None:
            buffers = (torch.empty(*shape, head_dim, dtype=torch.float32, device=query.device),
                       torch.empty(shape, dtype=torch.float32, device=query.device),
                       torch.empty(shape, dtype=torch.float32, device=query.device))
            if scratch is not None:
                scratch[key] = buffers
        part_acc, part_max, part_sum = buffers
    else:
        part_acc = part_max = part_sum = out
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        out, part_acc, part_max, part_sum, query, k_cache, v_cache, block_tables, seq_lens,
        scale * math.log2(math.e) * k_scale, v_scale, (softcap or 1.0) * math.log2(math.e),
        sliding_window or 0, num_splits,
        *query.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(),
        block_tables.stride(0),
        HEAD_DIM=head_dim, D_PAD=d_pad, GROUP=group, G_PAD=max(16, next_power_of_2(group)),
        BLOCK_SIZE=k_cache.shape[1], BLOCK_N=block_n, USE_WINDOW=sliding_window is not None,
        SOFTCAP=softcap is not None, SPLIT=split, DOT_F32=dot_f32, DOT_PRECISION=precision, FP8=from_fp8,
        num_warps=4, num_stages=num_stages,
    )
    if split:
        merge_split_kv(out, part_acc, part_max, part_sum)
    return out


def merge_split_kv(out: torch.Tensor, part_acc: torch.Tensor, part_max: torch.Tensor,
                   part_sum: torch.Tensor) -> torch.Tensor:
    """Combine split-KV partials into out [num_seqs, num_heads, head_dim].

    part_acc [num_seqs, num_heads, num_splits, head_dim] holds each split's unnormalised
    P @ V, part_max/part_sum its running max (log2 units) and softmax denominator; empty
    splits carry max -inf and sum 0. Grid: one program per (sequence, query head), which
    reads all splits at once (num_splits <= MAX_SPLITS).
    """
    num_seqs, num_heads, num_splits, head_dim = part_acc.shape
    _split_kv_reduce_kernel[(num_seqs, num_heads)](
        out, part_acc, part_max, part_sum, num_splits, *out.stride(),
        HEAD_DIM=head_dim, D_PAD=next_power_of_2(head_dim),
        S_PAD=next_power_of_2(num_splits), num_warps=4,
    )
    return out
