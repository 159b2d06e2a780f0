"""Kills a job (or a merge) with SIGKILL at each step of its file operations in turn, then
restarts it, and reports what readers saw: run as `python kill_sweep.py WORKDIR MODE` with
MODE one of commit, merge, shard, retry (commits of a job whose rows take several
attempts, --max-attempts); prints one JSON object per step.

Each attempt runs in a forked child (this process imports no torch, so forking is safe),
with faults.Faults(at=step, kill=True); the sweep ends at the first step the job reaches
its end without being killed.
"""
from __future__ import annotations

import io
import json
import os
import signal
import sys
from pathlib import Path

import pyarrow.dataset as ds

sys.path.insert(0, str(Path(__file__).parent))

from batchinfer.job.manifest import OutputDir  # noqa: E402
from batchinfer.job.merge import merge_parts  # noqa: E402
from batchinfer.job.options import JobOptions  # noqa: E402
from batchinfer.job.runner import run_job  # noqa: E402
from fake_engine import FakeEngine, SeededEngine  # noqa: E402
from faults import Faults  # noqa: E402

ROWS = 12


def options(work: Path, shard: int | None = None, retry: bool = False) -> JobOptions:
    path = work / "in.jsonl"
    if not path.exists():
        # with retry, the first attempt ("x") never matches the regex, later ones may
        tail = "|replies:x|7|y|42" if retry else ""
        path.write_text("".join(json.dumps({"prompt": f"row {i}{tail}"}) + "\n"
                                for i in range(ROWS)))
    shards = {} if shard is None else {"num_shards": 2, "shard_index": shard}
    retries = {"regex": r"\d+", "max_attempts": 3, "temperature": 1.0} if retry else {}
    return JobOptions(input=str(path), model="stand-in", output=str(work / "out"),
                      max_tokens=2, progress=False, commit_rows=4, reorder_window=0,
                      **shards, **retries)


def run(work: Path, shard: int | None = None, retry: bool = False) -> int:
    engine = SeededEngine if retry else FakeEngine
    return run_job(options(work, shard, retry), lambda m, k: engine(2), out=io.StringIO(),
                   err=io.StringIO()).exit_code


def in_child(action, step: int | None) -> str:
    """Run `action` in a forked child, killed at `step`: "killed", "done" or "failed"."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            with Faults(at=step, kill=True):
                code = action()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        return "killed"
    return "done" if os.WEXITSTATUS(status) == 0 else "failed"


def ids(out: Path) -> list[int]:
    dataset = ds.dataset(out, format="parquet") if out.exists() else None
    if dataset is None or not dataset.files:
        return []
    return sorted(dataset.to_table(columns=["id"]).column("id").to_pylist())


def main(root: Path, mode: str) -> None:
    (root / "warm-up").mkdir()
    assert run(root / "warm-up") == 0  # imports done here once, not in every child
    step = 0
    while True:
        step += 1
        work = root / f"step-{step}"
        work.mkdir()
        out = work / "out"
        if mode == "merge":
            assert run(work) == 0
            outcome = in_child(lambda: (merge_parts(OutputDir(out), 5), 0)[1], step)
        elif mode == "shard":
            assert run(work, 1) == 0
            outcome = in_child(lambda: run(work, 0), step)
        else:
            outcome = in_child(lambda: run(work, retry=mode == "retry"), step)
        seen = ids(out)
        if mode == "merge":
            restarted = in_child(lambda: (merge_parts(OutputDir(out), 5), 0)[1], None)
        else:
            restarted = in_child(lambda: run(work, 0 if mode == "shard" else None,
                                             mode == "retry"), None)
        print(json.dumps({"step": step, "outcome": outcome, "seen_after_kill": seen,
                          "restart": restarted, "rows_after_restart": ids(out)}), flush=True)
        if outcome != "killed":
            return


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
