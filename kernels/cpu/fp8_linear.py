"""Weight-only FP8 linear products for CPUs: y = x dequant(W)^T (+ bias), the C kernel of
fp8_linear.c (built by build.py, called through ctypes) and a tiled torch path.

The weight format: W float8_e4m3fn [N, K] contiguous, its scales float32 [N, G] contiguous
with G = ceil(K / group_size) (the last group may be partial), and
dequant(W)[n, k] = float(W[n, k]) * scale[n, k // group_size]. x is [..., K] in bfloat16,
float16 or float32; the result is [..., N] in x's dtype, plus bias [N] when given.

linear() takes any such CPU tensors. Up to KERNEL_MAX_ROWS rows of x (decode batches) go to
the C kernel, which reads W's bytes and widens them to float32 as it multiplies, each
piece once for all rows of x. More rows (prefill), or tensors the kernel does not take
(supports()), or no kernel (no gcc, BATCHINFER_CPU_KERNELS=0): the tiled path dequantises
at most TILE_BYTES of W's rows at a time to x's dtype and multiplies them with F.linear
(oneDNN), writing the output's columns. Neither path ever holds a full-precision copy of W.
The tiles are dequantised by the same C library's vectorised conversion where it is built,
by torch's float8 conversion elsewhere.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F

from . import build

SOURCE = Path(__file__).with_name("fp8_linear.c")
# Rows of x up to which linear() runs the C kernel; from there on, the tiled path. A first
# guess, to be set from `batchinfer bench kernels --cpu-fp8-linear`.
KERNEL_MAX_ROWS = 12  # measured: the C kernel wins below about 12 rows, the tiled path above (docs/measurements.md)
# Scratch of the tiled path: W's rows dequantised at a time (in x's dtype; the fallback and
# float16 go through float32 first).
TILE_BYTES = 8 << 20
X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class Fp8LinearKernel:
    """fp8_linear.c's entry points, with the argument checks that keep them in bounds."""

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fn = build.entry_points(lib, {torch.float32: "fp8_linear_f32"},
                                      [p, i64, p, p, p, p, i64, i64, i64, i64],
                                      None)[torch.float32]
        self._dequantize = build.entry_points(lib, {torch.float32: "fp8_dequantize"},
                                              [p, p, p, i64, i64, i64, ctypes.c_int],
                                              None)[torch.float32]

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] (any layout) times dequant(weight)^T, plus bias [N] (any float dtype),
        accumulated in float32 and returned [..., N] in x's dtype, for tensors fits()."""
        if not (fits(x, weight, weight_scale, group_size) and _bias_fits(bias, weight)):
            raise ValueError("cpu fp8 linear: arguments out of contract")
        n, k = weight.shape
        x2 = x.reshape(-1, k)
        k16 = -(-k // 16) * 16
        if x2.dtype == torch.float32 and x2.is_contiguous() and k16 == k:
            xf = x2
        else:  # float32, rows padded with zeros to a multiple of 16 elements
            xf = torch.empty(x2.shape[0], k16, dtype=torch.float32)
            xf[:, :k] = x2
            xf[:, k:] = 0
        b = None if bias is None else bias.to(torch.float32).contiguous()
        y = torch.empty(x2.shape[0], n, dtype=torch.float32)
        self._fn(xf.data_ptr(), k16, weight.data_ptr(), weight_scale.data_ptr(),
                 None if b is None else b.data_ptr(), y.data_ptr(), x2.shape[0], n, k,
                 group_size)
        return y.to(x.dtype).reshape(*x.shape[:-1], n)

    def dequantize(self, weight: torch.Tensor, weight_scale: torch.Tensor, group_size: int,
                   dtype: torch.dtype) -> torch.Tensor:
        """dequant(weight) [N, K] in dtype (bfloat16, float16 or float32; rounded once from
        float32), a new tensor, for weights weight_fits()."""
        if not (weight_fits(weight, weight_scale, group_size) and dtype in X_DTYPES):
            raise ValueError("cpu fp8 dequantize: arguments out of contract")
        out = torch.empty(weight.shape, dtype=torch.bfloat16 if dtype == torch.bfloat16
                          else torch.float32)
        self._dequantize(weight.data_ptr(), weight_scale.data_ptr(), out.data_ptr(),
                         weight.shape[0], weight.shape[1], group_size,
                         int(dtype == torch.bfloat16))
        return out.to(dtype)


def weight_fits(weight: torch.Tensor, weight_scale: torch.Tensor, group_size: int) -> bool:
    """Whether the C code takes this weight (whether or not it is built here): CPU tensors,
    weight float8_e4m3fn [N, K] contiguous, weight_scale float32 [N, ceil(K / group_size)]
    contiguous."""
    return (isinstance(group_size, int) and group_size >= 1
            and weight.device.type == weight_scale.device.type == "cpu"
            and weight.dtype == torch.float8_e4m3fn and weight.dim() == 2
            and weight.is_contiguous() and weight.shape[1] >= 1
            and weight_scale.dtype == torch.float32 and weight_scale.is_contiguous()
            and weight_scale.shape == (weight.shape[0], -(-weight.shape[1] // group_size)))


def fits(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
         group_size: int) -> bool:
    """Whether the C kernel takes these tensors (whether or not it is built here): x
    [..., K] bfloat16, float16 or float32 on the CPU (any layout), and a weight
    weight_fits()."""
    return (weight_fits(weight, weight_scale, group_size) and x.device.type == "cpu"
            and x.dtype in X_DTYPES and x.dim() >= 1 and x.shape[-1] == weight.shape[1])


def _bias_fits(bias: torch.Tensor | None, weight: torch.Tensor) -> bool:
    return bias is None or (bias.device.type == "cpu" and bias.is_floating_point()
                            and bias.shape == weight.shape[:1])


def _kernel() -> Fp8LinearKernel | None:
    return build.load(SOURCE, Fp8LinearKernel)


def available() -> bool:
    """Whether the kernel is built here (on first use) and not switched off
    (BATCHINFER_CPU_KERNELS=0)."""
    return _kernel() is not None


def supports(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             group_size: int) -> bool:
    """Whether the kernel takes these tensors: fits() and available()."""
    return fits(x, weight, weight_scale, group_size) and available()


def linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
           group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] times dequant(weight)^T (weight [N, K], weight_scale [N, G]), plus bias
    [N]: [..., N] in x's dtype. The C kernel for up to KERNEL_MAX_ROWS rows of x where
    supports() holds, the tiled path otherwise. ValueError for shapes that do not match."""
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1] or x.shape[-1] < 1:
        raise ValueError(f"fp8 linear: x {tuple(x.shape)} does not match weight "
                         f"{tuple(weight.shape)} ([N, K], K = x's last dimension, K >= 1)")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"fp8 linear: group_size must be a positive integer, got "
                         f"{group_size!r}")
    n, k = weight.shape
    groups = -(-k // group_size)
    if weight_scale.shape != (n, groups):
        raise ValueError(f"fp8 linear: weight_scale is {tuple(weight_scale.shape)}, expected "
                         f"{(n, groups)} for weight {(n, k)} and group_size {group_size}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"fp8 linear: bias is {tuple(bias.shape)}, expected {(n,)}")
    if x.numel() // k <= KERNEL_MAX_ROWS and supports(x, weight, weight_scale, group_size):
        return linear_kernel(x, weight, weight_scale, group_size, bias)
    return linear_tiled(x, weight, weight_scale, group_size, bias)


def linear_kernel(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                  group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear() by the C kernel (Fp8LinearKernel.__call__), whatever the row count, for
    tensors supports() takes."""
    return _kernel()(x, weight, weight_scale, group_size, bias)


def linear_tiled(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear() by F.linear on tiles of W's rows dequantised to x's dtype (rounded once from
    float32), at most TILE_BYTES of scratch at a time, each tile's product written to its
    columns of the output. Any layout and float dtypes; shapes as linear() checks them."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    b = None if bias is None else bias.to(x.dtype)
    # scratch per weight: the tile in x's dtype, after a float32 one where the C library
    # does not write x's dtype itself
    in_c = weight_fits(weight, weight_scale, group_size) and x.dtype in X_DTYPES \
        and available()
    through_float32 = x.dtype != torch.float32 and (not in_c or x.dtype == torch.float16)
    rows = max(1, TILE_BYTES // (k * (x.element_size() + 4 * through_float32)))
    if rows >= 64:
        rows -= rows % 64
    if rows >= n:
        out = F.linear(x2, dequantize(weight, weight_scale, group_size, x.dtype), b)
        return out.reshape(*x.shape[:-1], n)
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        w = dequantize(weight[n0:n1], weight_scale[n0:n1], group_size, x.dtype)
        out[:, n0:n1] = F.linear(x2, w, None if b is None else b[n0:n1])
    return out.reshape(*x.shape[:-1], n)


def dequantize(weight: torch.Tensor, weight_scale: torch.Tensor, group_size: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """dequant(weight) [rows, K] in dtype, rounded once from float32 (a new tensor; callers
    pass a tile of rows): by the C library where it takes the weight, else by torch."""
    if weight_fits(weight, weight_scale, group_size) and dtype in X_DTYPES and available():
        return _kernel().dequantize(weight, weight_scale, group_size, dtype)
    w = weight.to(torch.float32, copy=True)  # never the caller's tensor, scaled in place
    k = w.shape[1]
    full = k // group_size  # whole groups; a last partial one after them
    scale = weight_scale.to(torch.float32)
    if full:
        w[:, :full * group_size].unflatten(1, (full, group_size)).mul_(scale[:, :full, None])
    if full * group_size < k:
        w[:, full * group_size:].mul_(scale[:, full:])
    return w.to(dtype)
