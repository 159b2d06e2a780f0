"""The C shared-prefix attention kernel for CPUs (shared_prefix.c), built by build.py and
called through ctypes.

A cascade's shared part is every query row of a step against one short run of keys (the
cached prefix they all share), with no mask. torch's flash kernel takes it at a fraction of
the speed of the model's products; this kernel runs it as two register-blocked products
with the softmax between them, reading the queries in place: for bfloat16 on the CPU's
bfloat16 dot-product instructions (SmolLM2's heads on a 2-core Zen 4, 256 shared keys:
8.8 ms against flash's 18-20 ms for a 4096-token prefill step, 0.27 against 0.67 ms for
128 decodes). float32 runs anywhere; bfloat16 is used on CPUs with those instructions
(AVX512-BF16) and without AMX (elsewhere the kernel runs it on FMAs, when asked:
use_bf16). With AMX, torch's flash kernel runs its products on the
matrix units and wins: on a 2-core AMX Xeon the bench's SmolLM2 workload spent 0.64 s in
flash against 2.07 s in this kernel. Elsewhere, or where it cannot be built (see
build.py), supports() is false and the torch path runs. K and V gathered from an FP8 cache
are taken as they are (E4M3, with their scales).
"""
from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch

from .. import fp8
from . import build

SOURCE = Path(__file__).with_name("shared_prefix.c")
MAX_HEAD_DIM = 256


class SharedPrefixKernel:
    """shared_prefix.c's entry points, with the argument checks that keep it in bounds."""

    def __init__(self, path: Path):
        self.path = path
        lib = ctypes.CDLL(str(path))
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        argtypes = [p, i64, p, p, i64, i64, i64, i64, i64, ctypes.c_float, p, p, p,
                    ctypes.c_float]
        # whether bfloat16 runs on the AVX512-BF16 dot products (else on FMAs)
        self.bf16_instructions = bool(lib.shared_prefix_bf16_available())
        self._fns = {}  # by (query dtype, K/V dtype: None for the query's)
        for kv, names in (
                (None, {torch.float32: "shared_prefix_f32", torch.bfloat16: "shared_prefix_bf16"}),
                (fp8.FP8_DTYPE, {torch.float32: "shared_prefix_f32_fp8",
                                 torch.bfloat16: "shared_prefix_bf16_fp8"})):
            for dtype, fn in build.entry_points(lib, names, argtypes, ctypes.c_int).items():
                self._fns[dtype, kv] = fn
        # where the CPU has AMX, torch's flash kernel runs its bfloat16 products on the
        # matrix units and is left the work
        self.use_bf16 = self.bf16_instructions and not build.has_amx()
        self._scratch_words = lib.shared_prefix_scratch_words
        self._scratch_words.argtypes, self._scratch_words.restype = [i64, i64, i64, i64], i64
        # the keys laid out, reused across calls: one buffer per thread, since the call
        # releases the GIL (engines in two threads would otherwise share it)
        self._local = threading.local()

    def supports(self, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                 head_dim: int, kv_dtype: torch.dtype | None = None) -> bool:
        """Queries of dtype against K/V of kv_dtype (None: dtype) of this shape."""
        return (self._fn(dtype, kv_dtype) is not None
                and (dtype != torch.bfloat16 or self.use_bf16)
                and head_dim % 16 == 0
                and 0 < head_dim <= MAX_HEAD_DIM and num_heads % num_kv_heads == 0)

    def _fn(self, dtype: torch.dtype, kv_dtype: torch.dtype | None):
        return self._fns.get((dtype, None if kv_dtype in (None, dtype) else kv_dtype))

    def __call__(self, query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 k_scale: float = 1.0, v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of query [T, H, D] (rows may be strided) over every key of k, v
        [P, Hkv, D] (contiguous; of query's dtype, or FP8 read times k_scale and v_scale):
        (out [T, Hkv, G, D] in query's dtype, lse [T, Hkv, G] float32), G = H / Hkv; query
        head h * G + g reads KV head h."""
        num_tokens, num_heads, head_dim = query.shape
        num_keys, num_kv_heads = k.shape[:2]
        if not (self.supports(query.dtype, num_heads, num_kv_heads, head_dim, k.dtype)
                and query.device.type == k.device.type == v.device.type == "cpu"
                and k.dtype == v.dtype and num_keys > 0
                and k.shape == v.shape == (num_keys, num_kv_heads, head_dim)
                and k.is_contiguous() and v.is_contiguous()
                and query.stride(2) == 1 and query.stride(1) == head_dim):
            raise ValueError("cpu shared-prefix kernel: arguments out of contract")
        group = num_heads // num_kv_heads
        out = torch.empty(num_tokens, num_kv_heads, group, head_dim, dtype=query.dtype)
        lse = torch.empty(num_tokens, num_kv_heads, group, dtype=torch.float32)
        need = self._scratch_words(num_keys, num_kv_heads, head_dim,
                                   int(query.dtype == torch.bfloat16))
        scratch = getattr(self._local, "scratch", None)
        if scratch is None or scratch.numel() < need:
            scratch = self._local.scratch = torch.empty(need, dtype=torch.int32)
        if not fp8.is_fp8(k):
            k_scale = v_scale = 1.0
        rc = self._fn(query.dtype, k.dtype)(
            query.data_ptr(), query.stride(0), k.data_ptr(), v.data_ptr(), num_tokens,
            num_keys, num_kv_heads, group, head_dim, scale * k_scale, out.data_ptr(),
            lse.data_ptr(), scratch.data_ptr(), v_scale)
        if rc != 0:
            raise ValueError(f"cpu shared-prefix kernel rejected head_dim={head_dim}")
        return out, lse


def _kernel() -> SharedPrefixKernel | None:
    return build.load(SOURCE, SharedPrefixKernel)


def available() -> bool:
    """Whether the kernel is built here (on first use) and not switched off
    (BATCHINFER_CPU_KERNELS=0)."""
    return _kernel() is not None


def supports(query: torch.Tensor, num_kv_heads: int, kv_dtype: torch.dtype | None = None
             ) -> bool:
    """Whether the kernel takes query [T, H, D] against num_kv_heads KV heads of kv_dtype
    (None: the query's): available, on the CPU, of dtypes and a head shape it handles, each
    token's heads contiguous (the tokens may be strided)."""
    return (query.device.type == "cpu" and available()
            and query.stride(2) == 1 and query.stride(1) == query.shape[2]
            and _kernel().supports(query.dtype, query.shape[1], num_kv_heads, query.shape[2],
                                   kv_dtype))


def attention(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
              k_scale: float = 1.0, v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the shared prefix by the kernel (SharedPrefixKernel.__call__), for a
    query supports() takes."""
    return _kernel()(query, k, v, scale, k_scale, v_scale)
