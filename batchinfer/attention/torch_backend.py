"""Paged attention in plain PyTorch: the CPU path and the reference for the kernels.

Per step (not per layer) it turns block tables into gather indices and masks; per layer
it writes the new K/V into the cache and runs SDPA on the gathered context.
Decodes run as one batched call with the query heads of each KV head folded into the
query-length axis (no K/V expansion for GQA); prefill chunks run one call each.
When all decodes share leading blocks (a common system prompt), those blocks are attended
once for the whole batch (one dense matmul over the shared K/V) and only each sequence's own
tail is gathered; the two partial results are merged by their log-sum-exp (cascade
attention). That cuts the bytes copied per layer by the shared fraction of the context.
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


def _flash_with_lse(q, k, v, mask, scale):
    """CPU flash attention returning (out, logsumexp); q/k/v [B, H, L, D]."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=mask, scale=scale)[:2]
    return out, lse


def _shared_prefix_blocks(block_tables: torch.Tensor, seq_lens: list[int], block_size: int) -> int:
    """Leading block ids common to every row, leaving each row at least one own token."""
    if block_tables.shape[0] < 2:
        return 0
    limit = (min(seq_lens) - 1) // block_size
    if limit <= 0:
        return 0
    same = (block_tables[:, :limit] == block_tables[:1, :limit]).all(dim=0)
    differ = torch.nonzero(~same)
    return int(differ[0, 0]) if differ.numel() else limit


def _length_groups(lens: list[int], max_groups: int, min_size: int = 16) -> list[tuple[int, int]]:
    """Split [0, len(lens)) into up to max_groups contiguous ranges of equal count."""
    n = len(lens)
    g = max(1, min(max_groups, n // min_size))
    bounds = [round(i * n / g) for i in range(g + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(g)]


class TorchAttention:
    name = "torch"
    # Below this many shared tokens the extra call costs more than the saved copying.
    min_cascade_tokens = 64
    # Decodes are padded to the longest context of their group; the runner sorts them by
    # length, so a few groups cut the padding to a small fraction.
    max_decode_groups = 4

    def _decode_plan(self, meta: AttentionMetadata, window: int | None, dtype: torch.dtype):
        """Per step: the shared leading blocks (if worth a cascade) and, for each group of
        decodes of similar length, the slots of their own tokens and a padding mask."""
        key = ("decode", window, dtype)
        if key not in meta.cache:
            nd = meta.num_decode_seqs
            bs = meta.block_size
            lens_cpu = meta.seq_lens_cpu[:nd]
            shared = 0
            if window is None or max(lens_cpu) <= window:
                shared = _shared_prefix_blocks(meta.block_tables[:nd], lens_cpu, bs)
                if shared * bs < self.min_cascade_tokens:
                    shared = 0
            start = shared * bs
            groups = []
            for a, b in _length_groups(lens_cpu, self.max_decode_groups):
                seq_lens = meta.seq_lens[a:b].long()
                pos = torch.arange(start, max(lens_cpu[a:b]), device=seq_lens.device)
                valid = pos[None, :] < seq_lens[:, None]
                if window is not None:
                    valid &= pos[None, :] > (seq_lens[:, None] - 1 - window)
                pos = torch.minimum(pos[None, :], (seq_lens - 1)[:, None])
                slots = _slots(meta.block_tables[a:b], pos, bs)
                mask = torch.zeros(valid.shape, dtype=dtype, device=valid.device)
                mask.masked_fill_(~valid, float("-inf"))
                groups.append((a, b, slots.flatten(), slots.shape[1], mask[:, None, None, :]))
            prefix_slots = None
            if shared:
                prefix_pos = torch.arange(start, device=meta.seq_lens.device)[None]
                prefix_slots = _slots(meta.block_tables[:1], prefix_pos, bs)[0]
            meta.cache[key] = (groups, prefix_slots)
        return meta.cache[key]

    def _decode(self, q, k_flat, v_flat, meta, window, scale):
        """q [nd, Hkv, group, D] -> [nd, Hkv, group, D]."""
        nd, num_kv_heads, group, head_dim = q.shape
        groups, prefix_slots = self._decode_plan(meta, window, q.dtype)
        own = torch.empty_like(q)
        own_lse = torch.empty(nd, num_kv_heads, group, dtype=torch.float32, device=q.device)
        for a, b, slots, num_slots, mask in groups:
            k = k_flat.index_select(0, slots).view(b - a, num_slots, num_kv_heads, head_dim)
            v = v_flat.index_select(0, slots).view(b - a, num_slots, num_kv_heads, head_dim)
            k, v = k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype)
            if prefix_slots is None:
                own[a:b] = F.scaled_dot_product_attention(q[a:b], k, v, attn_mask=mask, scale=scale)
            else:
                own[a:b], own_lse[a:b] = _flash_with_lse(q[a:b], k, v, mask, scale)
        if prefix_slots is None:
            return own
        # every query row of the batch against the shared prefix, as one [Hkv, nd*group] block
        qp = q.permute(1, 0, 2, 3).reshape(1, num_kv_heads, nd * group, head_dim)
        kp = k_flat.index_select(0, prefix_slots).transpose(0, 1)[None].to(q.dtype)
        vp = v_flat.index_select(0, prefix_slots).transpose(0, 1)[None].to(q.dtype)
        shared, shared_lse = _flash_with_lse(qp, kp, vp, None, scale)
        shared = shared.view(num_kv_heads, nd, group, head_dim).transpose(0, 1)
        shared_lse = shared_lse.view(num_kv_heads, nd, group).transpose(0, 1)
        top = torch.maximum(own_lse, shared_lse)
        w_own = torch.exp(own_lse - top)[..., None]
        w_shared = torch.exp(shared_lse - top)[..., None]
        merged = (own.float() * w_own + shared.float() * w_shared) / (w_own + w_shared)
        return merged.to(q.dtype)

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
            q = query[:nd].view(nd, num_kv_heads, group, head_dim)
            o = self._decode(q, k_flat, v_flat, meta, sliding_window, scale)
            out[:nd] = o.reshape(nd, num_heads, head_dim)
        if nd < meta.num_seqs:
            for start, end, slots, mask in self._prefill_plan(meta, sliding_window):
                q = query[start:end].transpose(0, 1)[None]          # [1, H, L, D]
                k = k_flat.index_select(0, slots).transpose(0, 1)[None].to(q.dtype)  # [1, Hkv, S, D]
                v = v_flat.index_select(0, slots).transpose(0, 1)[None].to(q.dtype)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                   enable_gqa=group > 1)
                out[start:end] = o[0].transpose(0, 1)
        return out
