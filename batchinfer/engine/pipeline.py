"""Pipeline parallelism: a step's hidden states move from stage to stage, in micro-batches.

Each stage holds a contiguous range of the decoder layers (batchinfer.model.parallel
stage_layers) and their KV cache. Every rank gets the same plan; the step's requests are
cut into micro-batches of about equal tokens (up to one per stage), and a stage sends each
micro-batch's (hidden, residual) on to the next stage as soon as it has run it, so while
the second stage runs the first micro-batch the first stage runs the second (GPipe's
schedule within a step). The last stage samples the whole step at once, as one process
would, and broadcasts its RunnerOutput to every rank (encoded by batchinfer.engine.wire,
never pickled), which append the sampled tokens to their own copies of the requests.
Tensors go point to point over the device group (NCCL on GPUs, gloo on CPUs); the output
goes over the gloo group.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from batchinfer.engine import wire
from batchinfer.model.parallel import PipelineParallel, TensorParallel


def micro_batches(num_new: np.ndarray, stages: int) -> list[tuple[int, int]]:
    """[start, end) ranges of the step's requests: up to `stages` runs of about equal
    tokens, none empty, in order."""
    n = len(num_new)
    parts = min(stages, n)
    if parts <= 1:
        return [(0, n)]
    cum = np.cumsum(num_new)
    total = int(cum[-1])
    bounds = [0]
    for k in range(1, parts):
        # the first request at which k/parts of the tokens are reached, leaving room for
        # one request in each later part
        cut = int(np.searchsorted(cum, total * k / parts, side="left")) + 1
        cut = min(max(cut, bounds[-1] + 1), n - (parts - k))
        bounds.append(cut)
    bounds.append(n)
    return list(zip(bounds[:-1], bounds[1:]))


def receive(num_tokens: int, hidden_size: int, dtype: torch.dtype,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The previous stage's (hidden, residual) for a micro-batch of num_tokens tokens."""
    src = PipelineParallel.peer(PipelineParallel.rank - 1)
    hidden = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
    residual = torch.empty_like(hidden)
    dist.recv(hidden, src=src)
    dist.recv(residual, src=src)
    return hidden, residual


def send(hidden: torch.Tensor, residual: torch.Tensor) -> list:
    """Start sending a micro-batch's (hidden, residual) to the next stage; wait() on what
    comes back before the tensors are reused (they are kept alive by the list)."""
    dst = PipelineParallel.peer(PipelineParallel.rank + 1)
    hidden, residual = hidden.contiguous(), residual.contiguous()
    return [dist.isend(hidden, dst=dst), dist.isend(residual, dst=dst), hidden, residual]


def wait(pending: list) -> None:
    for item in pending:
        if not isinstance(item, torch.Tensor):
            item.wait()


def share_output(output):
    """The last stage's output of the step, on every rank (the last stage's first
    tensor-parallel rank sends it)."""
    src = (PipelineParallel.size - 1) * TensorParallel.size
    data = wire.broadcast_bytes(wire.encode_output(output) if output is not None else None,
                                src, TensorParallel.cpu_group)
    return output if output is not None else wire.decode_output(data)
