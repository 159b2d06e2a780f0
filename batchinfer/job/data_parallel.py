"""`batchinfer run --data-parallel-size N`: N copies of the engine on one machine.

Each copy is a process of its own, on its own GPUs (tensor_parallel_size of them, taken in
order from CUDA_VISIBLE_DEVICES) or its share of the CPU cores, and runs the job on its
own shard of the input, exactly as N tasks of a Slurm array would: OUTDIR gets
shard-IIIII-of-NNNNN directories, and running the same command again continues each one.
Combined with --num-shards S --shard-index I (one task of an array), the input is cut
into S * N shards and this task's processes take shards I * N ... I * N + N - 1.

Signals: the processes run in sessions of their own, so a terminal's Ctrl-C or hang-up
reaches only this launcher, which passes one SIGTERM on (each process commits its
finished rows and stops); a second Ctrl-C kills them at once. A process whose launcher
dies gets SIGTERM from the kernel (Linux). Under Slurm, where every process of the job is
signalled, a process ignores SIGTERMs after its first (DP_CHILD), so the launcher's does
not count as a second one.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import IO, TextIO

from batchinfer.job.errors import JobError
from batchinfer.job.options import JobOptions
from batchinfer.job.signals import DP_CHILD

_PR_SET_PDEATHSIG = 1  # prctl's option: a signal when the parent dies


def check(options: JobOptions) -> None:
    """What only the launcher can see to be wrong, before any process starts."""
    if options.metrics_textfile is not None:
        raise JobError("--metrics-textfile with --data-parallel-size: the processes would "
                       "write the same series; use --metrics-port P instead (process j "
                       "serves port P + j)")
    from batchinfer.job.manifest import META_DIR
    from batchinfer.job.shard import shard_dirs
    output = Path(options.output).expanduser()
    if (output / META_DIR).is_dir():
        raise JobError(f"--output {output} holds the output of a job run without "
                       "--data-parallel-size; choose another --output")
    counts = {int(re.search(r"-of-(\d+)$", d.name).group(1)) for d in shard_dirs(output)}
    total = options.num_shards * options.data_parallel_size
    if counts - {total}:
        raise JobError(f"--output {output} holds the shards of a {max(counts - {total})}-way "
                       f"split; this run makes {total} (--data-parallel-size "
                       f"{options.data_parallel_size} x --num-shards {options.num_shards}): run "
                       "it with the sizes that made them, or choose another --output")


def child_environments(options: JobOptions) -> list[dict[str, str]]:
    """The environment of each process: its GPUs, or on CPU its share of the cores."""
    size = options.data_parallel_size
    tp = (options.tensor_parallel_size or 1) * (options.pipeline_parallel_size or 1)
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
                raise JobError(f"--data-parallel-size {size} x --tensor-parallel-size x "
                               f"--pipeline-parallel-size ({tp}) needs {size * tp} GPUs; "
                               f"{len(gpus)} are visible")
            return [{**base, "CUDA_VISIBLE_DEVICES": ",".join(gpus[j * tp:(j + 1) * tp])}
                    for j in range(size)]
        if device == "cuda":
            raise JobError("--device cuda: no CUDA device is available")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = str(max(1, (cpus or 1) // size))
    return [{**base, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads)}
            for _ in range(size)]


def child_options(options: JobOptions) -> list[dict]:
    """Each process's options: its shard, one engine, its own metrics port, no progress
    bar of its own (the launcher reports progress)."""
    size = options.data_parallel_size
    first = (options.shard_index or 0) * size
    values = {k: v for k, v in asdict(options).items() if v is not None}
    port = options.metrics_port
    return [{**values, "num_shards": options.num_shards * size, "shard_index": first + j,
             "data_parallel_size": 1, "progress": False,
             **({"metrics_port": port + j} if port else {})} for j in range(size)]


class _Launch:
    """The processes of one data-parallel run and what the launcher knows of them."""

    def __init__(self, options: JobOptions, err: TextIO):
        self.options, self.err = options, err
        self.children = child_options(options)
        self.procs: list[subprocess.Popen] = []
        self.signals: list[int] = []
        self.lock = threading.Lock()

    def start(self) -> None:
        for values, env in zip(self.children, child_environments(self.options)):
            proc = subprocess.Popen(
                [sys.executable, "-m", "batchinfer.job.data_parallel"], stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                start_new_session=True, preexec_fn=_die_with_parent)
            proc.stdin.write(json.dumps(values).encode())
            proc.stdin.close()
            self.procs.append(proc)
            threading.Thread(target=self._relay, args=(proc.stderr, values["shard_index"]),
                             daemon=True).start()

    def _relay(self, stream: IO[bytes], shard: int) -> None:
        """A process's messages, each line marked with its shard."""
        for line in stream:
            with self.lock:
                self.err.write(f"[shard {shard}] {line.decode(errors='replace')}")
                self.err.flush()

    def on_signal(self, signum: int, frame=None) -> None:
        """The first signal stops every process (they commit); a second kills them."""
        self.signals.append(signum)
        if len(self.signals) == 1:
            self.stop(signal.SIGTERM)
        else:
            self.stop(signal.SIGKILL)

    def stop(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(sig)

    def rows_done(self) -> int:
        from batchinfer.job.shard import Shard
        total = 0
        for values in self.children:
            directory = Shard(values["shard_index"], values["num_shards"]).directory(
                self.options.output)
            try:
                manifest = json.loads((directory / "__batchinfer__" / "manifest.json").read_text())
                total += sum(e - s for s, e in manifest["done"])
            except (OSError, ValueError, KeyError):
                pass
        return total

    def wait(self) -> int:
        """Exit code: the first failed process's (128 + signal for a killed one), or
        128 + the signal that stopped the run, or 0."""
        failed = None
        last_report = time.monotonic()
        while any(p.poll() is None for p in self.procs):
            for values, p in zip(self.children, self.procs):
                code = p.poll()
                if code not in (None, 0) and failed is None and not self.signals:
                    failed = 128 - code if code < 0 else code
                    how = (f"was killed by {signal.Signals(-code).name}" if code < 0
                           else f"exited with code {code}")
                    print(f"batchinfer: the process of shard {values['shard_index']} {how}; "
                          "stopping the others", file=self.err)
                    self.stop(signal.SIGTERM)  # they commit what they have
            if self.options.progress and time.monotonic() - last_report >= \
                    self.options.progress_interval:
                last_report = time.monotonic()
                with self.lock:
                    print(f"batchinfer: {self.rows_done():,} rows committed", file=self.err)
            time.sleep(0.2)
        if failed is not None:
            return failed
        if self.signals:
            return 128 + self.signals[0]
        codes = [p.returncode for p in self.procs]
        return next((128 - c if c < 0 else c for c in codes if c != 0), 0)


def run_data_parallel(options: JobOptions, out: TextIO | None = None,
                      err: TextIO | None = None) -> int:
    """Run the job's data-parallel processes to the end; their exit code. The processes'
    messages go to stderr marked with their shard; one summary of all their shards goes
    to `out`."""
    out, err = out or sys.stdout, err or sys.stderr
    options.validate()  # a mistake ends the run before any process starts
    check(options)
    from batchinfer.job.runner import check_constraint, check_model
    check_model(options.model, options.tokenizer)
    check_constraint(options)
    launch = _Launch(options, err)
    handled = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    previous = {sig: signal.signal(sig, launch.on_signal) for sig in handled}
    try:
        launch.start()
        indexes = [v["shard_index"] for v in launch.children]
        print(f"batchinfer: {len(indexes)} data-parallel processes, shards {indexes[0]}-"
              f"{indexes[-1]} of {options.num_shards * options.data_parallel_size} in "
              f"{options.output}", file=err)
        code = launch.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if launch.signals:
        name = signal.Signals(launch.signals[0]).name
        print(f"batchinfer: stopped by {name}; {launch.rows_done():,} rows committed in "
              f"{options.output}; run the same command again to continue", file=err)
    if code == 0:
        _print_summary(options, launch.children, out)
    return code


def _print_summary(options: JobOptions, children: list[dict], out: TextIO) -> None:
    """One table over the rows of every shard these processes ran. Its wall time is the
    longest shard's over all its runs (the shards run side by side)."""
    from batchinfer.job.manifest import META_DIR
    from batchinfer.job.shard import Shard
    from batchinfer.job.summary import compute_summary, print_table
    paths, wall_s = [], 0.0
    for values in children:
        directory = Shard(values["shard_index"], values["num_shards"]).directory(options.output)
        try:
            manifest = json.loads((directory / META_DIR / "manifest.json").read_text())
            paths += [directory / part["file"] for part in manifest["parts"]]
            shard_summary = json.loads((directory / META_DIR / "summary.json").read_text())
            wall_s = max(wall_s, shard_summary.get("wall_s") or 0.0)
        except (OSError, ValueError, KeyError):
            pass
    summary = compute_summary(paths, wall_s)
    print(f"batchinfer: {summary['rows']} rows ({summary['errors']} failed) in "
          f"{options.output} ({options.data_parallel_size} data-parallel shards)", file=out)
    print_table(summary, out)
    if options.output_format == "openai":
        print(f"batchinfer: OpenAI Batch output in {options.output}/shard-*/{META_DIR}/"
              "openai_output.jsonl", file=out)


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the launcher dies (Linux; elsewhere a
    no-op), so a killed launcher leaves no process running on its own."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


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
