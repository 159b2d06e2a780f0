"""Exactly once: a job stopped (SIGTERM) or killed at random points (SIGKILL) and restarted
with the same command ends with exactly the rows of an uninterrupted run."""
from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from batchinfer import SamplingParams

from jobtools import ENGINE_FLAGS

NUM_ROWS = 64
JOB_FLAGS = ["--max-tokens", "8", "--ignore-eos", "--temperature", "0", "--max-num-seqs", "4",
             "--commit-rows", "2", "--reorder-window", "8", "--no-progress"]


def write_input(path: Path) -> None:
    # Several shared prefixes, so the reorder window hands rows out of input order.
    with open(path, "w") as f:
        for i in range(NUM_ROWS):
            f.write(json.dumps({"prompt": f"Topic {i % 5}: the story of item {i}", "i": i}) + "\n")


def command(model_dir: Path, input_path: Path, outdir: Path) -> list[str]:
    return [sys.executable, "-m", "batchinfer", "run", str(input_path), "--model", str(model_dir),
            "-o", str(outdir), *ENGINE_FLAGS, *JOB_FLAGS]


def done_rows(outdir: Path) -> int:
    try:
        manifest = json.loads((outdir / "__batchinfer__" / "manifest.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return 0
    return sum(e - s for s, e in manifest["done"])


def rows_by_id(outdir: Path) -> dict[int, tuple]:
    table = ds.dataset(outdir).to_table(columns=["id", "sample_index", "i", "completion",
                                                 "output_tokens"])
    rows = table.to_pylist()
    keys = [(r["id"], r["sample_index"]) for r in rows]
    assert len(keys) == len(set(keys)), "duplicated rows"
    return {r["id"]: (r["i"], r["completion"], r["output_tokens"]) for r in rows}


def wait_for_progress(proc: subprocess.Popen, outdir: Path, above: int, timeout: float = 60) -> bool:
    """Wait until more rows than `above` are committed; False if the job ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if done_rows(outdir) > above:
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.02)
    raise TimeoutError("the job made no progress")


@pytest.mark.slow
def test_stopped_and_killed_job_resumes_exactly_once(tmp_path, job_model_dir, reference_llm):
    """SIGTERM once, then SIGKILL at random points, then a full run: the rows equal an
    uninterrupted run's, none computed twice once committed, none lost or duplicated."""
    write_input(tmp_path / "in.jsonl")
    prompts = [json.loads(line)["prompt"] for line in open(tmp_path / "in.jsonl")]
    outs = reference_llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True,
                                                          temperature=0.0))
    expected = {i: (i, o.outputs[0].text, 8) for i, o in enumerate(outs)}
    outdir = tmp_path / "out"
    cmd = command(job_model_dir, tmp_path / "in.jsonl", outdir)

    # SIGTERM: finished rows are committed, the exit code lets a scheduler requeue.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert wait_for_progress(proc, outdir, 0)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "stopped by SIGTERM" in stderr
    committed = done_rows(outdir)
    assert 0 < committed < NUM_ROWS
    assert len(rows_by_id(outdir)) == committed
    summary = json.loads((outdir / "__batchinfer__" / "summary.json").read_text())
    assert summary["complete"] is False and summary["rows"] == committed

    rng = random.Random(1234)
    kills = 0
    for _ in range(2):
        before = done_rows(outdir)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if wait_for_progress(proc, outdir, before):
            time.sleep(rng.uniform(0.0, 0.2))  # anywhere: mid-step, mid-write, mid-commit
            proc.send_signal(signal.SIGKILL)
        proc.communicate()
        if proc.returncode == -signal.SIGKILL:
            kills += 1
            assert set(rows_by_id(outdir)) <= set(expected)  # readable, no partial part
    print(f"SIGTERM after {committed} rows, then {kills} SIGKILLs")
    assert kills >= 1, "the job finished before it could be killed; make it longer"

    final = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr
    assert "rows already done" in final.stderr
    assert rows_by_id(outdir) == expected
    manifest = json.loads((outdir / "__batchinfer__" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["done"] == [[0, NUM_ROWS]]
    # No committed row was committed again by a later run.
    assert sum(run["input_rows"] for run in manifest["runs"]) == NUM_ROWS
    listed = {p["file"] for p in manifest["parts"]}
    assert {p.name for p in outdir.glob("part-*.parquet")} == listed
    assert not list(outdir.glob(".*.tmp"))
    summary = json.loads((outdir / "__batchinfer__" / "summary.json").read_text())
    assert summary["rows"] == NUM_ROWS and summary["output_tokens"] == 8 * NUM_ROWS
    assert summary["complete"] is True and summary["runs"] == len(manifest["runs"])
