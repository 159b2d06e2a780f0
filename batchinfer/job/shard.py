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

from batchinfer.job.errors import JobError

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


_SHARD_DIR = re.compile(r"shard-(\d{5})-of-(\d{5})")


def check_layout(output: str | Path, shard: Shard | None) -> None:
    """OUTDIR holds one kind of output: one job's, or the shards of one split."""
    path = Path(output).expanduser()
    if not path.is_dir():
        return
    counts = {int(m.group(2)) for p in path.iterdir() if (m := _SHARD_DIR.fullmatch(p.name))}
    if shard is None and counts:
        raise JobError(f"--output {path} holds the shards of a {max(counts)}-way split; run "
                       f"with --num-shards {max(counts)} --shard-index I, or choose another "
                       "--output")
    if shard is not None:
        if (path / "__batchinfer__").is_dir():
            raise JobError(f"--output {path} holds the output of an unsharded job; choose "
                           "another --output for a sharded run")
        other = counts - {shard.count}
        if other:
            raise JobError(f"--output {path} holds the shards of a {max(other)}-way split, "
                           f"not {shard.count}; use --num-shards {max(other)} or another "
                           "--output")
