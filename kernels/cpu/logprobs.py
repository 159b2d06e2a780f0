"""Log-probabilities from float32 or bfloat16 logits on CPUs (logprobs.c), built by build.py
and called through ctypes.

What a request's `logprobs` asks of every step: the top k of each row's log-softmax and
the sampled token's value and rank. torch's way writes the whole [rows, vocab]
log-softmax and reads it three more times, about 0.23 s a step for 256 rows of a
151,936-token vocabulary on two cores; this reads each row three times and writes only
what is asked for (see logprobs.c). Where the library cannot be built, available() is
false and the sampler keeps to torch.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from . import build

SOURCE = Path(__file__).with_name("logprobs.c")


class LogprobsKernel:
    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fns = build.entry_points(
            lib, {torch.float32: "logprobs_f32", torch.bfloat16: "logprobs_bf16"},
            [p, i64, i64, i64, i64, p, p, p, p, p], None)
        lib.logprobs_max_k.restype = ctypes.c_int
        self.max_k = int(lib.logprobs_max_k())

    def supports(self, logits: torch.Tensor, k: int) -> bool:
        return (logits.device.type == "cpu" and logits.dtype in self._fns
                and logits.dim() == 2 and logits.stride(1) == 1
                and 0 <= k <= min(self.max_k, logits.shape[1]))

    def __call__(self, logits: torch.Tensor, k: int, tokens: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids [rows, k], values [rows, k + 1] float32, ranks [rows], bad [rows] bool) for
        logits [rows, vocab] (rows may be strided) and tokens [rows] (int64): the top k of
        each row's log-softmax, largest first (ties by index), then tokens' values, and
        their ranks (1 = largest). Rows marked bad (no finite maximum logit) are left
        unwritten, for the caller to take from torch."""
        rows, n = logits.shape if logits.dim() == 2 else (0, 0)
        if not (self.supports(logits, k) and n > 0 and tokens.shape == (rows,)
                and tokens.dtype == torch.int64 and tokens.is_contiguous()
                and tokens.device.type == "cpu"
                and (rows == 0 or (int(tokens.min()) >= 0 and int(tokens.max()) < n))):
            raise ValueError("cpu logprobs: arguments out of contract")
        ids = torch.empty(rows, k, dtype=torch.int64)
        values = torch.empty(rows, k + 1, dtype=torch.float32)
        ranks = torch.empty(rows, dtype=torch.int64)
        bad = torch.empty(rows, dtype=torch.int32)
        if rows:
            self._fns[logits.dtype](logits.data_ptr(), rows, n, logits.stride(0), k,
                                    tokens.data_ptr(), ids.data_ptr(), values.data_ptr(),
                                    ranks.data_ptr(), bad.data_ptr())
        return ids, values, ranks, bad.bool()


def _kernel() -> LogprobsKernel | None:
    return build.load(SOURCE, LogprobsKernel)


def available() -> bool:
    """Whether the kernel is built here (on first use) and not switched off
    (BATCHINFER_CPU_KERNELS=0)."""
    return _kernel() is not None


def max_k() -> int:
    """The largest k the kernel takes (0 where it is not available)."""
    kernel = _kernel()
    return kernel.max_k if kernel is not None else 0


def supports(logits: torch.Tensor, k: int) -> bool:
    """Whether the kernel takes logits and k: available, float32 or bfloat16 [rows, vocab]
    on the CPU with each row contiguous, k at most max_k() and vocab."""
    return logits.device.type == "cpu" and available() and _kernel().supports(logits, k)


def logprobs(logits: torch.Tensor, k: int, tokens: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, values, ranks, bad) of each row (LogprobsKernel.__call__), for logits and k
    supports() takes."""
    return _kernel()(logits, k, tokens)
