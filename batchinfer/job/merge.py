"""`batchinfer merge OUTDIR`: compact many part files into one or a few.

The merged files are written under new part names (temporary name, fsync, rename), then
the manifest is replaced to list them instead of the old parts, then the old parts are
deleted. A crash at any point leaves either the old or the new set listed; the unlisted
one is removed as orphans by the next run or merge. Which input rows are done does not
change, so a job can be merged part way and resumed after.
"""
from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchinfer.job.errors import JobError
from batchinfer.job.manifest import SAMPLED_FIRST, OutputDir, fsync_dir
from batchinfer.job.schema import schema_from_json


class _MergedFile:
    """One output file being written under its temporary name."""

    def __init__(self, folder: Path, name: str, schema: pa.Schema):
        self.final = folder / name
        self.tmp = folder / f".{name}.tmp"
        self.handle = open(self.tmp, "wb")
        self.writer = pq.ParquetWriter(self.handle, schema, compression="zstd")
        self.entry = {"file": name, "rows": 0, "input_rows": 0}

    def write(self, batch: pa.RecordBatch) -> None:
        self.writer.write_batch(batch)
        self.entry["rows"] += batch.num_rows
        first_samples = pc.equal(batch.column("sample_index"), 0)
        self.entry["input_rows"] += pc.sum(first_samples, min_count=0).as_py()

    def close(self) -> dict:
        self.writer.close()
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.handle.close()
        os.replace(self.tmp, self.final)
        return self.entry


def merge_parts(outdir: OutputDir, rows_per_file: int = 1_000_000) -> tuple[int, int]:
    """Rewrite the parts of `outdir` into files of at most `rows_per_file` rows each.
    Returns (parts before, parts after)."""
    if rows_per_file < 1:
        raise JobError(f"--rows-per-file must be >= 1, got {rows_per_file}")
    manifest = outdir.read_manifest()
    if manifest is None:
        raise JobError(f"{outdir.path} holds no batchinfer output (no {outdir.manifest_path})")
    outdir.open(manifest, fresh=False)
    try:
        old = outdir.part_paths(manifest)
        if not old or (len(old) == 1 and manifest.parts[0]["rows"] <= rows_per_file):
            return len(old), len(old)  # already as asked
        schema = schema_from_json(manifest.output_schema)
        merged: list[dict] = []
        current: _MergedFile | None = None
        for path in old:
            for batch in pq.ParquetFile(path).iter_batches(batch_size=65536):
                if batch.schema != schema:
                    batch = batch.cast(schema)
                while batch.num_rows:
                    if current is None:
                        current = _MergedFile(outdir.path, outdir.new_part_name(manifest), schema)
                    piece = batch.slice(0, rows_per_file - current.entry["rows"])
                    batch = batch.slice(piece.num_rows)
                    current.write(piece)
                    if current.entry["rows"] >= rows_per_file:
                        merged.append(current.close())
                        current = None
        if current is not None:
            merged.append(current.close())
        if all(p.get("logprobs_order") == SAMPLED_FIRST for p in manifest.parts):
            for entry in merged:
                entry["logprobs_order"] = SAMPLED_FIRST
        fsync_dir(outdir.path)
        manifest.parts = merged
        outdir.save(manifest)
        for path in old:
            path.unlink()
        fsync_dir(outdir.path)
        return len(old), len(merged)
    finally:
        outdir.close()
