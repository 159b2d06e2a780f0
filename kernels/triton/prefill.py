"""Varlen causal attention of query chunks against paged K/V (prefill and mixed batches).

Sequence i brings query_start_loc[i+1] - query_start_loc[i] new tokens, the last ones of
its seq_lens[i]-token context; their K/V are already written to the cache, next to the
cached prefix. So a fresh prompt, a later chunk of a chunked prefill and a prompt whose
prefix came from the prefix cache are the same case, and one kernel serves them all.

Work is cut into tiles of BLOCK_Q query tokens of one sequence. A program owns one
(tile, KV head) pair; its BLOCK_M = BLOCK_Q * GROUP rows are the (token, query head)
pairs of that KV head, so each K/V tile is loaded once for the whole GQA group. An FP8
cache (E4M3 codes, kernels/fp8.py) is read as its codes' values, k_scale folded into the
scores' scale and v_scale applied to the result.
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

# (token, query head) rows per tile, largest first: each K/V tile then serves the most
# queries. Never below the GQA group's power of two.
BLOCK_M_CHOICES = (64, 32, 16)
# (BLOCK_N, num_stages) in order of preference for each BLOCK_M: the first whose tiles fit
# is taken. Above head_dim 128, BLOCK_N stops at WIDE_HEAD_BLOCK_N, to bound registers.
TILE_CHOICES = ((64, 2), (32, 2), (16, 2), (32, 1), (16, 1))
WIDE_HEAD_BLOCK_N = 32


# the block-table row stride (the step's longest context in blocks) and the window change
# from step to step: not specialised on, so no variant is compiled mid-run
@triton.jit(do_not_specialize=["window", "stride_bt"])
def _paged_prefill_kernel(
    out_ptr,              # [num_tokens, num_heads, head_dim]
    q_ptr,                # [num_tokens, num_heads, head_dim]
    k_cache_ptr,          # [num_blocks, block_size, num_kv_heads, head_dim] (FP8: uint8 codes)
    v_cache_ptr,          # [num_blocks, block_size, num_kv_heads, head_dim] (FP8: uint8 codes)
    block_tables_ptr,     # [num_seqs, max_blocks] int32
    seq_lens_ptr,         # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    tile_seq_ptr,         # [num_tiles] int32: sequence of each tile
    tile_q_start_ptr,     # [num_tiles] int32: first query token of the tile, within its sequence
    scale_log2,           # softmax scale * log2(e) (* k_scale: FP8)
    v_scale,              # FP8: values are read times v_scale
    softcap_log2,         # soft-capping's cap * log2(e) (SOFTCAP)
    window,               # sliding window W (USE_WINDOW)
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,     # scores x become cap * tanh(x / cap) (Gemma 2)
    DOT_F32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile).to(tl.int64)
    tile_q = tl.load(tile_q_start_ptr + tile)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    chunk_pos = seq_len - q_len  # context position of the chunk's first query token

    rows = tl.arange(0, BLOCK_M)
    q_tok = tile_q + rows // GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_tok < q_len)
    heads = kv_head * GROUP + rows % GROUP
    q_pos = chunk_pos + q_tok
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q_rows = (q_begin + q_tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh
                + d[None, :] * stride_qd, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    # Keys this tile can see: up to its last query token, from its first token's window.
    hi = chunk_pos + tl.minimum(tile_q + BLOCK_Q, q_len)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(chunk_pos + tile_q - window + 1, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    block_row = block_tables_ptr + seq * stride_bt
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_vh
    for tile_start in range(lo, hi, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        pos_ok = pos < hi
        k, v = load_kv_tile(block_row, k_head, v_head, pos, pos_ok, d, d_ok, q,
                            stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
                            BLOCK_SIZE, DOT_F32, FP8)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        if SOFTCAP:
            s = soft_cap(s, softcap_log2)
        visible = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if FP8:
        out = out * v_scale
    tl.store(out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh
             + d[None, :] * stride_od, out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


def prefill_tile_sizes(head_dim: int, group: int, cache_bytes: int, dot_bytes: int,
                       shared_memory: int, block_m: int | None = None,
                       block_n: int | None = None) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_stages): for each BLOCK_M of BLOCK_M_CHOICES (or block_m when
    given), the first of TILE_CHOICES (with BLOCK_N = block_n when given) whose tiles
    (attention_shared_memory) fit `shared_memory` (fits_shared_memory). Wide heads, float32
    and GPUs with less shared memory get narrower tiles and fewer stages. All >= 16 (tl.dot)."""
    rows = max(16, next_power_of_2(group))
    if block_m is not None:
        m_choices = [block_m]
    else:
        m_choices = sorted({max(m, rows) for m in BLOCK_M_CHOICES}, reverse=True)
    if block_n is not None:
        choices = [(block_n, s) for s in (2, 1)]
    else:
        widest = 64 if head_dim <= 128 else WIDE_HEAD_BLOCK_N
        choices = [(n, s) for n, s in TILE_CHOICES if n <= widest]
    for m in m_choices:
        for n, stages in choices:
            if fits_shared_memory(attention_shared_memory(m, n, stages, head_dim, cache_bytes,
                                                          dot_bytes), shared_memory):
                return m, n, stages
    raise ValueError(f"prefill tiles for head_dim={head_dim} and a GQA group of {group} with "
                     f"{cache_bytes}-byte cache elements do not fit {shared_memory} bytes of "
                     "shared memory")


def plan_prefill_tiles(query_start_loc_cpu: list[int], first_seq: int, block_q: int,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(tile_seq, tile_q_start) int32 tensors for sequences [first_seq, num_seqs)."""
    qsl = torch.tensor(query_start_loc_cpu, dtype=torch.int64)
    q_lens = qsl[first_seq + 1:] - qsl[first_seq:-1]
    tiles = (q_lens + block_q - 1) // block_q
    seq_ids = torch.arange(first_seq, first_seq + q_lens.numel())
    tile_seq = torch.repeat_interleave(seq_ids, tiles)
    first_tile = torch.cumsum(tiles, 0) - tiles
    tile_index = torch.arange(tile_seq.numel()) - torch.repeat_interleave(first_tile, tiles)
    tile_q_start = tile_index * block_q
    return (tile_seq.to(torch.int32).to(device, non_blocking=True),
            tile_q_start.to(torch.int32).to(device, non_blocking=True))


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            query_start_loc: torch.Tensor, scale: float,
                            sliding_window: int | None = None, out: torch.Tensor | None = None,
                            first_seq: int = 0, query_start_loc_cpu: list[int] | None = None,
                            block_m: int | None = None, block_n: int | None = None,
                            scratch: dict | None = None, k_scale: float = 1.0,
                            v_scale: float = 1.0, softcap: float | None = None) -> torch.Tensor:
    """Causal attention for the query tokens of sequences [first_seq, num_seqs).

    query/out are [num_tokens, num_heads, head_dim] for the whole batch (rows of earlier
    sequences are left untouched). Grid: (num_tiles, num_kv_heads), one tile per BLOCK_Q =
    BLOCK_M // group query tokens of a sequence, so a long chunk spreads over many
    programs and a one-token sequence costs one. The tile plan is built on the host from
    query_start_loc_cpu (read from query_start_loc when not given) and kept in `scratch`.
    Tiles: block_m rows and block_n keys (default: prefill_tile_sizes for the device's
    shared memory).
    An FP8 cache's keys and values are read times k_scale and v_scale. softcap: scores
    (after the scale) become softcap * tanh(scores / softcap).
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    check_inputs(_paged_prefill_kernel, head_dim, query, caches=(k_cache, v_cache))
    from_fp8 = fp8.is_fp8(k_cache)
    if from_fp8:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    else:
        k_scale = v_scale = 1.0
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    group = num_heads // num_kv_heads
    if block_m is not None and block_m < group:
        raise ValueError(f"block_m={block_m} must be at least the GQA group size {group}")
    block_m, block_n, num_stages = prefill_tile_sizes(
        head_dim, group, k_cache.element_size(), query.element_size(),
        shared_memory_bytes(query.device), block_m, block_n)
    block_q = block_m // group
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    key = ("prefill_tiles", first_seq, block_q)
    tiles = scratch.get(key) if scratch is not None else None
    if tiles is None:
        if query_start_loc_cpu is None:
            query_start_loc_cpu = query_start_loc.tolist()
        tiles = plan_prefill_tiles(query_start_loc_cpu, first_seq, block_q, query.device)
        if scratch is not None:
            scratch[key] = tiles
    tile_seq, tile_q_start = tiles
    if tile_seq.numel() == 0:
        return out
    dot_f32, precision = dot_settings(_paged_prefill_kernel, query.dtype)
    _paged_prefill_kernel[(tile_seq.numel(), num_kv_heads)](
        out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        tile_seq, tile_q_start, scale * math.log2(math.e) * k_scale, v_scale,
        (softcap or 1.0) * math.log2(math.e), sliding_window or 0,
        *query.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(),
        block_tables.stride(0),
        HEAD_DIM=head_dim, D_PAD=next_power_of_2(head_dim), GROUP=group, BLOCK_Q=block_q,
        BLOCK_M=block_m, BLOCK_SIZE=k_cache.shape[1], BLOCK_N=block_n,
        USE_WINDOW=sliding_window is not None, SOFTCAP=softcap is not None, DOT_F32=dot_f32, DOT_PRECISION=precision,
        FP8=from_fp8, num_warps=4, num_stages=num_stages,
    )
    return out
