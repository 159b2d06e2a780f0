"""The kernel benchmark: without CUDA it says so and exits 0; its CPU FP8 linear case runs
anywhere (here on a tiny shape)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from batchinfer.bench.cli import bench
from batchinfer.bench.kernels import (NO_CUDA_MESSAGE, main, run_fp8_linear_bench,
                                      run_kernel_bench)
from batchinfer.kernels.cpu import fp8_linear

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")


@no_cuda
def test_main_reports_no_cuda_and_exits_0():
    result = CliRunner().invoke(main, [])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == NO_CUDA_MESSAGE


@no_cuda
def test_bench_kernels_subcommand_and_module_entry_point():
    result = CliRunner().invoke(bench, ["kernels"])
    assert result.exit_code == 0, result.output
    assert NO_CUDA_MESSAGE in result.output
    proc = subprocess.run([sys.executable, "-m", "batchinfer.bench.kernels"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert NO_CUDA_MESSAGE in proc.stdout


@no_cuda
def test_run_kernel_bench_rejects_a_cpu_device():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        run_kernel_bench(device=torch.device("cpu"))


def test_fp8_linear_bench_on_a_tiny_shape():
    results = run_fp8_linear_bench(shapes=((96, 200),), rows=(1, 40), min_time=0)
    assert [(r.shape, r.rows, r.scales) for r in results] == [
        ("96x200", 1, "channel"), ("96x200", 1, "block128"),
        ("96x200", 40, "channel"), ("96x200", 40, "block128")]
    for r in results:
        assert r.tiled_ms > 0 and r.bf16_ms > 0 and r.tiled_gbps >= 0
        assert (r.kernel_ms is not None) == fp8_linear.available()
        assert r.runs == ("kernel" if fp8_linear.available()
                          and r.rows <= fp8_linear.KERNEL_MAX_ROWS else "tiled")


def test_bench_kernels_cpu_fp8_linear_flag(tmp_path):
    out = tmp_path / "fp8.json"
    result = CliRunner().invoke(bench, [
        "kernels", "--cpu-fp8-linear", "--fp8-shapes", "6144x64,96x200", "--fp8-rows", "3",
        "--min-time", "0", "--output-json", str(out)])
    assert result.exit_code == 0, result.output
    assert "bf16 ms" in result.output and NO_CUDA_MESSAGE not in result.output
    rows = json.loads(out.read_text())["fp8_linear"]
    assert [(r["shape"], r["n"], r["k"], r["rows"]) for r in rows] == [
        ("6144x64", 6144, 64, 3)] * 2 + [("96x200", 96, 200, 3)] * 2
    bad = CliRunner().invoke(bench, ["kernels", "--cpu-fp8-linear", "--fp8-shapes", "96x"])
    assert bad.exit_code != 0 and "NxK" in bad.output
