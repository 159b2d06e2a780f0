"""Fused elementwise operations for models on CPUs (ops.c), built by build.py and called
through ctypes.

torch runs RMSNorm as about eight passes over memory (nine with the residual add before
it) and SiLU-times-up as two, for bfloat16 each converting to float32 and back, for
float32 each writing a temporary; these do each in one pass, for bfloat16 with torch's
rounding (see ops.c). They apply to contiguous bfloat16 and float32 CPU tensors whose
last dimension is a multiple of 16 (RMSNorm also to some heads of a projection's output,
in place: per-head q/k norms, see supports_heads()); for anything else, or where the
library cannot be built, supports() is false and the model keeps to torch.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from . import build

SOURCE = Path(__file__).with_name("ops.c")


class OpsKernels:
    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        act_args = [p, p, p, i64, i64, i64, i64, i64]
        self._silu_mul = build.entry_points(
            lib, {torch.bfloat16: "silu_mul_bf16", torch.float32: "silu_mul_f32"},
            act_args, None)
        self._gelu_tanh_mul = build.entry_points(
            lib, {torch.bfloat16: "gelu_tanh_mul_bf16", torch.float32: "gelu_tanh_mul_f32"},
            act_args, None)
        rms_args = [p, p, p, p, i64, i64, i64, i64, i64, ctypes.c_float]
        self._rms_norm = {
            **build.entry_points(lib, {torch.bfloat16: "rms_norm_bf16"},
                                 rms_args + [ctypes.c_int], None),
            **build.entry_points(lib, {torch.float32: "rms_norm_f32"}, rms_args, None)}
        self._argmax = build.entry_points(
            lib, {torch.bfloat16: "argmax_bf16", torch.float32: "argmax_f32"},
            [p, i64, i64, i64, p], None)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 gemma_order: bool = False) -> torch.Tensor:
        """weight * round(x / sqrt(mean(x^2) + eps)) over the last dimension (the rounding
        only for bfloat16); with gemma_order (bfloat16 x), weight is float32 and multiplies
        before the one rounding, round(x / sqrt(...) * weight). With residual (x and it
        contiguous): residual += x (in place, rounded as torch's add), and the sum is what is
        normalised. x may be some heads of a projection's output (supports_heads), and out may
        be x itself (in place); a new contiguous tensor otherwise."""
        layout = _row_layout(x)
        if not (layout is not None and (not gemma_order or x.dtype == torch.bfloat16)
                and weight.dtype == (torch.float32 if gemma_order else x.dtype)
                and weight.is_contiguous() and weight.shape == x.shape[-1:]
                and weight.device.type == "cpu"
                and (residual is None or (x.is_contiguous() and _contiguous_rows(residual)
                                          and residual.shape == x.shape
                                          and residual.dtype == x.dtype
                                          and residual.data_ptr() != x.data_ptr()))
                and (out is None or out is x)):
            raise ValueError("cpu rms_norm: arguments out of contract")
        inner, x_outer = layout
        if out is None:
            out = torch.empty(x.shape, dtype=x.dtype)
            out_outer = inner * x.shape[-1]
        else:
            out_outer = x_outer
        n = x.shape[-1]
        if x.numel() == 0:
            return out
        args = (x.data_ptr(), residual.data_ptr() if residual is not None else None,
                weight.data_ptr(), out.data_ptr(), x.numel() // n, n, inner, x_outer,
                out_outer, eps)
        if x.dtype == torch.bfloat16:
            self._rms_norm[x.dtype](*args, int(gemma_order))
        else:
            self._rms_norm[x.dtype](*args)
        return out

    def silu_mul_(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate = silu(gate) * up, in place; returns gate."""
        return self._act_mul_(self._silu_mul, gate, up)

    def gelu_tanh_mul_(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate = gelu(gate, approximate="tanh") * up, in place; returns gate."""
        return self._act_mul_(self._gelu_tanh_mul, gate, up)

    def _act_mul_(self, fns, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if not (_contiguous_rows(gate) and _contiguous_rows(up) and up.shape == gate.shape
                and up.dtype == gate.dtype):
            raise ValueError("cpu activation x up: arguments out of contract")
        n = gate.shape[-1]
        fns[gate.dtype](gate.data_ptr(), up.data_ptr(), gate.data_ptr(), gate.numel() // n, n,
                        n, n, n)
        return gate

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Row-wise argmax of bfloat16 or float32 [rows, n] (rows may be strided), as
        torch.argmax: the first maximum, a NaN counting as the largest value."""
        if not (x.device.type == "cpu" and x.dtype in self._argmax and x.dim() == 2
                and x.stride(1) == 1 and 0 < x.shape[1] < 2 ** 31 - 32):
            raise ValueError("cpu argmax: arguments out of contract")
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self._argmax[x.dtype](x.data_ptr(), x.shape[0], x.shape[1], x.stride(0),
                              out.data_ptr())
        return out


def _contiguous_rows(x: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32)
            and x.dim() >= 1 and x.shape[-1] % 16 == 0 and x.is_contiguous())


def _row_layout(x: torch.Tensor) -> tuple[int, int] | None:
    """(inner, outer_stride) when x's rows of x.shape[-1] elements lie as the kernels walk
    them: a contiguous x, or [tokens, heads, head_dim] with the heads of a token contiguous
    and tokens outer_stride elements apart (some heads of a projection's output). None for
    any other layout."""
    if not (x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32)
            and x.dim() >= 1 and x.shape[-1] % 16 == 0):
        return None
    n = x.shape[-1]
    if x.is_contiguous():
        return max(x.numel() // n, 1), 0
    if (x.dim() == 3 and x.stride(2) == 1 and (x.stride(1) == n or x.shape[1] == 1)
            and x.stride(0) >= x.shape[1] * n):  # tokens' rows do not overlap
        return x.shape[1], x.stride(0)
    return None


def _kernels() -> OpsKernels | None:
    return build.load(SOURCE, OpsKernels)


def available() -> bool:
    """Whether the ops are built here (on first use) and not switched off
    (BATCHINFER_CPU_KERNELS=0)."""
    return _kernels() is not None


def supports(*tensors: torch.Tensor | None) -> bool:
    """Whether the ops take these tensors (None ones aside): available, and each a
    contiguous bfloat16 or float32 CPU tensor whose last dimension is a multiple of 16."""
    return all(t is None or _contiguous_rows(t) for t in tensors) and available()


def supports_heads(x: torch.Tensor) -> bool:
    """Whether rms_norm takes x in place (out=x): available, and x contiguous or some heads
    of a projection's output ([tokens, heads, head_dim], each token's heads contiguous)."""
    return _row_layout(x) is not None and available()


def supports_argmax(logits: torch.Tensor) -> bool:
    """Whether argmax takes logits: available, bfloat16 or float32 [rows, n] on the CPU
    with each row contiguous."""
    return (logits.device.type == "cpu" and logits.dtype in (torch.bfloat16, torch.float32)
            and logits.dim() == 2 and logits.stride(1) == 1
            and 0 < logits.shape[1] < 2 ** 31 - 32 and available())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
             gemma_order: bool = False) -> torch.Tensor:
    """OpsKernels.rms_norm, for tensors supports() (or, in place, supports_heads()) takes."""
    return _kernels().rms_norm(x, weight, eps, residual, out, gemma_order)


def silu_mul_(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate = silu(gate) * up, in place; returns gate. For tensors supports() takes."""
    return _kernels().silu_mul_(gate, up)


def gelu_tanh_mul_(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate = gelu(gate, approximate="tanh") * up, in place; returns gate. For tensors
    supports() takes."""
    return _kernels().gelu_tanh_mul_(gate, up)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """OpsKernels.argmax, for logits supports_argmax() takes."""
    return _kernels().argmax(logits)
