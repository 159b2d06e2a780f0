"""The C paged-decode kernel for CPUs (paged_decode_cpu.c): built once per machine, called
through ctypes.

The CPU attention path otherwise gathers every decoding sequence's K/V into a padded copy
per layer and runs torch's flash kernel on it; this kernel reads the blocks in place, which
on a memory-bound CPU roughly halves decode attention time. It is optional: without gcc,
when torch's OpenMP runtime is not libgomp, or with BATCHINFER_CPU_DECODE_KERNEL=0, load()
returns None and the torch path runs instead.

The shared library is cached under the cache root's kernels/ (batchinfer.paths; by default
~/.cache/batchinfer/kernels), keyed by the source, the compiler, its flags and the CPU, so
nodes of a cluster that share a home directory never load each other's builds.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from batchinfer.paths import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode_cpu.c")
ENV_SWITCH = "BATCHINFER_CPU_DECODE_KERNEL"
MAX_GROUP = 16          # query heads per KV head (paged_decode_cpu.c: MAX_GROUP)
MAX_ROWS = 32           # query rows per work item (MAX_ROWS)
MAX_HEAD_DIM = 256      # 16 * MAX_CHUNKS
# Query rows x 16-lane chunks one work item keeps in registers and L1 (q, accumulators).
ROW_CHUNK_BUDGET = 128


def _torch_openmp_runtime() -> str | None:
    """Path of the libgomp torch has loaded into this process (Linux), or None. Linking
    the kernel against that very file makes both share one thread pool: a second OpenMP
    runtime would keep its own threads spinning while torch's run."""
    if torch.__config__.parallel_info().find("OpenMP") < 0:
        return None
    try:
        with open("/proc/self/maps") as maps:
            found = {line.rstrip("\n").split(maxsplit=5)[-1] for line in maps}
    except OSError:
        return None
    found = sorted(p for p in found if "libgomp" in os.path.basename(p) and os.path.isfile(p))
    # another extension may have loaded a second copy: prefer torch's own (torch/lib, or
    # torch.libs beside it in manylinux wheels)
    torch_dir = os.path.dirname(os.path.dirname(torch.__file__))
    ours = [p for p in found if os.path.realpath(p).startswith(os.path.realpath(torch_dir))
            and "torch" in p]
    return (ours or found or [None])[0]


def _cpu_identity() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def _flags() -> list[str]:
    flags = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-std=gnu11"]
    if platform.machine() in ("x86_64", "AMD64"):
        # GCC otherwise splits 512-bit vector code into 256-bit halves on AVX-512 hosts
        flags.append("-mprefer-vector-width=512")
    return flags


def _compile(compiler: list[str], runtime: str, target: Path) -> None:
    """Compile to a temporary name beside target, then rename: concurrent builders (ranks,
    array tasks) never load a half-written library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, lib = Path(tmp) / "kernel.o", Path(tmp) / "kernel.so"
        # link with the runtime's file itself, not -fopenmp's default libgomp
        for cmd in ([*compiler, *_flags(), "-c", str(SOURCE), "-o", str(obj)],
                    [*compiler, "-shared", str(obj), runtime, "-o", str(lib)]):
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")
        os.replace(lib, target)


class CpuDecodeKernel:
    """paged_decode_cpu.c's entry points, with the argument checks that keep it in bounds."""

    def __init__(self, path: Path):
        self.path = path
        lib = ctypes.CDLL(str(path))
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fns = {}
        for dtype, name in ((torch.float32, "paged_decode_f32"),
                            (torch.bfloat16, "paged_decode_bf16")):
            fn = getattr(lib, name)
            fn.argtypes = [p, i64, p, p, p, i64, p, p, i64, i64, i64, i64, i64, ctypes.c_float,
                           p, p, i64]
            fn.restype = ctypes.c_int
            self._fns[dtype] = fn
        self._checked: tuple[torch.Tensor, ...] | None = None  # last ranges validated

    def _check_ranges(self, block_tables, lo, hi, n, num_blocks, block_size) -> None:
        """Every position read lies in the block table and every block id in the cache.
        The same tensors are passed for every layer of a step: checked once per step."""
        key = (block_tables, lo, hi)
        if self._checked is not None and all(a is b for a, b in zip(key, self._checked)):
            return
        if n and not (int(lo.min()) >= 0 and bool((hi >= lo).all())
                      and int(hi.max()) <= block_tables.shape[1] * block_size
                      and int(block_tables[:n].min()) >= 0
                      and int(block_tables[:n].max()) < num_blocks):
            raise ValueError("cpu decode kernel: key ranges or block ids outside the cache")
        self._checked = key

    def supports(self, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                 head_dim: int) -> bool:
        group = num_heads // num_kv_heads
        return (dtype in self._fns and head_dim % 16 == 0 and head_dim <= MAX_HEAD_DIM
                and 1 <= group <= MAX_GROUP)

    def __call__(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, scale: float,
                 out: torch.Tensor, lse: torch.Tensor | None) -> None:
        """Attention of query [n, H, D] (one token per sequence; rows may be strided) over
        positions [lo[i], hi[i]) of sequence i. Writes out [n, H, D] (contiguous) and, when
        given, lse [n, H] float32 (natural log-sum-exp of the scaled scores)."""
        n, num_heads, head_dim = query.shape
        num_blocks, block_size, num_kv_heads, cache_head_dim = k_cache.shape
        group = num_heads // num_kv_heads
        tensors = [query, k_cache, v_cache, block_tables, lo, hi, out, lse]
        if not (all(t.device.type == "cpu" for t in tensors if t is not None)
                and num_heads == num_kv_heads * group and cache_head_dim == head_dim
                and query.stride(2) == 1 and query.stride(1) == head_dim
                and k_cache.is_contiguous() and v_cache.is_contiguous()
                and v_cache.shape == k_cache.shape
                and k_cache.dtype == v_cache.dtype == query.dtype == out.dtype
                and out.is_contiguous() and out.shape == query.shape
                and block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
                and block_tables.shape[0] >= n
                and lo.dtype == hi.dtype == torch.int32 and lo.is_contiguous()
                and hi.is_contiguous() and lo.numel() == hi.numel() == n
                and (lse is None or (lse.dtype == torch.float32 and lse.is_contiguous()
                                     and lse.numel() == n * num_heads))):
            raise ValueError("cpu decode kernel: arguments out of contract")
        self._check_ranges(block_tables, lo, hi, n, num_blocks, block_size)
        nc = head_dim // 16
        # Whole rows of KV heads per work item when there are enough sequences to keep every
        # thread busy; otherwise one KV head per item for more parallelism.
        if n >= 4 * torch.get_num_threads():
            heads_per_item = max(1, min(num_kv_heads, ROW_CHUNK_BUDGET // (group * nc),
                                        MAX_ROWS // group))
        else:
            heads_per_item = 1
        rc = self._fns[query.dtype](
            query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            block_tables.data_ptr(), block_tables.stride(0), lo.data_ptr(), hi.data_ptr(),
            n, num_kv_heads, group, head_dim, block_size, scale, out.data_ptr(),
            lse.data_ptr() if lse is not None else None, heads_per_item)
        if rc != 0:
            raise ValueError(f"cpu decode kernel rejected group={group} head_dim={head_dim}")


_lock = threading.Lock()
_loaded: dict[str, CpuDecodeKernel | None] = {}


def load() -> CpuDecodeKernel | None:
    """The kernel, built on first use; None (with one log line saying why) when it cannot
    be built here or is switched off."""
    with _lock:
        if "kernel" not in _loaded:
            _loaded["kernel"] = _load()
        return _loaded["kernel"]


def _load() -> CpuDecodeKernel | None:
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    # GCC: clang's -fopenmp targets LLVM's runtime, not the libgomp torch loads
    compiler = shlex.split(os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
                           or "")
    runtime = _torch_openmp_runtime()
    if not compiler or runtime is None:
        log.warning("CPU decode kernel not used (%s); decode attention takes the slower torch "
                    "path", "no C compiler (gcc)" if not compiler
                    else "torch's OpenMP runtime (libgomp) not found")
        return None
    try:
        version = subprocess.run([*compiler, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
        if "clang" in version.lower():
            log.warning("CPU decode kernel not used: %s is clang, whose OpenMP code needs "
                        "LLVM's runtime, not torch's libgomp; set CC=gcc", compiler[0])
            return None
        key = hashlib.sha256("\0".join(
            [SOURCE.read_text(), *compiler, version, " ".join(_flags()), runtime,
             _cpu_identity()]).encode()).hexdigest()[:20]
        target = cache_root() / "kernels" / f"paged_decode_cpu-{key}.so"
        if not target.is_file():
            _compile(compiler, runtime, target)
        return CpuDecodeKernel(target)
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
        log.warning("CPU decode kernel could not be built (%s); decode attention takes the "
                    "torch path", e)
        return None
