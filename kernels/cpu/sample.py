"""Random sampling from float32 or bfloat16 logits on CPUs (sample.c), built by build.py
and called through ctypes.

torch's way, dividing by the temperature, a softmax, exponential noise for every logit,
and a full sort of each row for top_k or top_p, takes about 1.1 s (temperature alone) to
3.4 s (with top_p) for 256 rows of a 151,936-token vocabulary on two cores; this takes each
row in about three passes over its logits, sorting nothing (see sample.c). The result
has the same distribution, from other random numbers: one 64-bit seed per row and step,
drawn from the row's torch generator. Where the library cannot be built, available() is
false and the sampler keeps to torch.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from . import build

SOURCE = Path(__file__).with_name("sample.c")


class SampleKernel:
    def __init__(self, path: Path):
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fns = build.entry_points(
            ctypes.CDLL(str(path)), {torch.float32: "sample_f32", torch.bfloat16: "sample_bf16"},
            [p, i64, i64, i64, p, p, p, p, p, p], ctypes.c_int)

    def __call__(self, logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor, min_p: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
        """One token per row of float32 or bfloat16 logits [rows, vocab] (rows may be
        strided; bfloat16 is widened exactly, so the same values in either type draw the
        same token), with per-row temperature (float32), top_k (<= 0: off; int64), top_p
        (>= 1: off), min_p (<= 0: off) and seed (int64). -1 for a greedy row (temperature
        <= 0) and for one with no finite maximum logit: the caller takes its argmax."""
        rows, n = logits.shape if logits.dim() == 2 else (0, 0)
        params = (temperature, top_k, top_p, min_p, seeds)
        dtypes = (torch.float32, torch.int64, torch.float32, torch.float32, torch.int64)
        if not (logits.dim() == 2 and logits.dtype in self._fns
                and logits.device.type == "cpu" and logits.stride(1) == 1 and n > 0
                and all(t.shape == (rows,) and t.dtype == d and t.is_contiguous()
                        and t.device.type == "cpu" for t, d in zip(params, dtypes))):
            raise ValueError("cpu sample: arguments out of contract")
        out = torch.empty(rows, dtype=torch.int64)
        if rows and self._fns[logits.dtype](logits.data_ptr(), rows, n, logits.stride(0),
                                            *(t.data_ptr() for t in params), out.data_ptr()):
            raise MemoryError("cpu sample: no scratch memory for a row's weights")
        return out


def _kernel() -> SampleKernel | None:
    return build.load(SOURCE, SampleKernel)


def available() -> bool:
    """Whether the kernel is built here (on first use) and not switched off
    (BATCHINFER_CPU_KERNELS=0)."""
    return _kernel() is not None


def supports(logits: torch.Tensor) -> bool:
    """Whether the kernel takes logits: available, float32 or bfloat16 [rows, vocab] on the
    CPU with each row contiguous."""
    return (logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16)
            and logits.dim() == 2 and logits.stride(1) == 1 and available())


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, min_p: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """One token per row (SampleKernel.__call__), for logits supports() takes."""
    return _kernel()(logits, temperature, top_k, top_p, min_p, seeds)
