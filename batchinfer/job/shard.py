"""Which input rows one of several independent job processes takes (--num-shards N,
--shard-index I), e.g. the tasks of a Slurm job array.

Rows are dealt out in blocks of BLOCK_ROWS: block b goes to shard b % N. Blocks keep
neighbouring rows (which often share a prompt prefix) in one process, and interleaving
spreads the input over the shards without knowing its length in advance. Each shard writes
its own output directory, OUTDIR/shard-IIIII-of-NNNNN, a complete job output of its own
(resumable, mergeable); together they are the job's Parquet dataset.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchinfer.job.errors import JobError
from batchinfer.job.manifest import META_DIR, OutputDir, fingerprint, real_differences

BLOCK_ROWS = 1024


@dataclass(frozen=True)
class Shard:
    index: int
    count: int

    def owns(self, row: int) -> bool:
        return (row // BLOCK_ROWS) % self.count == self.index

    def next_owned(self, row: int) -> int:
        """The first row >= row this shard owns."""
        block = row // BLOCK_ROWS
        ahead = (self.index - block) % self.count
        return row if ahead == 0 else (block + ahead) * BLOCK_ROWS

    def rows_below(self, total: int) -> int:
        """How many of rows [0, total) this shard owns."""
        full, rest = divmod(total, BLOCK_ROWS)
        owned = (full // self.count + (1 if self.index < full % self.count else 0)) * BLOCK_ROWS
        return owned + (rest if full % self.count == self.index else 0)

    def directory(self, output: str | Path) -> Path:
        return Path(output) / f"shard-{self.index:05d}-of-{self.count:05d}"


_SHARD_DIR = re.compile(r"shard-(\d{5,})-of-(\d{5,})")


def shard_dirs(output: str | Path) -> list[Path]:
    """The shard directories in OUTDIR, in order."""
    path = Path(output).expanduser()
    if not path.is_dir():
        return []
    return sorted(p for p in path.iterdir() if _SHARD_DIR.fullmatch(p.name) and p.is_dir())


def check_layout(output: str | Path, shard: Shard | None, job: dict[str, Any]) -> None:
    """OUTDIR holds one kind of output: one job's, or the shards of one split of one job
    (`job`, the description its manifests record)."""
    path = Path(output).expanduser()
    if path.exists() and not path.is_dir():
        raise JobError(f"--output {path} is a file, not a directory")
    if not path.is_dir():
        return
    shards = {p: int(_SHARD_DIR.fullmatch(p.name).group(2)) for p in shard_dirs(path)}
    counts = set(shards.values())
    if shard is None:
        if counts:
            raise JobError(f"--output {path} holds the shards of a {max(counts)}-way split; run "
                           f"with --num-shards {max(counts)} --shard-index I, or choose another "
                           "--output")
        return
    if (path / META_DIR).is_dir():
        raise JobError(f"--output {path} holds the output of an unsharded job (--overwrite "
                       "does not change the layout); choose another --output")
    other = counts - {shard.count}
    if other:
        raise JobError(f"--output {path} holds the shards of a {max(other)}-way split, "
                       f"not {shard.count}; use --num-shards {max(other)} or another --output")
    # a sibling shard that wrote rows must be the same job, or OUTDIR would mix two jobs
    mine = {k: v for k, v in job.items() if k != "shard"}
    for directory in sorted(shards):
        if directory == shard.directory(path):
            continue
        manifest = OutputDir(directory).read_manifest()
        if manifest is None or not manifest.parts:
            continue
        theirs = {k: v for k, v in manifest.job.items() if k != "shard"}
        # (compared as JSON: tuples read back as lists)
        diffs = [] if fingerprint(theirs) == fingerprint(mine) else \
            real_differences(theirs, mine)
        if diffs:
            diff = ", ".join(diffs)
            raise JobError(f"--output {path}: {directory.name} holds rows of a different job "
                           f"({diff} differ); run the same job in every shard, or choose "
                           "another --output")
