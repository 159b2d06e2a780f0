"""The kernel benchmark without CUDA: it says so and exits 0."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from batchinfer.bench.cli import bench
from batchinfer.bench.kernels import NO_CUDA_MESSAGE, main, run_kernel_bench

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")


def test_main_reports_no_cuda_and_exits_0():
    result = CliRunner().invoke(main, [])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == NO_CUDA_MESSAGE


def test_bench_kernels_subcommand_and_module_entry_point():
    result = CliRunner().invoke(bench, ["kernels"])
    assert result.exit_code == 0, result.output
    assert NO_CUDA_MESSAGE in result.output
    proc = subprocess.run([sys.executable, "-m", "batchinfer.bench.kernels"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert NO_CUDA_MESSAGE in proc.stdout


def test_run_kernel_bench_rejects_a_cpu_device():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        run_kernel_bench(device=torch.device("cpu"))
