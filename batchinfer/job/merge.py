"""`batchinfer merge OUTDIR`: compact many part files into one or a few.

The merged files are written in OUTDIR/__batchinfer__/merging/ (a folder dataset readers
skip), each under a temporary name, fsynced and renamed; then the manifest is replaced to
list them instead of the old parts, with a note of the merge; then the old parts are
deleted and the merged files moved into OUTDIR (OutputDir.finish_merge). A reader never
sees a row twice. A crash before the manifest is replaced leaves the old parts listed (the
merged files are removed on the next start); a crash after it is finished by the next
run or merge. Which input rows are done does not change, so a job can be merged part way
and resumed after.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchinfer.job.errors import JobError
from batchinfer.job.durable import fsync_dir
from batchinfer.job.manifest import SAMPLED_FIRST, OutputDir
from batchinfer.job.schema import schema_from_json


class _MergedFile:
    """One output file being written under its temporary name."""

    def __init__(self, folder: Path, name: str, schema: pa.Schema):
        self.final = folder / name
        self.tmp = folder / f".{name}.tmp"
        self.handle = open(self.tmp, "wb")
        self.writer = pq.ParquetWriter(self.handle, schema, compression="zstd")
        self.entry = {"file": name, "rows": 0, "input_rows": 0}
        self.runs: list[list[int]] | None = []  # its input rows, in the order it holds them

    def write(self, batch: pa.RecordBatch, source: dict) -> None:
        """Write rows of the file whose input rows not yet written are source["left"]:
        runs of row indices in the order that file holds them (a part written by the job
        holds its rows in input order; a merged file, part after part)."""
        self.writer.write_batch(batch)
        self.entry["rows"] += batch.num_rows
        first_samples = pc.equal(batch.column("sample_index"), 0)
        input_rows = pc.sum(first_samples, min_count=0).as_py()
        self.entry["input_rows"] += input_rows
        if self.runs is not None and source["left"] is not None:
            taken, source["left"] = _take(source["left"], input_rows)
            for start, end in taken:
                if self.runs and self.runs[-1][1] == start:
                    self.runs[-1][1] = end
                else:
                    self.runs.append([start, end])
        else:
            self.runs = None  # a part written by an older version: its rows are not known

    def close(self) -> dict:
        self.writer.close()
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.handle.close()
        os.replace(self.tmp, self.final)
        self.entry["bytes"] = self.final.stat().st_size
        if self.runs is not None:
            self.entry["ranges"] = self.runs
        return self.entry


def _take(runs: list[list[int]], count: int) -> tuple[list[list[int]], list[list[int]]]:
    """The first `count` indices of runs in order, and the runs left."""
    taken: list[list[int]] = []
    for i, (start, end) in enumerate(runs):
        if count <= 0:
            return taken, runs[i:]
        if end - start <= count:
            taken.append([start, end])
            count -= end - start
        else:
            taken.append([start, start + count])
            return taken, [[start + count, end], *runs[i + 1:]]
    return taken, []


def merge_parts(outdir: OutputDir, rows_per_file: int = 1_000_000) -> tuple[int, int]:
    """Rewrite the parts of `outdir` into files of at most `rows_per_file` rows each.
    Returns (parts before, parts after)."""
    if rows_per_file < 1:
        raise JobError(f"--rows-per-file must be >= 1, got {rows_per_file}")
    if not outdir.manifest_path.is_file():
        raise JobError(f"{outdir.path} holds no batchinfer output (no {outdir.manifest_path})")
    outdir.lock()
    try:
        manifest = outdir.read_manifest()
        outdir.prepare(manifest, fresh=False)
        old = manifest.parts
        if not old or (len(old) == 1 and old[0]["rows"] <= rows_per_file):
            return len(old), len(old)  # already as asked
        schema = schema_from_json(manifest.output_schema)
        outdir.merging.mkdir(exist_ok=True)
        merged: list[dict] = []
        current: _MergedFile | None = None
        for entry in old:
            source = {"left": [list(r) for r in entry["ranges"]] if "ranges" in entry else None}
            for batch in pq.ParquetFile(outdir.path / entry["file"]).iter_batches(
                    batch_size=65536):
                if batch.schema != schema:
                    batch = batch.cast(schema)
                first_sample = batch.column("sample_index").to_numpy(zero_copy_only=False) == 0
                while batch.num_rows:
                    full = current is not None and current.entry["rows"] >= rows_per_file
                    if full and first_sample[0]:
                        merged.append(current.close())
                        current = None
                    if current is None:
                        current = _MergedFile(outdir.merging, outdir.new_part_name(manifest),
                                              schema)
                    # a cut only where an input row starts: its samples stay in one file
                    # (the file then holds up to n - 1 rows more than asked)
                    lo = max(rows_per_file - current.entry["rows"], 1)
                    starts = np.flatnonzero(first_sample[lo:])
                    cut = lo + int(starts[0]) if len(starts) else batch.num_rows
                    current.write(batch.slice(0, cut), source)
                    batch, first_sample = batch.slice(cut), first_sample[cut:]
        if current is not None:
            merged.append(current.close())
        if all(p.get("logprobs_order") == SAMPLED_FIRST for p in old):
            for entry in merged:
                entry["logprobs_order"] = SAMPLED_FIRST
        fsync_dir(outdir.merging)
        manifest.parts = merged
        manifest.merging = {"move": [p["file"] for p in merged],
                            "remove": [p["file"] for p in old]}
        outdir.save(manifest)
        outdir.finish_merge(manifest)
        return len(old), len(merged)
    finally:
        outdir.close()
