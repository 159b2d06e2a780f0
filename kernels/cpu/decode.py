"""The C paged-decode kernel for CPUs (decode.c), built by build.py and called through
ctypes.

The CPU attention path otherwise gathers every decoding sequence's K/V into a padded copy
per layer and runs torch's flash kernel on it; this kernel reads the blocks in place, which
on a memory-bound CPU roughly halves decode attention time. Where it cannot be built (see
build.py), available() is false and the torch path runs instead. Caches are of the query's
type (float32, bfloat16) or FP8 (E4M3 with a K and a V scale, as kernels/fp8.py says).
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .. import fp8
from . import build

SOURCE = Path(__file__).with_name("decode.c")
MAX_GROUP = 16          # query heads per KV head (decode.c: MAX_GROUP)
MAX_HEAD_DIM = 256      # 16 * MAX_CHUNKS


class DecodeKernel:
    """decode.c's entry points, with the argument checks that keep it in bounds."""

    def __init__(self, path: Path):
        self.path = path
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib = ctypes.CDLL(str(path))
        argtypes = [p, i64, p, p, p, i64, p, p, i64, i64, i64, i64, i64, ctypes.c_float,
                    p, p, p, p, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float]
        self._fns = {}  # by (query dtype, cache dtype: None for the query's)
        for cache, names in (
                (None, {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}),
                (fp8.FP8_DTYPE, {torch.float32: "paged_decode_f32_fp8",
                                 torch.bfloat16: "paged_decode_bf16_fp8"})):
            for dtype, fn in build.entry_points(lib, names, argtypes, ctypes.c_int).items():
                self._fns[dtype, cache] = fn
        self._checked: tuple[torch.Tensor, ...] | None = None  # last ranges validated

    def _check_ranges(self, block_tables, lo, hi, n, num_blocks, block_size) -> None:
        """Every position read lies in the block table and every block id in the cache.
        The same tensors are passed for every layer of a step: checked once per step."""
        key = (block_tables, lo, hi, n, num_blocks, block_size)
        if self._checked is not None and all(a is b for a, b in zip(key[:3], self._checked)) \
                and key[3:] == self._checked[3:]:
            return  # (the plan's tensors are not modified in place between layers)
        if n and not (int(lo.min()) >= 0 and bool((hi >= lo).all())
                      and int(hi.max()) <= block_tables.shape[1] * block_size
                      and int(block_tables[:n].min()) >= 0
                      and int(block_tables[:n].max()) < num_blocks):
            raise ValueError("cpu decode kernel: key ranges or block ids outside the cache")
        self._checked = key

    def supports(self, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                 head_dim: int, cache_dtype: torch.dtype | None = None) -> bool:
        """Queries of dtype against a cache of cache_dtype (None: dtype) of this shape."""
        group = num_heads // num_kv_heads
        return (self._fn(dtype, cache_dtype) is not None and head_dim % 16 == 0
                and 0 < head_dim <= MAX_HEAD_DIM and 1 <= group <= MAX_GROUP)

    def _fn(self, dtype: torch.dtype, cache_dtype: torch.dtype | None):
        return self._fns.get((dtype, None if cache_dtype in (None, dtype) else cache_dtype))

    def __call__(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, scale: float,
                 out: torch.Tensor, lse: torch.Tensor | None,
                 init: tuple[torch.Tensor, torch.Tensor] | None = None,
                 k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        """Attention of query [n, H, D] (one token per sequence; rows may be strided) over
        positions [lo[i], hi[i]) of sequence i. Writes out [n, H, D] (contiguous) and, when
        given, lse [n, H] float32 (natural log-sum-exp of the scaled scores). init, when
        given, is (out [n, Hkv, G, D], lse [n, Hkv, G]) of the same queries over other keys
        (any strides but along head_dim), and the result is their merge: attention over
        both sets of keys. An FP8 cache's keys and values are read times k_scale and
        v_scale."""
        n, num_heads, head_dim = query.shape
        num_blocks, block_size, num_kv_heads, cache_head_dim = k_cache.shape
        group = num_heads // num_kv_heads
        tensors = [query, k_cache, v_cache, block_tables, lo, hi, out, lse]
        if not (all(t.device.type == "cpu" for t in tensors if t is not None)
                and num_heads == num_kv_heads * group and cache_head_dim == head_dim
                and query.stride(2) == 1 and query.stride(1) == head_dim
                and k_cache.is_contiguous() and v_cache.is_contiguous()
                and v_cache.shape == k_cache.shape
                and k_cache.dtype == v_cache.dtype and query.dtype == out.dtype
                and self._fn(query.dtype, k_cache.dtype) is not None
                and out.is_contiguous() and out.shape == query.shape
                and block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
                and block_tables.shape[0] >= n
                and lo.dtype == hi.dtype == torch.int32 and lo.is_contiguous()
                and hi.is_contiguous() and lo.numel() == hi.numel() == n
                and (lse is None or (lse.dtype == torch.float32 and lse.is_contiguous()
                                     and lse.numel() == n * num_heads))
                and (init is None or (init[0].dtype == query.dtype
                                      and init[0].shape == (n, num_kv_heads, group, head_dim)
                                      and init[0].stride(3) == 1
                                      and init[1].dtype == torch.float32
                                      and init[1].shape == (n, num_kv_heads, group)
                                      and all(t.device.type == "cpu" for t in init)))):
            raise ValueError("cpu decode kernel: arguments out of contract")
        self._check_ranges(block_tables, lo, hi, n, num_blocks, block_size)
        # All of a sequence's KV heads in one work item when there are enough sequences to
        # keep every thread busy; otherwise one KV head per item for more parallelism.
        heads_per_item = num_kv_heads if n >= 4 * torch.get_num_threads() else 1
        if not fp8.is_fp8(k_cache):
            k_scale = v_scale = 1.0
        rc = self._fn(query.dtype, k_cache.dtype)(
            query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            block_tables.data_ptr(), block_tables.stride(0), lo.data_ptr(), hi.data_ptr(),
            n, num_kv_heads, group, head_dim, block_size, scale * k_scale, out.data_ptr(),
            lse.data_ptr() if lse is not None else None,
            init[0].data_ptr() if init else None, init[1].data_ptr() if init else None,
            *(init[0].stride()[:3] if init else (0, 0, 0)),
            *(init[1].stride() if init else (0, 0, 0)), heads_per_item, v_scale)
        if rc != 0:
            raise ValueError(f"cpu decode kernel rejected group={group} head_dim={head_dim}")


def _kernel() -> DecodeKernel | None:
    return build.load(SOURCE, DecodeKernel)


def available() -> bool:
    """Whether the kernel is built here (on first use) and not switched off
    (BATCHINFER_CPU_KERNELS=0)."""
    return _kernel() is not None


def supports(query: torch.Tensor, num_kv_heads: int, cache_dtype: torch.dtype | None = None
             ) -> bool:
    """Whether the kernel takes query [T, H, D] against num_kv_heads KV heads of a cache of
    cache_dtype (None: the query's): available, on the CPU, of dtypes and a head shape it
    handles."""
    return (query.device.type == "cpu" and available()
            and _kernel().supports(query.dtype, query.shape[1], num_kv_heads, query.shape[2],
                                   cache_dtype))


def attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              block_tables: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, scale: float,
              out: torch.Tensor, lse: torch.Tensor | None,
              init: tuple[torch.Tensor, torch.Tensor] | None = None,
              k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Decode attention by the kernel (DecodeKernel.__call__), for a query supports() takes."""
    _kernel()(query, k_cache, v_cache, block_tables, lo, hi, scale, out, lse, init, k_scale,
              v_scale)
