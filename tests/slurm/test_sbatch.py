"""slurm/batchinfer.sbatch on a real single-node Slurm cluster: an array job's tasks split
the input and write every row once; a task signalled before its time limit commits,
requeues itself and finishes its rows on the next start."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from local_cluster import LocalSlurm

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parents[2] / "slurm" / "batchinfer.sbatch"


def _input(path: Path, rows: int, words: int = 4) -> Path:
    path.write_text("".join(json.dumps({"prompt": " ".join([f"row {i}"] * words)}) + "\n"
                            for i in range(rows)))
    return path


def _flags(llama_dir: Path, out: Path, *extra: str) -> list[str]:
    return ["--model", str(llama_dir), "-o", str(out), "--device", "cpu", "--dtype", "float32",
            "--num-kv-blocks", "256", "--max-num-seqs", "32", "--ignore-eos", *extra]


@pytest.fixture
def batchinfer_command(monkeypatch):
    # the jobs run this environment's batchinfer (sbatch passes the environment on)
    monkeypatch.setenv("BATCHINFER", str(Path(sys.executable).with_name("batchinfer")))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def test_array_tasks_split_the_input(local_slurm: LocalSlurm, llama_dir, tmp_path,
                                     batchinfer_command):
    rows = 2100  # three blocks of 1024: two for task 0, one (part full) for task 1
    source = _input(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    job = local_slurm.sbatch(["--array=0-1", f"--output={tmp_path}/task-%a.log", str(SCRIPT),
                              str(source), *_flags(llama_dir, out, "--max-tokens", "2")],
                             cwd=tmp_path)
    states = local_slurm.wait(job, timeout=240)
    logs = "\n".join(p.read_text() for p in sorted(tmp_path.glob("task-*.log")))
    assert set(states.values()) == {"COMPLETED"}, logs
    assert sorted(p.name for p in out.iterdir()) == ["shard-00000-of-00002",
                                                      "shard-00001-of-00002"]
    for shard in out.iterdir():
        summary = json.loads((shard / "__batchinfer__" / "summary.json").read_text())
        assert summary["complete"] is True
    ids = ds.dataset(out).to_table().column("id").to_pylist()
    assert sorted(ids) == list(range(rows))


def test_time_limit_signal_commits_requeues_and_resumes(local_slurm: LocalSlurm, llama_dir,
                                                        tmp_path, batchinfer_command):
    rows = 5000  # seconds of work: the signal comes after the first 100 rows
    source = _input(tmp_path / "in.jsonl", rows, words=12)
    out = tmp_path / "out"
    log = tmp_path / "job.log"
    job = local_slurm.sbatch([f"--output={log}", str(SCRIPT), str(source),
                              *_flags(llama_dir, out, "--max-tokens", "8", "--commit-rows",
                                      "100")], cwd=tmp_path)
    manifest = out / "__batchinfer__" / "manifest.json"
    deadline = time.monotonic() + 180
    while not (manifest.is_file() and json.loads(manifest.read_text())["parts"]):
        assert time.monotonic() < deadline, log.read_text() if log.exists() else "no log"
        time.sleep(0.2)
    # what --signal=B:USR1@120 sends before the time limit
    local_slurm.run(["scancel", "--signal=USR1", "--batch", job])
    states = local_slurm.wait(job, timeout=300)
    text = log.read_text()
    assert states == {job: "COMPLETED"}, text
    assert "requeueing job" in text and "stopped by SIGTERM" in text
    assert int(local_slurm.job_info(job)[job]["Restarts"]) == 1
    assert "continuing" in text  # the second start resumed from the committed rows
    ids = ds.dataset(out).to_table().column("id").to_pylist()
    assert sorted(ids) == list(range(rows))  # every row once: none lost, none repeated


def _rows(out: Path) -> list[tuple]:
    return sorted((r["id"], r["completion"]) for r in ds.dataset(out).to_table().to_pylist())


def test_two_tasks_make_one_engine_and_a_lost_task_is_resumed(local_slurm: LocalSlurm,
                                                              llama_dir, tmp_path,
                                                              batchinfer_command):
    """Two tasks of one allocation stand in for two nodes: one engine, a pipeline stage
    each, writes the rows one process writes. A task killed mid-run fails the job, and the
    same sbatch line then finishes it with every row once."""
    from batchinfer.job.cli import run
    from click.testing import CliRunner
    small = _input(tmp_path / "small.jsonl", 40)
    one = CliRunner().invoke(run, [str(small), *_flags(llama_dir, tmp_path / "one",
                                                       "--max-tokens", "4"), "--no-progress"])
    assert one.exit_code == 0, one.output
    log = tmp_path / "two.log"
    job = local_slurm.sbatch(["--nodes=1", "--ntasks-per-node=2", f"--output={log}",
                              str(SCRIPT), str(small),
                              *_flags(llama_dir, tmp_path / "two", "--max-tokens", "4")],
                             cwd=tmp_path)
    states = local_slurm.wait(job, timeout=240)
    assert states == {job: "COMPLETED"}, log.read_text()
    assert "--nnodes 2" in log.read_text() and "node 0 shut the engine down" in log.read_text()
    assert _rows(tmp_path / "two") == _rows(tmp_path / "one")

    rows = 4000
    source = _input(tmp_path / "in.jsonl", rows, words=12)
    out = tmp_path / "out"
    line = ["--nodes=1", "--ntasks-per-node=2", f"--output={tmp_path}/job-%j.log", str(SCRIPT),
            str(source), *_flags(llama_dir, out, "--max-tokens", "8", "--commit-rows", "100")]
    job = local_slurm.sbatch(line, cwd=tmp_path)
    manifest = out / "__batchinfer__" / "manifest.json"
    deadline = time.monotonic() + 180
    while not (manifest.is_file() and json.loads(manifest.read_text())["parts"]):
        assert time.monotonic() < deadline, local_slurm.states(job)
        time.sleep(0.2)
    subprocess.run(["pkill", "-9", "-f", f"{out} .*node-rank 1"], check=False)  # node 1 is lost
    states = local_slurm.wait(job, timeout=120)
    assert states[job] in ("FAILED", "CANCELLED"), states
    done = sum(b - a for a, b in json.loads(manifest.read_text())["done"])
    assert 0 < done < rows
    job = local_slurm.sbatch(line, cwd=tmp_path)  # the same line continues it
    states = local_slurm.wait(job, timeout=300)
    assert states == {job: "COMPLETED"}, (tmp_path / f"job-{job}.log").read_text()
    ids = ds.dataset(out).to_table().column("id").to_pylist()
    assert sorted(ids) == list(range(rows))  # every row once: none lost, none repeated


def test_two_tasks_commit_and_requeue_before_the_time_limit(local_slurm: LocalSlurm, llama_dir,
                                                           tmp_path, batchinfer_command):
    rows = 4000
    source = _input(tmp_path / "in.jsonl", rows, words=12)
    out = tmp_path / "out"
    log = tmp_path / "job.log"
    job = local_slurm.sbatch(["--nodes=1", "--ntasks-per-node=2", f"--output={log}",
                              str(SCRIPT), str(source),
                              *_flags(llama_dir, out, "--max-tokens", "8", "--commit-rows",
                                      "100")], cwd=tmp_path)
    manifest = out / "__batchinfer__" / "manifest.json"
    deadline = time.monotonic() + 180
    while not (manifest.is_file() and json.loads(manifest.read_text())["parts"]):
        assert time.monotonic() < deadline, log.read_text() if log.exists() else "no log"
        time.sleep(0.2)
    local_slurm.run(["scancel", "--signal=USR1", "--batch", job])
    states = local_slurm.wait(job, timeout=300)
    text = log.read_text()
    assert states == {job: "COMPLETED"}, text
    assert "requeueing job" in text and "stopped by SIGTERM" in text
    assert int(local_slurm.job_info(job)[job]["Restarts"]) == 1
    ids = ds.dataset(out).to_table().column("id").to_pylist()
    assert sorted(ids) == list(range(rows))
