"""What every attention backend is handed for one engine step.

Layout shared by all backends (and the Triton kernels):
  k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], one pair per layer.
  A token at position p of a sequence lives in slot
  block_tables[seq, p // block_size] * block_size + p % block_size.
The batch's tokens are flat ([num_tokens, heads, head_dim]) and ordered by sequence;
sequences with a single query token (decodes) come first.
Sliding window W (Mistral): query position i sees key positions j with i - W < j <= i.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor     # [num_tokens] int64: cache slot of each new token
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor         # [num_seqs] int32: context length after this step
    block_tables: torch.Tensor     # [num_seqs, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    num_decode_seqs: int           # sequences [0, num_decode_seqs) have query length 1
    block_size: int
    # Longest context among the decode sequences (or a bound on it): backends size split-KV
    # from it without reading seq_lens back from the device. None: work it out.
    max_decode_seq_len: int | None = None
    # CPU-side copies, for backends that plan work in Python once per step.
    query_start_loc_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)
    block_tables_cpu: np.ndarray | None = None   # the block tables as a host array
    # Per-step scratch a backend may fill in build() and reuse in every layer.
    cache: dict = field(default_factory=dict)

    def host_block_tables(self) -> np.ndarray:
        if self.block_tables_cpu is None:
            self.block_tables_cpu = self.block_tables.cpu().numpy()
        return self.block_tables_cpu

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])
