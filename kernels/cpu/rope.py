"""Rotary embedding plus KV-cache write in one C pass for CPUs (rope.c), built by build.py
and called through ctypes.

torch rotates q and k in about five passes and copies k and v into the cache in two more;
this does it all in one, with torch's rounding (the same bits). It applies to float32 and
bfloat16 tensors on the CPU whose head_dim is a multiple of 32, with a cache of their type
or an FP8 (E4M3) one (k / k_scale and v / v_scale stored as kernels/fp8.py says, bit for
bit); for anything else, or where the library cannot be built, supports() is false and the
model keeps to torch.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .. import fp8
from . import build

SOURCE = Path(__file__).with_name("rope.c")


class RopeKernel:
    def __init__(self, path: Path):
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib = ctypes.CDLL(str(path))
        self._fns = build.entry_points(
            lib,
            {torch.float32: "rope_write_f32", torch.bfloat16: "rope_write_bf16"},
            [p, i64, p, i64, p, p, p, p, p, p, i64, i64, i64, i64], None)
        self._fp8_fns = build.entry_points(
            lib, {torch.float32: "rope_write_f32_fp8", torch.bfloat16: "rope_write_bf16_fp8"},
            [p, i64, p, i64, p, p, p, p, p, p, i64, i64, i64, i64, ctypes.c_float,
             ctypes.c_float], None)
        self._checked: tuple[torch.Tensor, int] | None = None  # slot mapping last validated

    def supports(self, qk: torch.Tensor, cache_dtype: torch.dtype | None = None) -> bool:
        """qk [tokens, heads, head_dim] of a type and head size the C code takes, with a
        cache of cache_dtype (None: qk's)."""
        return (qk.device.type == "cpu" and qk.dtype in self._fns and qk.dim() == 3
                and qk.shape[2] % 32 == 0 and cache_dtype in (None, qk.dtype, fp8.FP8_DTYPE))

    def _check_slots(self, slots: torch.Tensor, num_slots: int) -> None:
        """Every slot lies in the cache or is -1 (nothing stored); the same mapping serves
        every layer of a step."""
        if self._checked is not None and self._checked[0] is slots \
                and self._checked[1] == num_slots:
            return
        if slots.numel() and not (int(slots.min()) >= -1 and int(slots.max()) < num_slots):
            raise ValueError("cpu rope: slot mapping outside the cache")
        self._checked = (slots, num_slots)

    def __call__(self, qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        """Rotate qk [T, H + Hkv, D] by cos/sin [T, 1, D] (or [T, D]); write k (rotated) and
        v [T, Hkv, D] to cache slots[t] (none where slots[t] < 0); return q [T, H, D],
        rotated, contiguous. An FP8 cache stores k / k_scale and v / v_scale in E4M3."""
        num_tokens, heads, head_dim = qk.shape
        num_kv_heads = k_cache.shape[2]
        num_heads = heads - num_kv_heads
        dtype = qk.dtype
        to_fp8 = fp8.is_fp8(k_cache)
        if not (self.supports(qk, k_cache.dtype) and num_heads > 0
                and all(t.device.type == "cpu" and t.dtype == dtype for t in (v, cos, sin))
                and k_cache.device.type == v_cache.device.type == "cpu"
                and k_cache.dtype == v_cache.dtype
                and qk.stride(2) == 1 and qk.stride(1) == head_dim
                and v.shape == (num_tokens, num_kv_heads, head_dim)
                and v.stride(2) == 1 and v.stride(1) == head_dim
                and cos.is_contiguous() and sin.is_contiguous()
                and cos.numel() == sin.numel() == num_tokens * head_dim
                and cos.shape[-1] == head_dim and cos.shape[0] == num_tokens
                and k_cache.is_contiguous() and v_cache.is_contiguous()
                and k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim
                and slots.dtype == torch.int64 and slots.is_contiguous()
                and slots.numel() == num_tokens and slots.device.type == "cpu"):
            raise ValueError("cpu rope: arguments out of contract")
        self._check_slots(slots, k_cache.shape[0] * k_cache.shape[1])
        q = torch.empty(num_tokens, num_heads, head_dim, dtype=dtype)
        args = (qk.data_ptr(), qk.stride(0), v.data_ptr(), v.stride(0), cos.data_ptr(),
                sin.data_ptr(), slots.data_ptr(), q.data_ptr(), k_cache.data_ptr(),
                v_cache.data_ptr(), num_tokens, num_heads, num_kv_heads, head_dim)
        if to_fp8:
            self._fp8_fns[dtype](*args, k_scale, v_scale)
        else:
            self._fns[dtype](*args)
        return q


def _kernel() -> RopeKernel | None:
    return build.load(SOURCE, RopeKernel)


def available() -> bool:
    """Whether the kernel is built here (on first use) and not switched off
    (BATCHINFER_CPU_KERNELS=0)."""
    return _kernel() is not None


def supports(qk: torch.Tensor, cache_dtype: torch.dtype | None = None) -> bool:
    """Whether the kernel takes qk [tokens, heads, head_dim] with a cache of cache_dtype
    (None: qk's): available, on the CPU, float32 or bfloat16, head_dim a multiple of 32,
    the cache of qk's type or FP8."""
    return qk.device.type == "cpu" and available() and _kernel().supports(qk, cache_dtype)


def rotate_and_write(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """q and k rotated, k and v written to the cache, q returned (RopeKernel.__call__),
    for a qk supports() takes."""
    return _kernel()(qk, v, cos, sin, slots, k_cache, v_cache, k_scale, v_scale)
