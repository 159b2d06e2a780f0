"""slurm/batchinfer.sbatch without a cluster: the arguments it adds from the array and the
node, and the arrays it refuses (run with the Slurm variables set by hand)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "slurm" / "batchinfer.sbatch"


def _run(tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    # a stand-in for batchinfer that prints its arguments, one per line
    fake = tmp_path / "fake-batchinfer"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          env={**base, "BATCHINFER": str(fake), **env}, timeout=30)


ARRAY = {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "4", "SLURM_ARRAY_TASK_MAX": "7",
         "SLURM_ARRAY_TASK_COUNT": "4"}


def test_array_task_and_gpus_become_flags(tmp_path):
    result = _run(tmp_path, {**ARRAY, "SLURM_GPUS_ON_NODE": "4"}, "in put.jsonl", "-o", "o")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:-1] == ["run", "in put.jsonl", "-o", "o", "--num-shards",
                                              "4", "--shard-index", "1",
                                              "--tensor-parallel-size", "4"]
    # the flags or a job file decide tensor parallelism when they mention it
    for args in (["--tensor-parallel-size", "2"], ["--config", "job.toml"]):
        out = _run(tmp_path, {"SLURM_GPUS_ON_NODE": "4"}, "in.jsonl", *args).stdout
        assert out.count("--tensor-parallel-size") == args.count("--tensor-parallel-size")


@pytest.mark.parametrize("env", [
    {"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_MAX": "10",
     "SLURM_ARRAY_TASK_COUNT": "6", "SLURM_ARRAY_TASK_STEP": "2"},     # --array=0-10:2
    {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_MAX": "5",
     "SLURM_ARRAY_TASK_COUNT": "3"},                                     # --array=1,3,5
])
def test_arrays_that_are_not_one_range_are_refused(tmp_path, env):
    result = _run(tmp_path, env, "in.jsonl")
    assert result.returncode == 2 and "must be one range" in result.stderr
    assert result.stdout == ""


def test_tasks_of_several_nodes_become_one_engine(tmp_path):
    """A job of several tasks (one a node) runs them with srun, each with its --node-rank,
    meeting at the allocation's first node; each node is a pipeline stage by default."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/bin/sh\nprintf "gpu-a\\ngpu-b\\n"\n')
    # srun's stand-in: prints its own options, then runs the command once per task
    (bin_dir / "srun").write_text(
        '#!/bin/bash\nwhile [[ "$1" == --* ]]; do echo "srun $1"; shift; done\n'
        'for i in 0 1; do SLURM_PROCID=$i "$@"; done\n')
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    env = {"SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "gpu-[a-b]", "SLURM_JOB_ID": "4321",
           "SLURM_GPUS_ON_NODE": "8", "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    result = _run(tmp_path, env, "in.jsonl", "-o", "o")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split("\n")[:-1]
    assert [x for x in lines if x.startswith("srun")] == [
        "srun --kill-on-bad-exit=1", "srun --ntasks=2"]
    runs = "\n".join(lines).split("run\n")[1:]
    flags = ["in.jsonl", "-o", "o", "--tensor-parallel-size", "8", "--nnodes", "2",
             "--master-addr", "gpu-a", "--master-port", str(20000 + 4321),
             "--pipeline-parallel-size", "2"]
    assert [r.split("\n")[:-1] if r.endswith("\n") else r.split("\n") for r in runs] == [
        flags + ["--node-rank", "0"], flags + ["--node-rank", "1"]]
    # the flags or a job file decide the stages when they mention them
    out = _run(tmp_path, env, "in.jsonl", "--pipeline-parallel-size", "1").stdout
    assert out.count("--pipeline-parallel-size") == 2  # the given one, in each task's run
