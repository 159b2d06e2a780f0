"""FP8 (E4M3) weights as the linear layers hold them, and their products.

A quantized layer keeps `weight` in float8_e4m3fn, [out, in], and `weight_scale` in float32,
[out, ceil(in / group_size)]: one scale per output row and group of group_size input
columns (group_size = in for per-tensor and per-channel scales, the block's width for block
scales). Every checkpoint form is brought to this one layout as it loads: a per-tensor
scale is repeated over its part's rows, a block scale over its block's rows (the last block
may be partial). The FP8 bytes are never rewritten, so a layer's product uses the
checkpoint's values exactly, and a fused layer (q, k and v; gate and up) keeps each part's
own scales. Tensor parallelism cuts rows (and, by whole groups, columns) of both together.
"""
from __future__ import annotations

import torch

from batchinfer.kernels.cpu import fp8_linear

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
_MIN_SCALE = 1e-12


def num_groups(in_features: int, group_size: int) -> int:
    return -(-in_features // group_size)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, group_size: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight the FP8 bytes and scales stand for, [out, in] in dtype."""
    cols = weight.shape[1]
    expanded = scale.repeat_interleave(group_size, dim=1)[:, :cols]
    return (weight.to(torch.float32) * expanded).to(dtype)


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, float32 scale [out, 1]): each row scaled so its largest magnitude is 448
    (online quantization, one scale per output channel)."""
    w = weight.to(torch.float32)
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=_MIN_SCALE)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def rows_from_checkpoint(scale: torch.Tensor, rows: int, block: tuple[int, int] | None,
                         groups: int) -> torch.Tensor:
    """A checkpoint's weight scale for a weight of `rows` rows, as one float32 row of
    `groups` scales per weight row: per tensor ([1] or []), per row ([rows, 1] or [rows]),
    or per block ([ceil(rows / block rows), groups])."""
    s = scale.to(torch.float32)
    if block is None:
        if s.numel() == 1:
            return s.reshape(1, 1).expand(rows, groups).contiguous()
        if s.numel() == rows and groups == 1:
            return s.reshape(rows, 1).contiguous()
        expected = f"[1] or [{rows}, 1]"
    else:
        block_rows = num_groups(rows, block[0])
        if s.dim() == 2 and tuple(s.shape) == (block_rows, groups):
            return s.repeat_interleave(block[0], dim=0)[:rows].contiguous()
        expected = f"[{block_rows}, {groups}] ({block[0]}x{block[1]} blocks)"
    raise ValueError(f"has shape {list(scale.shape)}, expected {expected}")


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group_size: int,
           bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None,
           scale_ub: torch.Tensor | None = None) -> torch.Tensor:
    """x dequantize(weight)^T + bias, in x's dtype: FP8 products on GPUs that have them,
    else the weight is widened inside the product (no full-precision copy is kept)."""
    if x.is_cuda:
        from batchinfer.kernels.triton import fp8_matmul  # (Triton: GPU installs only)
        return fp8_matmul.linear(x, weight, scale, group_size, input_scale=input_scale,
                                 scale_ub=scale_ub, bias=bias)
    return fp8_linear.linear(x, weight, scale, group_size, bias=bias)
