"""Paged attention in plain PyTorch: the CPU path and the reference for the kernels.

Per step (not per layer) it turns block tables into gather indices and masks; per layer
it writes the new K/V into the cache and runs SDPA on the gathered context.
Decodes run as one batched call with the query heads of each KV head folded into the
query-length axis (no K/V expansion for GQA); prefill chunks run one call each.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .metadata import AttentionMetadata


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new K/V ([num_tokens, num_kv_heads, head_dim]) at their cache slots."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def _slots(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slot of each position; block_tables [B, max_blocks], positions [B, S] -> [B, S]."""
    blocks = torch.gather(block_tables.long(), 1, torch.div(positions, block_size, rounding_mode="floor"))
    return blocks * block_size + positions % block_size


class TorchAttention:
    name = "torch"

    def _decode_plan(self, meta: AttentionMetadata, window: int | None):
        key = ("decode", window)
        if key not in meta.cache:
            nd = meta.num_decode_seqs
            seq_lens = meta.seq_lens[:nd].long()
            max_len = int(max(meta.seq_lens_cpu[:nd]))
            pos = torch.arange(max_len, device=seq_lens.device)
            valid = pos[None, :] < seq_lens[:, None]
            if window is not None:
                valid &= pos[None, :] > (seq_lens[:, None] - 1 - window)
            pos = torch.minimum(pos[None, :], (seq_lens - 1).clamp(min=0)[:, None])
            slots = _slots(meta.block_tables[:nd], pos, meta.block_size)
            meta.cache[key] = (slots, valid[:, None, None, :])
        return meta.cache[key]

    def _prefill_plan(self, meta: AttentionMetadata, window: int | None):
        key = ("prefill", window)
        if key not in meta.cache:
            plans = []
            qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
            device = meta.seq_lens.device
            for i in range(meta.num_decode_seqs, meta.num_seqs):
                start, end, seq_len = qsl[i], qsl[i + 1], lens[i]
                q_len = end - start
                kpos = torch.arange(seq_len, device=device)
                qpos = torch.arange(seq_len - q_len, seq_len, device=device)
                mask = kpos[None, :] <= qpos[:, None]
                if window is not None:
                    mask &= kpos[None, :] > qpos[:, None] - window
                slots = _slots(meta.block_tables[i:i + 1], kpos[None, :], meta.block_size)[0]
                plans.append((start, end, slots, mask))
            meta.cache[key] = plans
        return meta.cache[key]

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, sliding_window: int | None = None) -> torch.Tensor:
        """query [T, H, D], key/value [T, Hkv, D] -> [T, H, D]; writes key/value first."""
        write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        num_tokens, num_heads, head_dim = query.shape
        num_kv_heads = k_cache.shape[2]
        group = num_heads // num_kv_heads
        k_flat = k_cache.view(-1, num_kv_heads, head_dim)
        v_flat = v_cache.view(-1, num_kv_heads, head_dim)
        out = torch.empty_like(query)
        nd = meta.num_decode_seqs
        if nd:
            slots, valid = self._decode_plan(meta, sliding_window)
            q = query[:nd].view(nd, num_kv_heads, group, head_dim)
            k = k_flat[slots].transpose(1, 2)  # [nd, Hkv, S, D]
            v = v_flat[slots].transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=valid, scale=scale)
            out[:nd] = o.reshape(nd, num_heads, head_dim)
        if nd < meta.num_seqs:
            for start, end, slots, mask in self._prefill_plan(meta, sliding_window):
                q = query[start:end].transpose(0, 1)[None]          # [1, H, L, D]
                k = k_flat[slots].transpose(0, 1)[None].to(q.dtype)  # [1, Hkv, S, D]
                v = v_flat[slots].transpose(0, 1)[None].to(q.dtype)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                   enable_gqa=group > 1)
                out[start:end] = o[0].transpose(0, 1)
        return out
