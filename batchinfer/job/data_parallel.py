"""`batchinfer run --data-parallel-size N`: N copies of the engine on one machine.

Each copy is a process of its own, on its own GPUs (tensor_parallel_size of them, taken in
order from CUDA_VISIBLE_DEVICES) or its share of the CPU cores, and runs the job on its
own shard of the input, exactly as N tasks of a Slurm array would: OUTDIR gets
shard-IIIII-of-NNNNN directories, and running the same command again continues each one.
Combined with --num-shards S --shard-index I (one task of an array), the input is cut
into S * N shards and this task's processes take shards I * N ... I * N + N - 1.

The processes run in sessions of their own, so a terminal's Ctrl-C or a `kill` reaches
only this one, which passes a single SIGTERM on: each process commits its finished rows
and stops. Under Slurm, where every process of the job is signalled, a process ignores
SIGTERMs after its first (DP_CHILD), so the one passed on does not count as a second.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from typing import TextIO

from batchinfer.job.errors import JobError
from batchinfer.job.options import JobOptions

# set in the processes this module starts
DP_CHILD = "BATCHINFER_DATA_PARALLEL_CHILD"


def child_environments(options: JobOptions) -> list[dict[str, str]]:
    """The environment of each process: its GPUs, or on CPU its share of the cores."""
    size = options.data_parallel_size
    tp = options.tensor_parallel_size or 1
    device = options.device
    if device is not None and device.startswith("cuda:"):
        raise JobError(f"--device {device} names one GPU; with --data-parallel-size give "
                       "--device cuda (each process takes its own GPUs)")
    base = {**os.environ, DP_CHILD: "1"}
    if device != "cpu":
        import torch
        if torch.cuda.is_available():
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            gpus = ([g.strip() for g in visible.split(",") if g.strip()] if visible
                    else [str(i) for i in range(torch.cuda.device_count())])
            if size * tp > len(gpus):
                raise JobError(f"--data-parallel-size {size} x --tensor-parallel-size {tp} "
                               f"needs {size * tp} GPUs; {len(gpus)} are visible")
            return [{**base, "CUDA_VISIBLE_DEVICES": ",".join(gpus[j * tp:(j + 1) * tp])}
                    for j in range(size)]
        if device == "cuda":
            raise JobError("--device cuda: no CUDA device is available")
    threads = str(max(1, (os.cpu_count() or 1) // size))
    return [{**base, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads)}
            for _ in range(size)]


def child_options(options: JobOptions) -> list[dict]:
    """Each process's options: its shard, one engine, no progress bar of its own."""
    size = options.data_parallel_size
    first = (options.shard_index or 0) * size
    values = {k: v for k, v in asdict(options).items() if v is not None}
    return [{**values, "num_shards": options.num_shards * size, "shard_index": first + j,
             "data_parallel_size": 1, "progress": False} for j in range(size)]


def run_data_parallel(options: JobOptions, out: TextIO | None = None,
                      err: TextIO | None = None) -> int:
    """Run the job's data-parallel processes to the end; their exit code (the first
    failure's, or 128 + the signal that stopped them). The processes' messages go to
    stderr; one summary of all their shards goes to `out`."""
    out, err = out or sys.stdout, err or sys.stderr
    options.validate()  # a mistake ends the run before any process starts
    envs = child_environments(options)
    procs = []
    for values, env in zip(child_options(options), envs):
        proc = subprocess.Popen([sys.executable, "-m", "batchinfer.job.data_parallel"],
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env,
                                start_new_session=True)
        proc.stdin.write(json.dumps(values).encode())
        proc.stdin.close()
        procs.append(proc)
    indexes = [v["shard_index"] for v in child_options(options)]
    print(f"batchinfer: {len(procs)} data-parallel processes, shards {indexes[0]}-"
          f"{indexes[-1]} of {options.num_shards * options.data_parallel_size} in "
          f"{options.output}", file=err)
    stopped: list[int] = []

    def stop_all(signum: int, frame=None) -> None:
        if not stopped:
            stopped.append(signum)
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, stop_all) for sig in (signal.SIGTERM, signal.SIGINT)}
    failed = None
    try:
        while any(p.poll() is None for p in procs):
            for p in procs:
                code = p.poll()
                if code not in (None, 0) and failed is None and not stopped:
                    failed = code  # one failed: the others commit what they have and stop
                    stop_all(signal.SIGTERM)
            time.sleep(0.2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    codes = [p.returncode for p in procs]
    if failed is not None:
        return failed
    if stopped:
        return 128 + stopped[0]
    code = next((c for c in codes if c != 0), 0)
    if code == 0:
        _print_summary(options, 0.0, out)
    return code


def _print_summary(options: JobOptions, wall_s: float, out: TextIO) -> None:
    """One table over the rows of every shard these processes ran. Its wall time is the
    longest shard's over all its runs (the shards run side by side)."""
    from batchinfer.job.manifest import META_DIR
    from batchinfer.job.shard import Shard
    from batchinfer.job.summary import compute_summary, print_table
    paths = []
    for values in child_options(options):
        directory = Shard(values["shard_index"], values["num_shards"]).directory(options.output)
        paths += sorted(directory.glob("part-*.parquet"))
        try:
            shard_summary = json.loads((directory / META_DIR / "summary.json").read_text())
            wall_s = max(wall_s, shard_summary.get("wall_s") or 0.0)
        except (OSError, ValueError):
            pass
    summary = compute_summary(paths, wall_s)
    print(f"batchinfer: {summary['rows']} rows ({summary['errors']} failed) in "
          f"{options.output} ({options.data_parallel_size} data-parallel shards)", file=out)
    print_table(summary, out)


def _child_main() -> None:
    """A data-parallel process: its options as JSON on stdin."""
    from batchinfer.job.runner import run_job
    values = json.loads(sys.stdin.read())
    try:
        result = run_job(JobOptions.from_dict(values))
    except JobError as e:
        print(f"Error: {e}", file=sys.stderr)
        sys.exit(2)
    sys.exit(result.exit_code)


if __name__ == "__main__":
    _child_main()
