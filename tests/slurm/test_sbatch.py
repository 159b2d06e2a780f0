"""slurm/batchinfer.sbatch on a real single-node Slurm cluster: an array job's tasks split
the input and write every row once; a task signalled before its time limit commits,
requeues itself and finishes its rows on the next start."""
from __future__ import annotations

import json
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
