"""OUTDIR: Parquet part files plus a manifest, committed so that a kill loses nothing finished.

Layout (non-Parquet files live under `__batchinfer__/`, a name both pyarrow.dataset and
`datasets` skip, so `OUTDIR` reads as a plain Parquet dataset):

    OUTDIR/part-000000-1a2b3c4d.parquet ...     committed parts
    OUTDIR/.part-...parquet.tmp                 a part being written (never read)
    OUTDIR/__batchinfer__/manifest.json         the parts, the finished row indices, the job
    OUTDIR/__batchinfer__/summary.json          stats of all rows so far
    OUTDIR/__batchinfer__/lock                  held (flock) by the process writing OUTDIR
    OUTDIR/__batchinfer__/merging/              merged files not yet moved into OUTDIR

A part is written under a temporary name, fsynced and renamed; then the manifest, which
lists it and the input rows it holds, is replaced the same way. Only the manifest says what
is done: a part it does not list is left over from a crash and is deleted on the next start.
A commit that fails leaves the manifest, in memory and on disk, as it was before it.
On a restart the listed parts are checked (present, of the size written, a readable footer
with the rows written); the rows of one that is not are computed again.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchinfer.job.durable import (NotSynced, atomic_write_bytes, fsync_dir, os_error_message,
                                     remove_quietly, write_durably)
from batchinfer.job.errors import JobError
from batchinfer.job.rangeset import RangeSet

META_DIR = "__batchinfer__"
MANIFEST_VERSION = 1

# the order of each token's logprobs entries in a part: the sampled token first
SAMPLED_FIRST = "sampled_first"


@dataclass
class Manifest:
    fingerprint: str
    job: dict[str, Any]                 # what the fingerprint was made of, for messages
    prompt: dict[str, Any]              # PromptSpec.as_dict()
    input_schema: str                   # schema.schema_to_json of the input columns
    json_columns: list[str]
    output_schema: str
    num_input_rows: int | None
    # file, rows, input_rows, bytes, ranges (the input rows it holds: runs [start, end) in
    # the order the file holds them)
    parts: list[dict[str, Any]] = field(default_factory=list)
    done: list[list[int]] = field(default_factory=list)        # RangeSet.ranges()
    next_part: int = 0
    runs: list[dict[str, Any]] = field(default_factory=list)   # started, wall_s, input_rows
    complete: bool = False
    version: int = MANIFEST_VERSION
    # a merge that switched the manifest to its files but has not finished moving them in
    # ({"move": [names under merging/], "remove": [replaced parts]}); see finish_merge
    merging: dict[str, list[str]] | None = None

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        data = json.loads(text)
        if data.get("version") != MANIFEST_VERSION:
            raise ValueError(f"manifest version {data.get('version')!r} is not {MANIFEST_VERSION}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)


def digest_of_text(text: str | None) -> str | None:
    """How a job records a text it read from a file: by digest, never the text itself."""
    return None if text is None else "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def fingerprint(job: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(job, sort_keys=True, default=str).encode()).hexdigest()


def real_differences(recorded: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The settings that make `new` another job than the `recorded` one, leaving out what
    only looks different: a setting the record does not hold (a job description that names
    fewer things is taken as agreeing on the rest), except a sampling or row setting
    (templates, sampling columns) that `new` gives a value (added since the record was made, it would change the rows still to
    come), a model or tokenizer path naming the same directory, and input files recorded
    without a content digest that agree on path and size."""
    def same_dir(a: Any, b: Any) -> bool:
        return (isinstance(a, str) and isinstance(b, str) and Path(a).expanduser().is_dir()
                and Path(a).expanduser().resolve() == Path(b).expanduser().resolve())

    def recorded_holds(name: str) -> bool:
        at: Any = recorded
        for key in name.split("."):
            if not isinstance(at, dict) or key not in at:
                return False
            at = at[key]
        return True

    def value(job: dict[str, Any], name: str) -> Any:
        for key in name.split("."):
            job = job.get(key) if isinstance(job, dict) else None
        return job

    out = []
    for name in job_differences(recorded, new):
        if not recorded_holds(name):
            if name.startswith(("sampling.", "rows.")) and value(new, name) not in (
                    None, False, [], {}):
                out.append(name)
            continue
        if name in ("model", "tokenizer") and same_dir(recorded[name], new[name]):
            continue
        if name in ("system_prompt", "chat_template") and isinstance(recorded[name], str) \
                and digest_of_text(recorded[name]) == new[name]:
            continue  # recorded as text by an older version, now by digest
        if name == "input.files":
            old_files, new_files = recorded["input"]["files"], new["input"]["files"]
            width = min((len(f) for f in old_files), default=3)
            if [f[:width] for f in old_files] == [f[:width] for f in new_files]:
                continue
        out.append(name)
    return out


def job_differences(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted names of the settings that differ between two job descriptions."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += job_differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(prefix + key)
    return out


class OutputDir:
    """The output folder of one job. `lock()` first, then `check()` and `prepare()`."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).expanduser()
        self.meta = self.path / META_DIR
        self.manifest_path = self.meta / "manifest.json"
        self.summary_path = self.meta / "summary.json"
        self.openai_path = self.meta / "openai_output.jsonl"
        self.merging = self.meta / "merging"
        self._lock_fd: int | None = None
        self._created: list[Path] = []  # folders lock() made, removed if nothing follows

    def read_manifest(self) -> Manifest | None:
        if not self.manifest_path.is_file():
            return None
        try:
            return Manifest.from_json(self.manifest_path.read_text())
        except (ValueError, TypeError, KeyError) as e:
            raise JobError(f"{self.manifest_path} is damaged ({e}); move OUTDIR away or pass "
                           "--overwrite to start over")

    def lock(self) -> None:
        """Take the folder's lock (creating the folder), so that what `check` finds stays
        true until `close`. JobError if another process holds it, or if the folder is a
        file or holds files of something other than a batchinfer job."""
        if self.path.exists() and not self.path.is_dir():
            raise JobError(f"--output {self.path} is a file, not a directory")
        if self.path.is_dir() and not self.meta.is_dir() and any(self.path.iterdir()):
            raise JobError(f"--output {self.path} is not empty and holds no batchinfer "
                           "output; choose a new or empty directory")
        self._created = [p for p in (self.meta, *self.meta.parents) if not p.exists()]
        try:
            self.meta.mkdir(parents=True, exist_ok=True)
            # no O_TRUNC and no following a symbolic link: the lock file is never written
            fd = os.open(self.meta / "lock",
                         os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise JobError(f"--output: {self.meta / 'lock'} is a symbolic link; remove "
                               "it") from None
            raise JobError(f"--output: cannot write {os_error_message(e)}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # a lock file removed (close() of a start that made the folder) between our
            # open and our lock is no longer the folder's lock
            if os.fstat(fd).st_ino != os.stat(self.meta / "lock", follow_symlinks=False).st_ino:
                raise BlockingIOError
        except (BlockingIOError, FileNotFoundError):
            os.close(fd)
            raise JobError(f"another batchinfer process is writing to {self.path}; wait for "
                           "it to finish or choose another --output") from None
        self._lock_fd = fd

    def check(self, job: dict[str, Any], overwrite: bool) -> Manifest | None:
        """The manifest to continue from, None to start fresh; JobError if OUTDIR belongs
        to another job (unless `overwrite`). Call with the lock held."""
        manifest = self.read_manifest() if not overwrite else None
        if manifest is None:
            if not overwrite and any(self.path.glob("*.parquet")):
                raise JobError(f"--output {self.path} holds Parquet files but no "
                               f"{META_DIR}/manifest.json saying which job wrote them; pass "
                               "--overwrite to replace them, or choose another --output")
            return None
        diffs = [] if manifest.fingerprint == fingerprint(job) else \
            real_differences(manifest.job, job)
        if diffs:
            if not manifest.parts:
                return None  # a start that failed before finishing any row: nothing to keep
            diff = ", ".join(diffs)
            raise JobError(f"--output {self.path} holds the output of a different job ({diff} "
                           "differ); pass --overwrite to replace it, or choose another --output")
        return manifest

    def prepare(self, manifest: Manifest, fresh: bool) -> list[str]:
        """Make the folder hold exactly what `manifest` lists and save it: on a fresh start
        remove earlier output; else finish an interrupted merge, drop listed parts that are
        missing or damaged (their rows are no longer done) and remove unlisted files.
        Returns a warning per dropped part. Call with the lock held."""
        warnings = []
        try:
            if fresh:  # the new manifest first: a crash from here on leaves this job's
                self.save(manifest)
                for p in (self.summary_path, self.openai_path):
                    p.unlink(missing_ok=True)
                for folder in (self.merging, self.meta / "damaged"):
                    shutil.rmtree(folder, ignore_errors=True)
            else:
                self.finish_merge(manifest)
                warnings = self.drop_damaged_parts(manifest)
            self.remove_orphans(manifest)
            self.save(manifest)
        except OSError as e:
            raise JobError(f"--output: cannot write {os_error_message(e)}") from None
        self._created = []
        return warnings

    def close(self) -> None:
        """Release the lock; a folder that lock() created for a job that never started
        (no prepare) is removed again, lock file and all."""
        if self._lock_fd is None:
            return
        if self._created:
            try:
                (self.meta / "lock").unlink()
                for folder in self._created:
                    folder.rmdir()
            except OSError:
                pass  # something else appeared in it: leave it
            self._created = []
        fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        os.close(self._lock_fd)
        self._lock_fd = None

    def remove_orphans(self, manifest: Manifest) -> list[str]:
        """Delete part files and temporary files the manifest does not list."""
        listed = {p["file"] for p in manifest.parts}
        removed = []
        for p in self.path.iterdir():
            is_part = p.name.startswith("part-") and p.suffix == ".parquet"
            is_tmp = p.name.startswith(".") and p.name.endswith(".tmp")
            if p.is_file() and (is_tmp or (is_part and p.name not in listed)):
                p.unlink()
                removed.append(p.name)
        for p in self.meta.glob(".*.tmp"):
            p.unlink()
        if manifest.merging is None:
            shutil.rmtree(self.merging, ignore_errors=True)
        return removed

    def drop_damaged_parts(self, manifest: Manifest) -> list[str]:
        """Take parts that are missing, of another size than written, or whose footer does
        not read back with the rows written out of `manifest` (their rows are to be done
        again; a damaged file is moved to __batchinfer__/damaged/). Returns a warning naming
        each. An error reading a part that may pass (EIO, EACCES...) changes nothing: it is
        a JobError."""
        kept, warnings = [], []
        done = RangeSet(tuple(r) for r in manifest.done)
        for entry in manifest.parts:
            problem = self._part_problem(entry)
            if problem is None:
                kept.append(entry)
                continue
            path = self.path / entry["file"]
            if "ranges" not in entry:
                raise JobError(f"{path} {problem}, and the manifest does not say which input "
                               "rows it held (an older version wrote it); restore the file, "
                               "or pass --overwrite to start over")
            for start, end in entry["ranges"]:
                done.remove_range(start, end)
            where = ""
            if path.exists():
                (self.meta / "damaged").mkdir(exist_ok=True)
                os.replace(path, self.meta / "damaged" / entry["file"])
                where = f" (moved to {META_DIR}/damaged/)"
            warnings.append(f"{entry['file']} {problem}{where}; its {entry['input_rows']} "
                            "input rows will be computed again")
        if warnings:
            manifest.parts, manifest.done = kept, done.ranges()
            manifest.complete = False
        return warnings

    def _part_problem(self, entry: dict[str, Any]) -> str | None:
        path = self.path / entry["file"]
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return "is missing"
        if "bytes" in entry and size != entry["bytes"]:
            return f"has {size} bytes, not the {entry['bytes']} written"
        try:
            rows = pq.read_metadata(path).num_rows
        except pa.ArrowInvalid as e:  # not Parquet (a damaged footer): not an I/O error
            return f"cannot be read ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
        except OSError as e:
            raise JobError(f"cannot read {path} ({e.strerror or e}) to check it; nothing "
                           "was changed: run again when it can be read") from None
        if rows != entry["rows"]:
            return f"holds {rows} rows, not the {entry['rows']} written"
        return None

    def new_part_name(self, manifest: Manifest) -> str:
        name = f"part-{manifest.next_part:06d}-{secrets.token_hex(4)}.parquet"
        manifest.next_part += 1
        return name

    def write_part(self, table: pa.Table, name: str, folder: Path | None = None) -> int:
        """Write a Parquet file under its final name in `folder` (OUTDIR by default),
        atomically and durably; returns its size."""
        folder = folder or self.path
        final, tmp = folder / name, folder / f".{name}.tmp"
        write_durably(tmp, lambda f: pq.write_table(table, f, compression="zstd"))
        try:
            os.replace(tmp, final)
            fsync_dir(folder)
        except BaseException:
            remove_quietly(tmp)
            remove_quietly(final)
            raise
        return final.stat().st_size

    def commit(self, manifest: Manifest, table: pa.Table, rows: RangeSet,
               done: RangeSet) -> None:
        """Add a part holding the input rows `rows`; `done` already includes them. The rows
        count as finished once the manifest is replaced. On failure `manifest` is as it
        was, and so is OUTDIR, unless NotSynced is raised: then the part is committed and
        only the folder's sync failed."""
        name = self.new_part_name(manifest)
        size = self.write_part(table, name)
        before = manifest.parts, manifest.done
        manifest.parts = [*before[0], {"file": name, "rows": table.num_rows,
                                       "input_rows": len(rows), "bytes": size,
                                       "ranges": rows.ranges(), "logprobs_order": SAMPLED_FIRST}]
        manifest.done = done.ranges()
        try:
            self.save(manifest)
        except NotSynced:
            raise
        except BaseException:
            manifest.parts, manifest.done = before
            remove_quietly(self.path / name)
            raise

    def save(self, manifest: Manifest) -> None:
        atomic_write_bytes(self.manifest_path, manifest.to_json().encode())

    def finish_merge(self, manifest: Manifest) -> None:
        """Complete a merge the manifest was switched to: remove the parts it replaced,
        then move its files from merging/ into OUTDIR. Readers see either set of files,
        or (while it runs) fewer rows, never a row twice."""
        if manifest.merging is None:
            return
        for name in manifest.merging["remove"]:
            (self.path / name).unlink(missing_ok=True)
        fsync_dir(self.path)
        for name in manifest.merging["move"]:
            if (self.merging / name).exists():
                os.replace(self.merging / name, self.path / name)
        fsync_dir(self.path)
        manifest.merging = None
        self.save(manifest)
        shutil.rmtree(self.merging, ignore_errors=True)

    def part_paths(self, manifest: Manifest) -> list[Path]:
        return [self.path / p["file"] for p in manifest.parts]

    def parts_with_sampled_first(self, manifest: Manifest) -> list[tuple[Path, bool]]:
        """Each part, and whether its logprobs lists start with the sampled token (a part
        without the mark lists them by rank: its sampled token cannot be told apart)."""
        return [(self.path / p["file"], p.get("logprobs_order") == SAMPLED_FIRST)
                for p in manifest.parts]


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
