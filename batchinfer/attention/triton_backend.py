"""Paged attention with the Triton kernels: K/V are read straight from the cache blocks,
never gathered into padded tensors. Decodes (sequences [0, num_decode_seqs)) go to the
GQA decode kernel, with split-KV when the batch is too small to fill the GPU; the other
sequences (prefill chunks, prefix-cache hits, mixed steps) go to the varlen prefill kernel.
On CPU tensors the same kernels run under the Triton interpreter (TRITON_INTERPRET=1). An
FP8 cache is written and read inside the kernels, with the layer's scales."""
from __future__ import annotations

import torch

from batchinfer.kernels.triton.decode import paged_decode_attention
from batchinfer.kernels.triton.kv_write import write_kv
from batchinfer.kernels.triton.prefill import paged_prefill_attention

from .metadata import AttentionMetadata


class TritonAttention:
    name = "triton"

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, sliding_window: int | None = None, k_scale: float = 1.0,
                v_scale: float = 1.0, softcap: float | None = None) -> torch.Tensor:
        """query [T, H, D], key/value [T, Hkv, D] -> [T, H, D]; writes key/value first
        (None: the caller has written them). k_scale, v_scale: an FP8 cache's scales;
        softcap: scores become softcap * tanh(scores / softcap).

        The step's prefill tile plan and split-KV partial buffers live in meta.cache, so
        every layer after the first reuses them.
        """
        if key is not None:
            write_kv(key, value, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        nd = meta.num_decode_seqs
        if nd:
            max_len = meta.max_decode_seq_len
            if max_len is None and meta.seq_lens_cpu:
                max_len = max(meta.seq_lens_cpu[:nd])
            paged_decode_attention(query[:nd], k_cache, v_cache, meta.block_tables[:nd],
                                   meta.seq_lens[:nd], scale, sliding_window, out=out[:nd],
                                   max_seq_len=max_len, scratch=meta.cache, k_scale=k_scale,
                                   v_scale=v_scale, softcap=softcap)
        if nd < meta.num_seqs:
            paged_prefill_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                    meta.query_start_loc, scale, sliding_window, out=out,
                                    first_seq=nd,
                                    query_start_loc_cpu=meta.query_start_loc_cpu or None,
                                    scratch=meta.cache, k_scale=k_scale, v_scale=v_scale,
                                    softcap=softcap)
        return out
