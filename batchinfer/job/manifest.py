"""OUTDIR: Parquet part files plus a manifest, committed so that a kill loses nothing finished.

Layout (non-Parquet files live under `__batchinfer__/`, a name both pyarrow.dataset and
`datasets` skip, so `OUTDIR` reads as a plain Parquet dataset):

    OUTDIR/part-000000-1a2b3c4d.parquet ...     committed parts
    OUTDIR/.part-...parquet.tmp                 a part being written (never read)
    OUTDIR/__batchinfer__/manifest.json         the parts, the finished row indices, the job
    OUTDIR/__batchinfer__/summary.json          stats of all rows so far
    OUTDIR/__batchinfer__/lock                  held (flock) by the process writing OUTDIR

A part is written under a temporary name, fsynced and renamed; then the manifest, which
lists it and the input rows it holds, is replaced the same way. Only the manifest says what
is done: a part it does not list is left over from a crash and is deleted on the next start.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

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
    parts: list[dict[str, Any]] = field(default_factory=list)  # file, rows, input_rows
    done: list[list[int]] = field(default_factory=list)        # RangeSet.ranges()
    next_part: int = 0
    runs: list[dict[str, Any]] = field(default_factory=list)   # started, wall_s, input_rows
    complete: bool = False
    version: int = MANIFEST_VERSION

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        data = json.loads(text)
        if data.get("version") != MANIFEST_VERSION:
            raise ValueError(f"manifest version {data.get('version')!r} is not {MANIFEST_VERSION}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)


def fingerprint(job: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(job, sort_keys=True, default=str).encode()).hexdigest()


def real_differences(recorded: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The settings that make `new` another job than the `recorded` one, leaving out what
    only looks different: a setting the record does not hold (a job description that names
    fewer things is taken as agreeing on the rest), except a sampling setting that `new`
    gives a value (added since the record was made, it would change the rows still to
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
            if name.startswith("sampling.") and value(new, name) not in (None, False, [], {}):
                out.append(name)
            continue
        if name in ("model", "tokenizer") and same_dir(recorded[name], new[name]):
            continue
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


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replace `path` with `data`: temporary file in the same folder, fsync, rename."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


class OutputDir:
    """The output folder of one job; `open()` takes its lock."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).expanduser()
        self.meta = self.path / META_DIR
        self.manifest_path = self.meta / "manifest.json"
        self.summary_path = self.meta / "summary.json"
        self.openai_path = self.meta / "openai_output.jsonl"
        self._lock_file = None

    def read_manifest(self) -> Manifest | None:
        if not self.manifest_path.is_file():
            return None
        try:
            return Manifest.from_json(self.manifest_path.read_text())
        except (ValueError, TypeError, KeyError) as e:
            raise JobError(f"{self.manifest_path} is damaged ({e}); move OUTDIR away or pass "
                           "--overwrite to start over")

    def check(self, job: dict[str, Any], overwrite: bool) -> Manifest | None:
        """The manifest to continue from, None to start fresh; JobError if OUTDIR belongs
        to another job (unless `overwrite`) or to something that is not a batchinfer job."""
        if self.path.exists() and not self.path.is_dir():
            raise JobError(f"--output {self.path} is a file, not a directory")
        if not self.path.exists() or not any(self.path.iterdir()):
            return None
        manifest = self.read_manifest() if not overwrite else None
        if manifest is None:
            if not self.meta.is_dir():
                raise JobError(f"--output {self.path} is not empty and holds no batchinfer "
                               "output; choose a new or empty directory")
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

    def open(self, manifest: Manifest, fresh: bool) -> None:
        """Take the lock; on a fresh start remove earlier output, else remove orphans."""
        self.meta.mkdir(parents=True, exist_ok=True)
        self._lock_file = open(self.meta / "lock", "w")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            self._lock_file = None
            raise JobError(f"another batchinfer process is writing to {self.path}; wait for "
                           "it to finish or choose another --output") from None
        if fresh:
            for p in (self.manifest_path, self.summary_path, self.openai_path):
                p.unlink(missing_ok=True)
        self.remove_orphans(manifest)
        self.save(manifest)

    def close(self) -> None:
        if self._lock_file is not None:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()
            self._lock_file = None

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
        return removed

    def new_part_name(self, manifest: Manifest) -> str:
        name = f"part-{manifest.next_part:06d}-{secrets.token_hex(4)}.parquet"
        manifest.next_part += 1
        return name

    def write_part(self, table: pa.Table, name: str) -> None:
        """Write a Parquet file under its final name, atomically and durably."""
        final = self.path / name
        tmp = self.path / f".{name}.tmp"
        with open(tmp, "wb") as f:
            pq.write_table(table, f, compression="zstd")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_dir(self.path)

    def commit(self, manifest: Manifest, table: pa.Table, num_input_rows: int,
               done: RangeSet) -> None:
        """Add a part holding `num_input_rows` input rows; `done` already includes them.
        The rows count as finished once the manifest is replaced."""
        name = self.new_part_name(manifest)
        self.write_part(table, name)
        manifest.done = done.ranges()
        manifest.parts.append({"file": name, "rows": table.num_rows,
                               "input_rows": num_input_rows, "logprobs_order": SAMPLED_FIRST})
        self.save(manifest)

    def save(self, manifest: Manifest) -> None:
        atomic_write_bytes(self.manifest_path, manifest.to_json().encode())

    def part_paths(self, manifest: Manifest) -> list[Path]:
        return [self.path / p["file"] for p in manifest.parts]

    def parts_with_sampled_first(self, manifest: Manifest) -> list[tuple[Path, bool]]:
        """Each part, and whether its logprobs lists start with the sampled token (a part
        without the mark lists them by rank: its sampled token cannot be told apart)."""
        return [(self.path / p["file"], p.get("logprobs_order") == SAMPLED_FIRST)
                for p in manifest.parts]


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
