"""The C prefill-attention kernel for CPUs (prefill.c), built by build.py and called
through ctypes.

torch's flash kernel runs each prompt chunk as its own small problem, where its per-block
set-up outweighs the arithmetic (about 2 ns per query-key pair at 100-token chunks, against
0.35 ns on one long sequence); this kernel runs every chunk of a step in one call, reading
keys in place from the paged cache, and can start from a cascade's shared-prefix result.
Long bfloat16 chunks run on the CPU's bfloat16 dot products on AMD CPUs that have them
(see DOT_MIN_KEY_ELEMENTS); on CPUs with AMX they are left to torch's flash kernel (see
FLASH_MIN_KEYS_X_DIM2). Where it cannot be built (see build.py), available() is false
and the torch path runs. Caches are of the query's type (float32, bfloat16) or FP8 (E4M3
with a K and a V scale, as kernels/fp8.py says).
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .. import fp8
from . import build

SOURCE = Path(__file__).with_name("prefill.c")
MAX_GROUP = 16          # query heads per KV head (prefill.c: MAX_GROUP)
MAX_HEAD_DIM = 256
# bfloat16 chunks with (keys x head_dim) from this on take the AVX512-BF16 micro-kernel
# where the CPU has it (prefill.c: DOT_MIN_KEY_ELEMENTS)
DOT_MIN_KEY_ELEMENTS = 16384
# On CPUs with AMX, bfloat16 chunks with keys x head_dim^2 from this on are left to torch's
# flash kernel. Measured on a 2-core AMX Xeon VM, about 4096 tokens in equal chunks of
# their own tokens, keys gathered, kernel / flash time: head_dim 32: 0.73 (512 keys), 1.06
# (1024), 1.32 (2048); head_dim 64: 0.63 (128), 1.05 (256), 1.19 (512), 2.11 (2048);
# head_dim 128: 0.83 (64), 1.11 (128), 1.51 (256), 2.93 (2048). Flash wins past about
# keys x head_dim^2 = 2^20; this bound takes only the clear wins.
FLASH_MIN_KEYS_X_DIM2 = 1 << 21
# ... and with at least this many query tokens: a chunk after earlier context of its own (a
# long prompt's later chunk) runs as two flash calls, that context unmasked and the chunk's
# own tokens causally, merged by log-sum-exp; with a handful of queries the kernel is the
# faster (head_dim 32, 16 queries after 4096 keys: 0.34 against 0.41 ms)
FLASH_MIN_QUERIES = 32


class PrefillKernel:
    """prefill.c's entry points, with the argument checks that keep it in bounds."""

    def __init__(self, path: Path):
        self.path = path
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib = ctypes.CDLL(str(path))
        # whether long bfloat16 chunks run on AVX512-BF16's dot products: on AMD's CPUs,
        # where they issue twice the multiply-adds of float32 FMAs; on Intel's they were
        # no faster (see the C source)
        self.dot_instructions = bool(lib.prefill_bf16_dot_available())
        self.bf16_dot = self.dot_instructions and "AuthenticAMD" in build.cpu_identity()
        # On CPUs with AMX, torch's flash kernel runs a long bfloat16 chunk's products on the
        # matrix units and beats both forms here; the caller leaves it the chunks with
        # keys x head_dim^2 at least this (FLASH_MIN_KEYS_X_DIM2), None elsewhere.
        self.flash_min_keys_x_dim2 = FLASH_MIN_KEYS_X_DIM2 if build.has_amx() else None
        argtypes = [p, i64, p, p, p, i64, i64, p, i64, i64, i64, i64, ctypes.c_float,
                    p, p, p, p, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float]
        self._fns = {}  # by (query dtype, cache dtype: None for the query's)
        for cache, names in (
                (None, {torch.float32: "prefill_attn_f32", torch.bfloat16: "prefill_attn_bf16"}),
                (fp8.FP8_DTYPE, {torch.float32: "prefill_attn_f32_fp8",
                                 torch.bfloat16: "prefill_attn_bf16_fp8"})):
            for dtype, fn in build.entry_points(lib, names, argtypes, ctypes.c_int).items():
                self._fns[dtype, cache] = fn
        self._checked: tuple[torch.Tensor, torch.Tensor, int, int, int] | None = None

    def supports(self, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                 head_dim: int, cache_dtype: torch.dtype | None = None) -> bool:
        """Queries of dtype against a cache of cache_dtype (None: dtype) of this shape."""
        group = num_heads // num_kv_heads
        return (self._fn(dtype, cache_dtype) is not None and head_dim % 16 == 0
                and 0 < head_dim <= MAX_HEAD_DIM and 1 <= group <= MAX_GROUP
                and num_heads == group * num_kv_heads)

    def _fn(self, dtype: torch.dtype, cache_dtype: torch.dtype | None):
        return self._fns.get((dtype, None if cache_dtype in (None, dtype) else cache_dtype))

    def _check_chunks(self, chunks: torch.Tensor, block_tables: torch.Tensor, num_tokens: int,
                      num_blocks: int, block_size: int) -> None:
        """Every chunk's tokens lie in the batch and every key it reads in its block table
        and the cache. The same chunks serve every layer of a step: checked once per step."""
        key = (chunks, block_tables, num_tokens, num_blocks, block_size)
        if self._checked is not None and self._checked[0] is chunks \
                and self._checked[1] is block_tables and self._checked[2:] == key[2:]:
            return  # (the plan's tensors are not modified in place between layers)
        if chunks.numel():
            s, q0, q1, lo, hi = chunks.long().unbind(1)

            def blocks_in_cache() -> bool:  # of the blocks each chunk's context spans
                rows = block_tables[s]
                used = torch.arange(block_tables.shape[1])[None, :] * block_size < hi[:, None]
                return bool(((rows >= 0) & (rows < num_blocks) | ~used).all())

            # each token sees at least one key (its own); no two chunks write the same rows
            order = torch.argsort(q0)
            if not (int(s.min()) >= 0 and int(s.max()) < block_tables.shape[0]
                    and bool((q0[order][1:] >= q1[order][:-1]).all())
                    and int(q0.min()) >= 0 and bool((q1 > q0).all())
                    and int(q1.max()) <= num_tokens and int(lo.min()) >= 0
                    and bool((hi - (q1 - q0) >= lo).all())
                    and int(hi.max()) <= block_tables.shape[1] * block_size
                    and blocks_in_cache()):
                raise ValueError("cpu prefill kernel: chunks outside the batch or the cache")
        self._checked = key

    def __call__(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, chunks: torch.Tensor, scale: float,
                 out: torch.Tensor, lse: torch.Tensor | None = None,
                 init: tuple[torch.Tensor, torch.Tensor] | None = None,
                 k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        """Causal attention of query [T, H, D] (rows may be strided) for each chunk
        (s, q0, q1, lo, hi) of chunks [C, 5] int32: tokens [q0, q1) are the last positions
        of sequence s, whose context ends at hi, and see key positions [lo, ...) causally.
        Writes out [T, H, D] (contiguous) for the chunks' tokens and, when given, lse [T, H]
        float32. init, when given, is (out [T, Hkv, G, D], lse [T, Hkv, G]) of the same
        queries over other keys (any strides but along head_dim), and the result is their
        merge; a row with init lse -inf starts from nothing. An FP8 cache's keys and values
        are read times k_scale and v_scale."""
        num_tokens, num_heads, head_dim = query.shape
        num_blocks, block_size, num_kv_heads, cache_head_dim = k_cache.shape
        group = num_heads // num_kv_heads
        tensors = [query, k_cache, v_cache, block_tables, chunks, out, lse]
        if init is not None:
            io, il = init
            init_ok = (io.dtype == query.dtype and il.dtype == torch.float32
                       and io.shape == (num_tokens, num_kv_heads, group, head_dim)
                       and il.shape == (num_tokens, num_kv_heads, group)
                       and io.stride(3) == 1
                       and io.device.type == il.device.type == "cpu")
        else:
            init_ok = True
        if not (self.supports(query.dtype, num_heads, num_kv_heads, head_dim, k_cache.dtype)
                and init_ok
                and all(t.device.type == "cpu" for t in tensors if t is not None)
                and cache_head_dim == head_dim
                and query.stride(2) == 1 and query.stride(1) == head_dim
                and k_cache.is_contiguous() and v_cache.is_contiguous()
                and v_cache.shape == k_cache.shape
                and k_cache.dtype == v_cache.dtype and query.dtype == out.dtype
                and out.is_contiguous() and out.shape == query.shape
                and block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
                and chunks.dtype == torch.int32 and chunks.is_contiguous()
                and chunks.dim() == 2 and chunks.shape[1] == 5
                and (lse is None or (lse.dtype == torch.float32 and lse.is_contiguous()
                                     and lse.numel() == num_tokens * num_heads))):
            raise ValueError("cpu prefill kernel: arguments out of contract")
        self._check_chunks(chunks, block_tables, num_tokens, num_blocks, block_size)
        if not fp8.is_fp8(k_cache):
            k_scale = v_scale = 1.0
        rc = self._fn(query.dtype, k_cache.dtype)(
            query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            block_tables.data_ptr(), block_tables.stride(0), block_size, chunks.data_ptr(),
            chunks.shape[0], num_kv_heads, group, head_dim, scale * k_scale, out.data_ptr(),
            lse.data_ptr() if lse is not None else None,
            init[0].data_ptr() if init else None, init[1].data_ptr() if init else None,
            *(init[0].stride()[:3] if init else (0, 0, 0)),
            *(init[1].stride() if init else (0, 0, 0)), int(self.bf16_dot), v_scale)
        if rc != 0:
            raise ValueError(f"cpu prefill kernel rejected group={group} head_dim={head_dim}"
                             if rc == 1 else "cpu prefill kernel: out of memory")


def _kernel() -> PrefillKernel | None:
    return build.load(SOURCE, PrefillKernel)


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


def flash_min_keys_x_dim2() -> int | None:
    """On CPUs with AMX: bfloat16 chunks with keys x head_dim^2 at least this are left to
    torch's flash kernel (FLASH_MIN_KEYS_X_DIM2); None elsewhere."""
    kernel = _kernel()
    return kernel.flash_min_keys_x_dim2 if kernel is not None else None


def attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              block_tables: torch.Tensor, chunks: torch.Tensor, scale: float,
              out: torch.Tensor, lse: torch.Tensor | None = None,
              init: tuple[torch.Tensor, torch.Tensor] | None = None,
              k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Prefill attention by the kernel (PrefillKernel.__call__), for a query supports()
    takes."""
    _kernel()(query, k_cache, v_cache, block_tables, chunks, scale, out, lse, init, k_scale,
              v_scale)
