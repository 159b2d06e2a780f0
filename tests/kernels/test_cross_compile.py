"""The C kernels on ARM servers (Graviton, Grace, Ampere): each source compiles with
Debian's aarch64 cross compiler at the flags a build there uses, without a warning, into
NEON vector code rather than a scalar fallback. The vector extensions' 16-lane vectors
become four 128-bit NEON registers each, as they become two 256-bit ones on AVX2."""
from __future__ import annotations

import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from apt_packages import ensure_installed
from batchinfer.kernels.cpu import build

CROSS_GCC = "aarch64-linux-gnu-gcc"
ARCH = "armv8.2-a"  # NEON with fp16 arithmetic: Graviton 2 and every later ARM server
# float arithmetic on NEON vectors of 4 floats (v0.4s), and on one float (s0)
VECTOR_OPS = re.compile(r"^\s+(fmla|fmls|fmul|fadd|fsub|fmax|fmin|fmaxnm|fminnm|fdiv|fneg|"
                        r"fabs|frint[a-z]|fcm[a-z]+|fcvt[a-z]*|scvtf|ucvtf)\s+v\d+\.4s", re.M)
SCALAR_OPS = re.compile(r"^\s+(fmadd|fmsub|fmul|fadd|fsub|fmax|fmin|fmaxnm|fminnm|fdiv|"
                        r"fneg|fabs)\s+s\d+", re.M)


@pytest.fixture(scope="module")
def cross_gcc() -> str:
    reason = ensure_installed("an aarch64 cross compiler", (CROSS_GCC,),
                              ("gcc-aarch64-linux-gnu", "libc6-dev-arm64-cross"),
                              "BATCHINFER_INSTALL_CROSS")
    if reason:
        pytest.skip(reason)
    return CROSS_GCC


def float_ops(compiler: str, source, arch: str, asm) -> tuple[int, int, str]:
    """(vector, scalar) float operations in source compiled for arch, and the compiler's
    messages."""
    flags = build.compile_flags(arch=arch, machine="aarch64")
    done = subprocess.run([compiler, *flags, "-Wall", "-Wextra", "-S", str(source),
                           "-o", str(asm)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    text = asm.read_text()
    return len(VECTOR_OPS.findall(text)), len(SCALAR_OPS.findall(text)), done.stderr


@pytest.fixture(scope="module")
def compiled(cross_gcc, tmp_path_factory) -> dict:
    """source -> float_ops, the sources compiled in parallel (the largest take seconds)."""
    out = tmp_path_factory.mktemp("aarch64")
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        found = pool.map(lambda s: float_ops(cross_gcc, s, ARCH, out / (s.name + ".s")),
                         build.SOURCES)
        return dict(zip(build.SOURCES, found))


@pytest.mark.parametrize("source", build.SOURCES, ids=lambda path: path.name)
def test_each_kernel_compiles_for_aarch64_into_neon_code(compiled, source):
    vector, scalar, messages = compiled[source]
    assert "warning" not in messages, messages[-2000:]
    # (the scalar ones are tails and per-row sums; AVX2's share of them is larger still)
    assert vector >= 2 * scalar and vector > 0, (vector, scalar)


def test_a_scalar_build_is_told_apart(cross_gcc, tmp_path):
    """Without NEON (+nosimd) the same vectors become scalar code, and the check says so."""
    source = next(s for s in build.SOURCES if s.name == "sample.c")
    vector, scalar, _ = float_ops(cross_gcc, source, ARCH + "+nosimd", tmp_path / "kernel.s")
    assert vector == 0 and scalar > 100, (vector, scalar)
