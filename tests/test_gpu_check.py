"""scripts/gpu-check.sh without a GPU: the shell script parses, its bench rows are real
`batchinfer bench` flags, and the report its Python part collects has its shape, checked
on one real bench row of the tiny shape on CPU (--dry) beside a row that timed out, one
that never ran and the test sections' logs."""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from batchinfer.bench.cli import bench

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPTS / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_check = _load_gpu_check()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_shell_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPTS / "gpu-check.sh")], check=True)


@pytest.mark.parametrize("dry", [False, True])
def test_rows_are_bench_flags(dry):
    for flags in gpu_check.bench_rows(dry).values():
        bench.make_context("bench", list(flags))  # raises on an unknown flag or value


def _section(out: Path, name: str, rc: int, log: str | None = None) -> None:
    (out / f"{name}.rc.json").write_text(json.dumps({"rc": rc, "seconds": 3, "limit": 75}))
    if log is not None:
        (out / f"{name}.log").write_text(log)


def test_collected_report(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHINFER_CPU_KERNELS", "0")  # no C kernel build in the bench row
    rows = gpu_check.bench_rows(dry=True)
    result = CliRunner().invoke(bench, [*rows["bf16"], "--cache-dir", str(tmp_path / "cache"),
                                        "--output-json", str(tmp_path / "bench-bf16.json")])
    assert result.exit_code == 0, result.output + repr(result.exception)
    _section(tmp_path, "bench-bf16", 0, result.output)
    _section(tmp_path, "bench-fp8", 124, "...")          # stopped by timeout; kv-fp8 never ran
    _section(tmp_path, "gpu-tests", 1, "F..s\n1 failed, 2 passed, 1 skipped in 4.10s\n")
    _section(tmp_path, "kernel-tests", 0, "....\n4 passed, 9 deselected in 1.00s\n")

    gpu_check.main(["collect", str(tmp_path), "--dry"])
    report = json.loads((tmp_path / gpu_check.REPORT).read_text())

    assert report["dry"] is True
    assert {"device", "capability", "torch", "cuda", "triton"} <= set(report)
    assert report["tests"]["gpu-tests"] == {
        "status": "failed", "rc": 1, "seconds": 3, "limit": 75, "log": "gpu-tests.log",
        "failed": 1, "passed": 2, "skipped": 1}
    assert report["tests"]["kernel-tests"]["status"] == "ok"
    assert report["tests"]["kernel-tests"]["passed"] == 4
    bench_rows = report["bench"]
    assert list(bench_rows) == ["bf16", "fp8", "kv-fp8", "bf16-async"]
    bf16 = bench_rows["bf16"]
    assert bf16["status"] == "ok" and bf16["flags"] == rows["bf16"]
    assert bf16["output_tokens_per_second"] > 0
    assert bf16["enforce_eager"] is False and bf16["tensor_parallel_size"] == 1  # CUDA graphs
    assert set(gpu_check.ROW_FIELDS) <= set(bf16)
    # a CPU has no known peak: bandwidth and MFU stay empty
    assert bf16["decode_bandwidth_fraction_of_peak"] is None and bf16["prefill_mfu"] is None
    assert bench_rows["fp8"]["status"] == "timed out"
    assert bench_rows["fp8"]["output_tokens_per_second"] is None
    assert bench_rows["kv-fp8"]["status"] == "missing"
    assert bench_rows["bf16-async"]["flags"][-1] == "--async-scheduling"
    table = report["table"]
    assert len(table) == 2 + len(bench_rows)
    assert table[2].startswith("| bf16 | ok | ") and table[3].startswith("| fp8 | timed out |")
