"""Smoke test of the Slurm test harness: a real single-node cluster runs an array job."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from local_cluster import LocalSlurm

pytestmark = pytest.mark.slurm


def test_array_job_runs_every_task_and_stop_leaves_nothing(slurm_installed,
                                                           tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "task.sh"
    script.write_text(f'#!/bin/sh\necho "$SLURM_ARRAY_TASK_ID" > {out}/task_$SLURM_ARRAY_TASK_ID.txt\n')
    cluster = LocalSlurm(tmp_path / "cluster")
    try:
        started = time.monotonic()
        cluster.start()
        start_seconds = time.monotonic() - started

        # The clients work from a plain environment plus cluster.env, too.
        sinfo = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True,
                               text=True, env={**os.environ, **cluster.env}, timeout=30)
        assert sinfo.returncode == 0, sinfo.stderr
        assert sinfo.stdout.split() == [cluster.node_name, "idle"]

        job_id = cluster.sbatch(["--array=0-1", f"--output={tmp_path}/slurm-%A_%a.out",
                                 str(script)], cwd=tmp_path)
        states = cluster.wait(job_id, timeout=30)
        assert states == {f"{job_id}_0": "COMPLETED", f"{job_id}_1": "COMPLETED"}
        assert {key: info["ExitCode"] for key, info in cluster.job_info(job_id).items()} \
            == {f"{job_id}_0": "0:0", f"{job_id}_1": "0:0"}
        for task in (0, 1):
            assert (out / f"task_{task}.txt").read_text() == f"{task}\n"
    finally:
        cluster.stop()
    cluster.stop()  # a second stop() is a no-op
    assert cluster.leftover_processes() == []
    print(f"cluster started in {start_seconds:.1f}s")
