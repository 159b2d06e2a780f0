"""Building the C kernels for CPUs (kernels/cpu/*.c).

Each source is compiled with GCC at -O3 -march=native (or $BATCHINFER_CPU_ARCH) with
OpenMP and linked to the libgomp torch itself loaded, so the kernels run on torch's
threads: a second OpenMP runtime would keep its own threads spinning while torch's run.
The library is cached under the cache root's kernels/ (batchinfer.paths; by default
~/.cache/batchinfer/kernels), keyed by the sources, the compiler, its flags and the CPU,
so nodes of a cluster that share a home directory never load each other's builds;
concurrent builders never see a half-written one. A read-only cache root (a shared home on
a cluster) sends the build to a per-user directory under the system's temp dir instead.

An engine on a CPU builds every kernel not built yet at its start, all at once and while
its weights load, with a line saying so (build_all); `batchinfer build-kernels` does the
same ahead of a job. A kernel first used otherwise is built then (build).

Everything here is optional: without gcc, when torch's OpenMP runtime is not libgomp, or
with BATCHINFER_CPU_KERNELS=0, build() returns None (with one warning) and the callers keep
to plain torch.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import torch

from batchinfer.paths import cache_root

log = logging.getLogger(__name__)

ENV_SWITCH = "BATCHINFER_CPU_KERNELS"
ARCH_ENV = "BATCHINFER_CPU_ARCH"
T = TypeVar("T")
HERE = Path(__file__).parent

COMPILE_TIMEOUT_S = 600.0   # a compile past it is given up (a slow or busy machine)
SOURCES = sorted(HERE.glob("*.c"))

_lock = threading.Lock()
_source_locks: dict[Path, threading.Lock] = {}
_built: dict[Path, Path | None] = {}      # source -> its library, or None
_loaded: dict[Path, object] = {}          # source -> what load() made of its library


def switched_off() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off")


def torch_openmp_runtime() -> str | None:
    """Path of the libgomp torch has loaded into this process (Linux), or None."""
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


def cpu_identity() -> str:
    """The CPU's vendor, model name and feature flags (/proc/cpuinfo's lines; the processor
    name where that cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f
                     if ln.startswith(("vendor_id", "model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def vector_isa(identity: str | None = None) -> str:
    """The widest vector instructions the CPU has, as benchmark figures name them:
    "AVX-512 BF16 AMX", "AVX-512 BF16", "AVX-512", "AVX2 FMA", "SVE BF16", "NEON", ...
    (from /proc/cpuinfo's flags or Features line)."""
    found = set()
    for line in (identity if identity is not None else cpu_identity()).splitlines():
        if line.startswith(("flags", "Features")):
            found.update(line.split(":", 1)[-1].split())
    if "avx512f" in found:
        parts = ["AVX-512"] + ["BF16"] * ("avx512_bf16" in found) + ["AMX"] * ("amx_bf16" in found)
    elif "avx2" in found:
        parts = ["AVX2"] + ["FMA"] * ("fma" in found)
    elif "sve" in found or "asimd" in found:
        parts = ["SVE" if "sve" in found else "NEON"] + ["BF16"] * ("bf16" in found)
    else:
        parts = [platform.machine() or "unknown"]
    return " ".join(parts)


def has_amx() -> bool:
    """Whether the CPU has AMX's bfloat16 matrix units (Linux's amx_bf16 flag), which
    torch's oneDNN products and CPU flash kernel use."""
    return any(line.startswith("flags") and "amx_bf16" in line.split()
               for line in cpu_identity().splitlines())


def target_arch() -> str:
    """GCC's -march for the kernels: $BATCHINFER_CPU_ARCH (x86-64-v3 is AVX2 + FMA,
    x86-64-v4 AVX-512), else native. An AVX2 build runs and is tested on an AVX-512 host."""
    arch = os.environ.get(ARCH_ENV, "").strip() or "native"
    if not re.fullmatch(r"[A-Za-z0-9_.+-]+", arch):
        raise ValueError(f"${ARCH_ENV} {arch!r} is not a -march value (native, x86-64-v3, ...)")
    return arch


def compile_flags(arch: str | None = None, machine: str | None = None) -> list[str]:
    """GCC's flags for a kernel source, for -march `arch` (target_arch()) on a `machine`
    (this one's, platform.machine())."""
    flags = ["-O3", f"-march={arch or target_arch()}", "-fopenmp", "-fPIC", "-std=gnu11",
             f"-I{HERE}"]
    if (machine or platform.machine()) in ("x86_64", "AMD64"):
        # GCC otherwise splits 512-bit vector code into 256-bit halves on AVX-512 hosts
        flags.append("-mprefer-vector-width=512")
    return flags


def _compile(compiler: list[str], source: Path, runtime: str, target: Path) -> None:
    """Compile to a temporary name beside target, then rename."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, lib = Path(tmp) / "kernel.o", Path(tmp) / "kernel.so"
        # link with the runtime's file itself, not -fopenmp's default libgomp
        for cmd in ([*compiler, *compile_flags(), "-c", str(source), "-o", str(obj)],
                    [*compiler, "-shared", str(obj), runtime, "-o", str(lib)]):
            try:
                done = subprocess.run(cmd, capture_output=True, text=True,
                                      timeout=COMPILE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"{cmd[0]} took over {COMPILE_TIMEOUT_S:.0f} s compiling "
                                   f"{source.name} (a busy machine?)") from None
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")
        os.replace(lib, target)


def entry_points(lib: ctypes.CDLL, names: dict[torch.dtype, str], argtypes: list,
                 restype) -> dict[torch.dtype, Callable]:
    """The library's functions named per element type, with their C signature set."""
    fns = {}
    for dtype, name in names.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
        fns[dtype] = fn
    return fns


def build(source: Path) -> Path | None:
    """The shared library built from source (once per process, cached across runs), or
    None when C kernels cannot be built here or are switched off. Sources build in
    parallel; one source builds once."""
    if source in _built:
        return _built[source]
    with _lock:
        lock = _source_locks.setdefault(source, threading.Lock())
    with lock:
        if source not in _built:
            _built[source] = None if switched_off() else _build(source)
        return _built[source]


def unbuilt(sources: list[Path] | None = None) -> list[Path]:
    """The sources (by default every kernel) whose library is not built for this CPU and
    compiler yet: what a first run compiles."""
    if switched_off() or _toolchain() is None:
        return []
    return [src for src in sources or SOURCES
            if src not in _built and not any(t.is_file() for t in _targets(src))]


def build_all(say: Callable[[str], None] | None = None,
              sources: list[Path] | None = None) -> dict[Path, Path | None]:
    """Build every kernel not built yet, all at once (each a compiler process), saying so
    before and after when there is anything to build: a first run on a machine takes
    minutes. Returns each source's library (None where it could not be built, with a
    warning naming why)."""
    sources = list(sources or SOURCES)
    todo = unbuilt(sources)
    start = time.monotonic()
    if todo and say is not None:
        say(f"building the CPU kernels for this CPU, once ({len(todo)} of {len(sources)} "
            f"sources, -march={target_arch()}, into {cache_root() / 'kernels'}) ...")
    with ThreadPoolExecutor(max_workers=max(1, min(len(sources), os.cpu_count() or 1))) as pool:
        built = dict(zip(sources, pool.map(build, sources)))
    if todo and say is not None:
        failed = [src.name for src in todo if built[src] is None]
        say(f"CPU kernels built in {time.monotonic() - start:.0f} s" + (
            f"; {', '.join(failed)} failed (see the warnings): the slower torch path runs "
            f"for them; `batchinfer build-kernels` tries again" if failed else ""))
    return built


def start_build_all(say: Callable[[str], None] | None = None) -> threading.Thread | None:
    """build_all on a thread (to overlap with loading the weights); None when every kernel
    is built already or none can be. join() the thread before the kernels are used."""
    if not unbuilt():
        return None
    thread = threading.Thread(target=build_all, args=(say,), name="batchinfer-cpu-kernels",
                              daemon=True)
    thread.start()
    return thread


def load(source: Path, wrap: Callable[[Path], T]) -> T | None:
    """wrap(library built from source), made once per process; None when the library cannot
    be built or loaded here (with one warning), or C kernels are switched off."""
    if source in _loaded:  # the per-call path of the model's layers: no lock, no build
        return _loaded[source]
    path = build(source)
    with _lock:
        if source not in _loaded:
            try:
                _loaded[source] = wrap(path) if path is not None else None
            except (OSError, AttributeError) as e:  # unloadable, or missing entry points
                log.warning("CPU kernel %s could not be loaded (%s); the torch path runs "
                            "instead", source.name, e)
                _loaded[source] = None
        return _loaded[source]


def _toolchain() -> tuple[list[str], str, str] | None:
    """(compiler command, its --version text, torch's libgomp), or None with one warning
    when C kernels cannot be built here."""
    return _toolchain_for(os.environ.get("CC"))


@functools.cache
def _toolchain_for(cc: str | None) -> tuple[list[str], str, str] | None:
    # GCC: clang's -fopenmp targets LLVM's runtime, not the libgomp torch loads
    compiler = shlex.split(cc or shutil.which("gcc") or shutil.which("cc") or "")
    runtime = torch_openmp_runtime()
    if not compiler or runtime is None:
        log.warning("CPU kernels not used (%s); the slower torch path runs instead",
                    "no C compiler (gcc)" if not compiler
                    else "torch's OpenMP runtime (libgomp) not found")
        return None
    try:
        version = subprocess.run([*compiler, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("CPU kernels not used (%s --version failed: %s); the slower torch path "
                    "runs instead", compiler[0], e)
        return None
    if "clang" in version.lower():
        log.warning("CPU kernels not used: %s is clang, whose OpenMP code needs LLVM's "
                    "runtime, not torch's libgomp; set CC=gcc", compiler[0])
        return None
    return compiler, version, runtime


def _targets(source: Path) -> tuple[Path, Path]:
    """Where source's library is cached: under the cache root, else (a read-only cache
    root) in a per-user folder of the temp dir."""
    compiler, version, runtime = _toolchain()
    headers = sorted(HERE.glob("*.h"))
    key = hashlib.sha256("\0".join(
        [source.read_text(), *(h.read_text() for h in headers), *compiler, version,
         " ".join(compile_flags()), runtime, cpu_identity()]).encode()).hexdigest()[:20]
    name = f"{source.stem}-{key}.so"
    return (cache_root() / "kernels" / name,
            Path(tempfile.gettempdir()) / f"batchinfer-kernels-{os.getuid()}" / name)


def _build(source: Path) -> Path | None:
    toolchain = _toolchain()
    if toolchain is None:
        return None
    compiler, _, runtime = toolchain
    try:
        target, fallback = _targets(source)
        if not target.is_file():
            try:
                _compile(compiler, source, runtime, target)
            except PermissionError:  # a read-only cache (a shared home on a cluster)
                target = fallback
                if not target.is_file():
                    _compile(compiler, source, runtime, target)
        return target
    except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as e:
        log.warning("CPU kernel %s could not be built (%s); the torch path runs instead",
                    source.name, e)
        return None
