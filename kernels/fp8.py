"""The FP8 KV cache's number format, in torch: E4M3 (torch.float8_e4m3fn) with one float32
scale per layer for K and one for V, as vLLM keeps it.

    stored = fp8(clamp(k / k_scale, -448, 448))    # round to nearest even
    read   = float(stored) * k_scale

The kernels that write or read such a cache (cpu/, triton/) do the same arithmetic inside;
these are the torch paths and the tests' reference.
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite E4M3 value


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_DTYPE


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale in float32, clamped to E4M3's range, rounded to E4M3 (nearest even)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """E4M3 values times scale, in dtype. With scale 1 a float16 or bfloat16 result is
    exact (both hold every E4M3 value) and takes one conversion."""
    if scale == 1.0:
        return x.to(dtype)
    return (x.float() * scale).to(dtype)

