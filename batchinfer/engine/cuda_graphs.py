"""CUDA graphs for decode steps.

A decode step of a small batch or a small model is bound by launching its kernels, not by
running them (an 8B model at 128 sequences on an H200: ~1,100 launches, 20 ms of wall time
for 10 ms of GPU work). So the model's forward pass is captured once per batch size in
capture_sizes(), and a decode-only step replays the graph of the smallest size that holds
it. The step's inputs are copied into static buffers the graphs read; the rows past the
batch are padding that writes no KV (slot -1) and attends to nothing (context length 0).

The graphs are captured with the longest possible context (max_model_len) standing in for
the step's, so the decode kernel's split-KV count is fixed per size: splits past a
sequence's end find no keys and contribute nothing.

Under tensor parallelism every rank captures its own graphs, holding the forward pass's
NCCL all-reduces. The ranks capture the same sizes in the same order (the sizes come from
the shared config, the block table's width from the KV block count they agreed on), and
execute the same plans, so each replay meets the same replay on every other rank.
"""
from __future__ import annotations

import bisect

import numpy as np
import torch

from batchinfer.attention import AttentionMetadata

MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int, limit: int = MAX_CAPTURE_SIZE) -> list[int]:
    """1, 2, 4, then every multiple of 8, up to min(max_num_seqs, limit) (which is always
    included, so every batch up to it has a size)."""
    top = min(max_num_seqs, limit)
    sizes = [s for s in (1, 2, 4) if s < top] + list(range(8, top, 8))
    return sizes + [top]


def captures_decode_graphs(device: torch.device, enforce_eager: bool, backend: str,
                           graph_safe: bool) -> bool:
    """Whether decode steps replay CUDA graphs: on CUDA with the Triton attention backend,
    which reads all it needs from device tensors (the torch backend plans on the host each
    step), for a model whose forward pass can be captured, unless enforce_eager. Tensor
    parallelism does not change it."""
    return device.type == "cuda" and not enforce_eager and backend == "triton" and graph_safe


class DecodeGraphs:
    """Static input buffers and one graph per batch size; run() executes a decode batch.

    With capture=False nothing is captured and run() executes the same padded forward pass
    eagerly on the static buffers (what the graph would replay): this is how the padding is
    checked on machines without CUDA.
    """

    def __init__(self, model: torch.nn.Module, kv_caches, *, sizes: list[int],
                 max_blocks_per_seq: int, block_size: int, max_model_len: int,
                 device: torch.device, capture: bool = True):
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sorted(sizes)
        self.block_size = block_size
        self.max_model_len = max_model_len
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32,
                                        device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        # A step's inputs are staged in pinned host buffers (ids, positions, slots and
        # lengths side by side, so they go in one copy) and copied without blocking; the
        # next step waits on _copied before it overwrites them.
        pin = device.type == "cuda"
        self._host = torch.zeros((n, 4), dtype=torch.long, pin_memory=pin)
        self._host_blocks = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32,
                                        pin_memory=pin)
        self._copied = torch.cuda.Event() if pin else None
        self._metas = {b: self._metadata(b) for b in self.sizes}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if capture:
            try:
                self._capture()
            except RuntimeError as e:
                raise RuntimeError(
                    f"capturing CUDA graphs for decode steps failed: {e}. Run with "
                    "enforce_eager=True (--enforce-eager), or, if the device ran out of "
                    "memory, with a lower gpu_memory_utilization") from e

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def size_for(self, num_seqs: int) -> int | None:
        """The smallest captured size that holds num_seqs sequences (None: too many)."""
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def _metadata(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:b], query_start_loc=self.query_start_loc[:b + 1],
            seq_lens=self.seq_lens[:b], block_tables=self.block_tables[:b], max_query_len=1,
            max_seq_len=self.max_model_len, num_decode_seqs=b, block_size=self.block_size,
            max_decode_seq_len=self.max_model_len)

    def _forward(self, b: int) -> torch.Tensor:
        return self.model(self.input_ids[:b], self.positions[:b], self._metas[b],
                          self.kv_caches)

    @torch.inference_mode()
    def _capture(self) -> None:
        # largest first, all sizes in one memory pool: the smaller graphs reuse its blocks
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):
            self._forward(b)  # compiles the Triton kernels for this size outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._forward(b)
            self.graphs[b] = (graph, hidden)
        torch.cuda.synchronize()

    def run(self, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
            seq_lens: np.ndarray, block_tables: np.ndarray,
            fill: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Hidden states [len(input_ids), hidden] of a decode batch of at most max_size
        sequences; block_tables [n, <= max_blocks_per_seq] host rows. fill: (indices, ids)
        of inputs that are on the device already (async scheduling's sampled tokens)."""
        n = len(input_ids)
        b = self.size_for(n)
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copies have left the host buffers
        host = self._host
        host[n:b] = 0
        host[n:b, 2] = -1  # padding rows store no KV
        host[:n, 0] = torch.as_tensor(input_ids)
        host[:n, 1] = torch.from_numpy(positions)
        host[:n, 2] = torch.from_numpy(slots)
        host[:n, 3] = torch.from_numpy(seq_lens)
        # whole rows, so the copy is contiguous; columns past the batch's longest context
        # hold stale ids that no kernel reads (every key load is bounded by seq_lens)
        self._host_blocks[:n, :block_tables.shape[1]] = torch.from_numpy(block_tables)
        staged = host[:b].to(self.input_ids.device, non_blocking=True)
        self.block_tables[:n].copy_(self._host_blocks[:n], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        self.input_ids[:b].copy_(staged[:, 0])
        self.positions[:b].copy_(staged[:, 1])
        self.slot_mapping[:b].copy_(staged[:, 2])
        self.seq_lens[:b].copy_(staged[:, 3])
        if fill is not None:
            self.input_ids[fill[0]] = fill[1]
        if b in self.graphs:
            graph, hidden = self.graphs[b]
            graph.replay()
        else:
            # fresh metadata: the CPU kernels validate a step's tensors once, keyed on them
            hidden = self.model(self.input_ids[:b], self.positions[:b], self._metadata(b),
                                self.kv_caches)
        return hidden[:n]
