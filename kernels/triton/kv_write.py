"""Store one step's new K/V into the paged cache through the slot mapping."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import fp8
from ._launch import check_inputs, next_power_of_2
from ._paged import float_to_fp8


@triton.jit
def _write_kv_kernel(
    key_ptr,           # [num_tokens, num_kv_heads, head_dim]
    value_ptr,         # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,       # [num_blocks, block_size, num_kv_heads, head_dim] (FP8: uint8 codes)
    v_cache_ptr,       # [num_blocks, block_size, num_kv_heads, head_dim] (FP8: uint8 codes)
    slot_mapping_ptr,  # [num_tokens] int64; a negative slot means "do not store"
    k_scale,           # FP8: the cache stores key / k_scale
    v_scale,           # FP8: the cache stores value / v_scale
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        k = tl.load(key_ptr + token * stride_kt + head * stride_kh + d * stride_kd, mask=d_ok)
        v = tl.load(value_ptr + token * stride_vt + head * stride_vh + d * stride_vd, mask=d_ok)
        if FP8:
            k = float_to_fp8(k.to(tl.float32), k_scale)
            v = float_to_fp8(v.to(tl.float32), v_scale)
        k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + head * stride_kch
        v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + head * stride_vch
        tl.store(k_dst + d * stride_kcd, k.to(k_cache_ptr.dtype.element_ty), mask=d_ok)
        tl.store(v_dst + d * stride_vcd, v.to(v_cache_ptr.dtype.element_ty), mask=d_ok)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
             v_scale: float = 1.0) -> None:
    """Copy key/value [num_tokens, num_kv_heads, head_dim] into their cache slots.

    Grid: one program per (token, kv head); each moves one head_dim row of K and of V,
    cast to the cache dtype, or for an FP8 cache stored as E4M3 codes of key / k_scale and
    value / v_scale (kernels/fp8.py). Slots are int64 so block * stride never wraps.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    check_inputs(_write_kv_kernel, head_dim, key, value, caches=(k_cache, v_cache))
    if num_tokens == 0:
        return
    to_fp8 = fp8.is_fp8(k_cache)
    if to_fp8:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    _write_kv_kernel[(num_tokens, num_kv_heads)](
        key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        HEAD_DIM=head_dim, D_PAD=next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1],
        FP8=to_fp8,
    )
