"""Plain PyTorch references for the attention kernels: gather each sequence's context from
its blocks, then ordinary masked softmax attention in float32, one sequence at a time.
Slow and simple on purpose; tests compare the kernels against these. An FP8 cache is
compared through read_fp8 (the attention references take the values it holds)."""
from __future__ import annotations

import torch


FP8 = torch.float8_e4m3fn


def to_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What an FP8 KV cache stores for x: E4M3 of x / scale (float32) clamped to +-448,
    rounded to nearest even (NaN stays NaN: poisoned slots stay poisoned)."""
    return (x.float() / scale).clamp(-448.0, 448.0).to(FP8)


def read_fp8(cache: torch.Tensor, scale: float) -> torch.Tensor:
    """What a kernel reads from an FP8 cache: float32(stored) * scale."""
    return cache.float() * scale


def ref_write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                 v_scale: float = 1.0) -> None:
    """Token t goes to block slot // block_size, row slot % block_size; slot < 0 is skipped.
    An FP8 cache stores to_fp8(key, k_scale) and to_fp8(value, v_scale)."""
    block_size = k_cache.shape[1]
    if k_cache.dtype == FP8:
        key, value = to_fp8(key, k_scale), to_fp8(value, v_scale)
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // block_size, slot % block_size] = key[t].to(k_cache.dtype)
        v_cache[slot // block_size, slot % block_size] = value[t].to(v_cache.dtype)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Positions [0, seq_len) of one sequence: [seq_len, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    pos = torch.arange(seq_len)
    blocks = block_table.cpu().long()[pos // block_size]
    return cache[blocks.to(cache.device), (pos % block_size).to(cache.device)]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
           scale: float, sliding_window: int | None,
           softcap: float | None = None) -> torch.Tensor:
    """q [L, H, D] at positions q_pos [L] over k/v [S, Hkv, D] at positions 0..S-1.

    Query position i sees key j when j <= i and, with a window W, i - W < j. With softcap
    the scaled scores x become softcap * tanh(x / softcap) (Gemma 2). Float32 out.
    """
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("lhd,shd->hls", q.float(), k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    k_pos = torch.arange(k.shape[0], device=q.device)
    q_pos = q_pos.to(q.device)
    visible = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hls,shd->lhd", torch.softmax(scores, dim=-1), v)


def ref_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         sliding_window: int | None = None,
                         softcap: float | None = None) -> torch.Tensor:
    """query [num_seqs, H, D], one token per sequence at position seq_lens[i] - 1."""
    out = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    for i, seq_len in enumerate(seq_lens.tolist()):
        k = gather_context(k_cache, block_tables[i], seq_len)
        v = gather_context(v_cache, block_tables[i], seq_len)
        out[i] = attend(query[i:i + 1], k, v, torch.tensor([seq_len - 1]), scale,
                        sliding_window, softcap)[0]
    return out


def ref_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor,
                          query_start_loc: torch.Tensor, scale: float,
                          sliding_window: int | None = None, first_seq: int = 0,
                          softcap: float | None = None) -> torch.Tensor:
    """Rows of sequences [first_seq, num_seqs): their chunk is the last tokens of the context.

    Returns float32 [num_tokens, H, D]; rows of earlier sequences are zero.
    """
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    qsl = query_start_loc.tolist()
    for i in range(first_seq, len(qsl) - 1):
        start, end, seq_len = qsl[i], qsl[i + 1], int(seq_lens[i])
        k = gather_context(k_cache, block_tables[i], seq_len)
        v = gather_context(v_cache, block_tables[i], seq_len)
        q_pos = torch.arange(seq_len - (end - start), seq_len)
        out[start:end] = attend(query[start:end], k, v, q_pos, scale, sliding_window, softcap)
    return out
