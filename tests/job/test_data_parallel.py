"""--data-parallel-size: N processes, each a shard of the input, that together write what
one process would, stop together on one signal and continue together."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from jobtools import ENGINE_FLAGS

NUM_ROWS = 2600  # the shards deal out blocks of 1024 rows: three blocks, two processes
FLAGS = ["--max-tokens", "3", "--ignore-eos", "--temperature", "0", "--device", "cpu",
         "--commit-rows", "64", "--no-progress"]


def command(model: Path, input_path: Path, outdir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "batchinfer", "run", str(input_path), "--model", str(model),
            "-o", str(outdir), *ENGINE_FLAGS, *FLAGS, *extra]


def rows(outdir: Path) -> dict[int, str]:
    table = ds.dataset(outdir, format="parquet").to_table(columns=["id", "completion"])
    ids = table.column("id").to_pylist()
    assert len(ids) == len(set(ids)), "duplicated rows"
    return dict(zip(ids, table.column("completion").to_pylist()))


def done(outdir: Path) -> int:
    total = 0
    for manifest in outdir.glob("shard-*/__batchinfer__/manifest.json"):
        try:
            total += sum(e - s for s, e in json.loads(manifest.read_text())["done"])
        except json.JSONDecodeError:
            pass
    return total


@pytest.mark.slow
def test_data_parallel_processes_split_stop_and_continue(tmp_path, job_model_dir):
    with open(tmp_path / "in.jsonl", "w") as f:
        for i in range(NUM_ROWS):
            f.write(json.dumps({"prompt": f"Item {i}: a short note about {i % 7}"}) + "\n")
    single = subprocess.run(command(job_model_dir, tmp_path / "in.jsonl", tmp_path / "one"),
                            capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr
    expected = rows(tmp_path / "one")
    assert len(expected) == NUM_ROWS

    outdir = tmp_path / "dp"
    cmd = command(job_model_dir, tmp_path / "in.jsonl", outdir, "--data-parallel-size", "2")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while done(outdir) == 0 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "finished before it could be stopped; make it longer"
    proc.send_signal(signal.SIGTERM)  # one signal: every process commits and stops
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "2 data-parallel processes, shards 0-1 of 2" in stderr
    committed = done(outdir)
    assert 0 < committed < NUM_ROWS
    assert len(rows(outdir)) == committed

    assert "[shard 0] " in stderr and "[shard 1] " in stderr  # messages marked by shard
    assert "batchinfer: stopped by SIGTERM" in stderr

    # another split of the same OUTDIR is refused before any process starts
    other = subprocess.run(command(job_model_dir, tmp_path / "in.jsonl", outdir,
                                   "--data-parallel-size", "3"),
                           capture_output=True, text=True, timeout=120)
    assert other.returncode == 2 and "2-way split; this run makes 3" in other.stderr
    assert "[shard" not in other.stderr

    final = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert final.returncode == 0, final.stderr
    # one summary of both shards (the processes' own tables are not printed)
    assert final.stdout.count("rows_per_s") == 1
    assert f"batchinfer: {NUM_ROWS} rows (0 failed)" in final.stdout
    assert sorted(p.name for p in outdir.iterdir()) == ["shard-00000-of-00002",
                                                       "shard-00001-of-00002"]
    assert rows(outdir) == expected
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and again.stderr.count("rows already done") == 2


def test_data_parallel_mistakes_end_before_any_process(tmp_path, job_model_dir):
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    bad = subprocess.run(command(job_model_dir, tmp_path / "in.jsonl", tmp_path / "o",
                                 "--data-parallel-size", "2", "--max-tokens", "0"),
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--max-tokens" in bad.stderr
    assert "data-parallel processes" not in bad.stderr and not (tmp_path / "o").exists()
    textfile = subprocess.run(command(job_model_dir, tmp_path / "in.jsonl", tmp_path / "o",
                                      "--data-parallel-size", "2", "--metrics-textfile",
                                      tmp_path / "m.prom"),
                              capture_output=True, text=True, timeout=120)
    assert textfile.returncode == 2 and "use --metrics-port P instead" in textfile.stderr


@pytest.mark.slow
def test_a_killed_process_stops_the_run_and_is_named(tmp_path, job_model_dir):
    with open(tmp_path / "in.jsonl", "w") as f:
        for i in range(NUM_ROWS):
            f.write(json.dumps({"prompt": f"Item {i}"}) + "\n")
    outdir = tmp_path / "dp"
    proc = subprocess.Popen(command(job_model_dir, tmp_path / "in.jsonl", outdir,
                                    "--data-parallel-size", "2"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while done(outdir) == 0 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    children = children_of(proc.pid)
    assert len(children) == 2
    os.kill(children[0], signal.SIGKILL)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGKILL, stderr
    assert "was killed by SIGKILL; stopping the others" in stderr
    assert not any(Path(f"/proc/{pid}").exists() and "Z" not in
                   Path(f"/proc/{pid}/stat").read_text().split()[2] for pid in children[1:])


def children_of(pid: int) -> list[int]:
    """The processes whose parent is pid (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return sorted(found)


def test_shards_and_devices_of_the_processes():
    import pytest
    from batchinfer.job.data_parallel import child_environments, child_options
    from batchinfer.job.errors import JobError
    from batchinfer.job.options import JobOptions
    # task 1 of a 3-task array, two processes: shards 2 and 3 of 6
    options = JobOptions(input="x", model="m", output="o", num_shards=3, shard_index=1,
                         data_parallel_size=2, device="cpu")
    children = child_options(options)
    assert [(c["shard_index"], c["num_shards"], c["data_parallel_size"]) for c in children] \
        == [(2, 6, 1), (3, 6, 1)]
    assert all(c["progress"] is False for c in children)
    ports = child_options(JobOptions(data_parallel_size=3, metrics_port=9400))
    assert [c["metrics_port"] for c in ports] == [9400, 9401, 9402]
    envs = child_environments(options)
    assert len(envs) == 2 and all(e["BATCHINFER_DATA_PARALLEL_CHILD"] == "1" for e in envs)
    with pytest.raises(JobError, match="--device cuda:1 names one GPU"):
        child_environments(JobOptions(data_parallel_size=2, device="cuda:1"))
