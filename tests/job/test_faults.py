"""Exactly once under faults: an I/O error or a SIGKILL at any step of a commit, a merge or
a shard's run, a damaged or deleted part, a race for OUTDIR, a hostile lock file."""
from __future__ import annotations

import errno
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow.dataset as ds
import pytest
from click.testing import CliRunner

from batchinfer.job.cli import run
from batchinfer.job.errors import JobError, OutputFailed
from batchinfer.job.manifest import OutputDir
from batchinfer.job.options import JobOptions
from batchinfer.job.runner import run_job
from fake_engine import FakeEngine
from faults import Faults

ROWS = 30
HERE = Path(__file__).parent


def job(tmp_path: Path, output: Path | None = None, **kwargs) -> JobOptions:
    path = tmp_path / "in.jsonl"
    if not path.exists():
        tmp_path.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps({"prompt": f"row {i}"}) + "\n" for i in range(ROWS)))
    kwargs = {"commit_rows": 7, "reorder_window": 0, **kwargs}
    return JobOptions(input=str(path), model="stand-in", output=str(output or tmp_path / "out"),
                      max_tokens=2, progress=False, **kwargs)


def run_fake(options: JobOptions, err: io.StringIO | None = None) -> int:
    return run_job(options, lambda m, k: FakeEngine(2), out=io.StringIO(),
                   err=err or io.StringIO()).exit_code


def ids(out: Path) -> list[int]:
    dataset = ds.dataset(out, format="parquet")
    if not dataset.files:
        return []
    return sorted(dataset.to_table(columns=["id"]).column("id").to_pylist())


def steps_of_a_clean_run(tmp_path: Path) -> int:
    with Faults() as faults:
        assert run_fake(job(tmp_path / "clean")) == 0
    return faults.steps


@pytest.mark.parametrize("persistent", [False, True], ids=["once", "from-then-on"])
@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EIO], ids=["ENOSPC", "EIO"])
def test_an_io_error_at_any_step_never_loses_or_duplicates_a_row(tmp_path, error, persistent):
    """The error at each file operation in turn (a transient one, or a disk that stays
    full); after it, readers see each committed row once, and a rerun completes the job
    with every row exactly once."""
    steps = steps_of_a_clean_run(tmp_path)
    assert steps > 20  # a start, five commits and the final save, each several steps
    for step in range(1, steps + 1):
        work = tmp_path / f"step-{step}"
        work.mkdir()
        with Faults(at=step, error=error, persistent=persistent) as faults:
            try:
                code = run_fake(job(work))
            except JobError:
                code = None
        assert faults.failed, step
        assert code != 0, step  # the failure is reported, never swallowed
        seen = ids(work / "out") if (work / "out").exists() else []
        assert len(seen) == len(set(seen)), f"step {step}: duplicated rows after the error"
        assert run_fake(job(work)) == 0, step
        assert ids(work / "out") == list(range(ROWS)), f"step {step}"
        manifest = OutputDir(work / "out").read_manifest()
        assert sum(p["input_rows"] for p in manifest.parts) == ROWS


def test_a_failed_manifest_save_is_not_committed_twice(tmp_path):
    """The manifest's save fails once (ENOSPC on its temporary file) after the part was
    written: the retry commits those rows once, not as a second part."""
    options = job(tmp_path, commit_rows=1000)
    with Faults() as counting:
        assert run_fake(job(tmp_path / "count", commit_rows=1000)) == 0
    # the final commit: part fsync, part rename, folder fsync, then the manifest's fsync
    manifest_fsync = counting.steps - 2
    with Faults(at=manifest_fsync, error=errno.ENOSPC):
        with pytest.raises(OutputFailed, match="No space left on device"):
            run_fake(options)
    assert ids(tmp_path / "out") == list(range(ROWS))
    manifest = OutputDir(tmp_path / "out").read_manifest()
    assert [p["input_rows"] for p in manifest.parts] == [ROWS]
    assert run_fake(options) == 0 and ids(tmp_path / "out") == list(range(ROWS))


def test_a_full_disk_is_one_line_naming_the_cause(tmp_path):
    options = ["--model", "stand-in", "-o", str(tmp_path / "out"), "--commit-rows", "7",
               "--no-progress", "--max-tokens", "2"]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"row {i}"}) + "\n" for i in range(ROWS)))
    import batchinfer.job.runner as runner
    real = runner.run_job
    fake = lambda options, *a, **k: real(options, lambda m, kw: FakeEngine(2), *a, **k)  # noqa: E731
    runner_patch = pytest.MonkeyPatch()
    runner_patch.setattr(runner, "run_job", fake)
    try:
        with Faults(at=12, error=errno.ENOSPC, persistent=True):
            result = CliRunner().invoke(run, [str(path), *options])
        assert result.exit_code == 1, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and "No space left on device" in lines[0]
        assert "rows are committed" in lines[0] and "Traceback" not in result.output
        with Faults(at=1, error=errno.EROFS, persistent=True):  # unwritable from the start
            result = CliRunner().invoke(run, [str(path), *options])
        assert result.exit_code == 2 and "Read-only file system" in result.output
        assert len(result.output.strip().splitlines()) == 1
    finally:
        runner_patch.undo()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["commit", "merge", "shard", "retry"])
def test_a_kill_at_any_step_keeps_every_row_exactly_once(tmp_path, mode):
    """SIGKILL at each file operation of a job's commits, of a merge, of a shard's run,
    and of a job whose rows take several attempts, in turn: readers never see a row twice,
    and the restart ends with every row exactly once."""
    proc = subprocess.run([sys.executable, str(HERE / "kill_sweep.py"), str(tmp_path), mode],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(results) > 15 and results[-1]["outcome"] == "done"
    for r in results:
        seen = r["seen_after_kill"]
        assert r["outcome"] in ("killed", "done"), r
        assert len(seen) == len(set(seen)) and set(seen) <= set(range(12)), r
        assert r["restart"] == "done" and r["rows_after_restart"] == list(range(12)), r


def test_missing_and_damaged_parts_are_computed_again(tmp_path):
    assert run_fake(job(tmp_path)) == 0
    out = tmp_path / "out"
    manifest = OutputDir(out).read_manifest()
    first, second, third = (out / p["file"] for p in manifest.parts[:3])
    first.unlink()
    second.write_bytes(second.read_bytes()[:-100])  # truncated
    with open(third, "r+b") as f:  # same size, broken footer
        f.seek(-4, os.SEEK_END)
        f.write(b"PAR0")
    err = io.StringIO()
    assert run_fake(job(tmp_path), err) == 0
    warnings = [line for line in err.getvalue().splitlines() if "warning" in line]
    assert len(warnings) == 3
    assert first.name in warnings[0] and "missing" in warnings[0]
    assert second.name in warnings[1] and "bytes" in warnings[1]
    assert third.name in warnings[2] and "cannot be read" in warnings[2]
    assert ids(out) == list(range(ROWS))
    manifest = OutputDir(out).read_manifest()
    assert manifest.complete and manifest.done == [[0, ROWS]]
    assert {p.name for p in out.glob("*.parquet")} == {p["file"] for p in manifest.parts}


def test_a_damaged_part_from_an_older_version_is_named(tmp_path):
    """A part listed without its input rows cannot be recomputed: the job says so."""
    assert run_fake(job(tmp_path)) == 0
    out = OutputDir(tmp_path / "out")
    manifest = out.read_manifest()
    for entry in manifest.parts:
        del entry["ranges"], entry["bytes"]
    out.save(manifest)
    (out.path / manifest.parts[0]["file"]).unlink()
    with pytest.raises(JobError, match="does not say which input rows"):
        run_fake(job(tmp_path))


def test_parquet_files_without_a_manifest_are_not_deleted(tmp_path):
    assert run_fake(job(tmp_path)) == 0
    out = tmp_path / "out"
    (out / "__batchinfer__" / "manifest.json").unlink()
    parts = sorted(out.glob("*.parquet"))
    with pytest.raises(JobError, match="no __batchinfer__/manifest.json"):
        run_fake(job(tmp_path))
    assert sorted(out.glob("*.parquet")) == parts
    assert run_fake(job(tmp_path, overwrite=True)) == 0
    assert ids(out) == list(range(ROWS))


def test_outdir_is_locked_before_it_is_looked_at(tmp_path, monkeypatch):
    """Another job finishing between this job's look at OUTDIR and its first write would
    have its output deleted: the look happens with the lock held, so the other job waits
    its turn and is refused."""
    other = job(tmp_path / "other", output=tmp_path / "out")
    check = OutputDir.check
    refused = []

    def check_while_another_job_runs(self, *args, **kwargs):
        try:
            run_fake(other)
        except JobError as e:
            refused.append(str(e))
        return check(self, *args, **kwargs)

    monkeypatch.setattr(OutputDir, "check", check_while_another_job_runs)
    assert run_fake(job(tmp_path)) == 0
    assert refused and "another batchinfer process" in refused[0]
    assert ids(tmp_path / "out") == list(range(ROWS))


def test_a_symlink_at_the_lock_is_not_followed(tmp_path):
    assert run_fake(job(tmp_path, limit=5)) == 0
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    lock = tmp_path / "out" / "__batchinfer__" / "lock"
    lock.unlink()
    lock.symlink_to(victim)
    with pytest.raises(JobError, match="symbolic link"):
        run_fake(job(tmp_path))
    assert victim.read_text() == "keep me"


def test_sighup_commits_and_exits_like_sigterm(tmp_path):
    """SIGHUP (a closed terminal) stops the job after the current step; finished rows are
    committed and the exit code is 128 + 1."""
    script = textwrap.dedent(f"""
        import io, json, sys, time
        sys.path.insert(0, {str(HERE)!r})
        from batchinfer.job.options import JobOptions
        from batchinfer.job.runner import run_job
        from fake_engine import FakeEngine

        class Slow(FakeEngine):
            def step(self):
                time.sleep(0.05)
                return super().step()

        options = JobOptions(input={str(tmp_path / "in.jsonl")!r}, model="stand-in",
                             output={str(tmp_path / "out")!r}, max_tokens=2, progress=False,
                             commit_rows=2)
        sys.exit(run_job(options, lambda m, k: Slow(1)).exit_code)
    """)
    (tmp_path / "in.jsonl").write_text(
        "".join(json.dumps({"prompt": f"row {i}"}) + "\n" for i in range(400)))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    manifest = tmp_path / "out" / "__batchinfer__" / "manifest.json"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if manifest.exists() and json.loads(manifest.read_text())["parts"]:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGHUP)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGHUP, stderr
    assert "stopped by SIGHUP" in stderr
    done = json.loads(manifest.read_text())["done"]
    committed = sum(e - s for s, e in done)
    assert 0 < committed < 400 and len(ids(tmp_path / "out")) == committed



def test_merge_keeps_the_samples_of_a_row_in_one_file(tmp_path):
    """With n > 1 a merged file may not end between two samples of one input row: the
    rows a file is recorded to hold must be whole there, or recomputing them after the
    file is lost would write the samples kept elsewhere again."""
    from batchinfer.job.merge import merge_parts
    assert run_fake(job(tmp_path, n=3, commit_rows=4)) == 0
    out = OutputDir(tmp_path / "out")
    assert merge_parts(out, rows_per_file=5)[1] > 1
    manifest = out.read_manifest()
    for entry in manifest.parts:
        table = ds.dataset(out.path / entry["file"]).to_table()
        assert sorted(table.column("sample_index").to_pylist()) == \
            sorted(list(range(3)) * entry["input_rows"])
    lost = manifest.parts[1]
    (out.path / lost["file"]).unlink()
    assert run_fake(job(tmp_path, n=3, commit_rows=4)) == 0
    rows = ds.dataset(out.path).to_table(columns=["id", "sample_index"]).to_pylist()
    assert sorted((r["id"], r["sample_index"]) for r in rows) == \
        [(i, s) for i in range(ROWS) for s in range(3)]


def test_a_merged_file_split_again_records_the_rows_it_holds(tmp_path):
    """Parts hold their rows in input order, a merged file part after part: a second merge
    that splits it must record each new file's rows as they are in it, so that losing one
    recomputes exactly its rows."""
    from batchinfer.job.merge import merge_parts
    # the reorder window hands rows out of input order: parts hold interleaved ranges
    assert run_fake(job(tmp_path, commit_rows=4, reorder_window=16)) == 0
    out = OutputDir(tmp_path / "out")
    assert merge_parts(out)[1] == 1
    assert merge_parts(out, rows_per_file=11)[1] == 3
    for entry in out.read_manifest().parts:
        held = ds.dataset(out.path / entry["file"]).to_table(columns=["id"]).column("id")
        recorded = [i for start, end in entry["ranges"] for i in range(start, end)]
        assert held.to_pylist() == recorded
    lost = out.read_manifest().parts[0]
    (out.path / lost["file"]).unlink()
    assert run_fake(job(tmp_path, commit_rows=4, reorder_window=16)) == 0
    assert ids(out.path) == list(range(ROWS))


def test_a_part_that_cannot_be_read_for_a_moment_is_kept(tmp_path, monkeypatch):
    """An I/O error while a part's footer is checked (EIO, a stale NFS handle) says so and
    changes nothing; only a part that is missing, resized or not Parquet is dropped, and a
    damaged one is kept aside in __batchinfer__/damaged/."""
    import pyarrow.parquet as pq
    assert run_fake(job(tmp_path)) == 0
    out = tmp_path / "out"
    before = (out / "__batchinfer__" / "manifest.json").read_text()
    real = pq.read_metadata
    calls = []

    def flaky(path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.EIO, "Input/output error")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(pq, "read_metadata", flaky)
    with pytest.raises(JobError, match="Input/output error.*nothing was changed"):
        run_fake(job(tmp_path))
    monkeypatch.setattr(pq, "read_metadata", real)
    assert (out / "__batchinfer__" / "manifest.json").read_text() == before
    assert ids(out) == list(range(ROWS))
    damaged = out / OutputDir(out).read_manifest().parts[0]["file"]
    damaged.write_bytes(damaged.read_bytes()[:-4] + b"PAR0")  # the same size, no footer
    err = io.StringIO()
    assert run_fake(job(tmp_path), err) == 0
    assert "moved to __batchinfer__/damaged/" in err.getvalue()
    assert (out / "__batchinfer__" / "damaged" / damaged.name).exists()
    assert ids(out) == list(range(ROWS))
