"""A million rows stream through the runner in bounded memory (a stand-in engine completes
each request at once, so only the job machinery is measured)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

NUM_ROWS = 1_000_000
# Peak RSS growth over the process's RSS before the job starts (torch, pyarrow, ... loaded).
# Measured on a 2-core machine with 10,000-row parts and a 4096-row reorder window: about
# 90 MiB for 1M rows (RSS flat through the run, sampled each second) against 65 MiB for
# 100k rows, so ten times the rows cost no more than allocator and Arrow pool slack.
MAX_GROWTH_MIB = 200

SCRIPT = """
import io, json, resource, sys
from fake_engine import FakeEngine
from batchinfer.job.options import JobOptions
from batchinfer.job.runner import run_job
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
options = JobOptions(input=sys.argv[1], model="stand-in", output=sys.argv[2], max_tokens=4,
                     progress=False, commit_rows=10000)
result = run_job(options, engine_factory=FakeEngine.factory, out=io.StringIO(),
                 err=io.StringIO())
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"base_mib": base, "peak_mib": peak, "exit_code": result.exit_code,
                  "summary": result.summary}))
"""


@pytest.mark.slow
def test_million_rows_stream_in_bounded_memory(tmp_path):
    source = tmp_path / "big.jsonl"
    with open(source, "w") as f:
        for i in range(NUM_ROWS):
            f.write('{"prompt": "Question %d about topic %d?", "i": %d}\n' % (i, i % 97, i))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(source), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=240,
                          cwd=Path(__file__).parent)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["exit_code"] == 0
    assert report["summary"]["rows"] == NUM_ROWS and report["summary"]["errors"] == 0
    growth = report["peak_mib"] - report["base_mib"]
    print(f"peak RSS {report['peak_mib']:.0f} MiB, {growth:.0f} MiB over the start")
    assert growth < MAX_GROWTH_MIB, report

    manifest = json.loads((tmp_path / "out" / "__batchinfer__" / "manifest.json").read_text())
    assert manifest["done"] == [[0, NUM_ROWS]]
    assert sum(p["input_rows"] for p in manifest["parts"]) == NUM_ROWS
