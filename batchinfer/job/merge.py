"""`batchinfer merge OUTDIR`: compact many part files into one or a few.

The merged files are written under new part names (temporary name, fsync, rename), then
the manifest is replaced to list them instead of the old parts, then the old parts are
deleted. A crash at any point leaves either the old or the new set listed; the unlisted
one is removed as orphans by the next run or merge. Which input rows are done does not
change, so a job can be merged part way and resumed after.
"""
from __future__ import annotations

import os

import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchinfer.job.errors import JobError
from batchinfer.job.manifest import OutputDir, fsync_dir
from batchinfer.job.schema import schema_from_json


def merge_parts(outdir: OutputDir, rows_per_file: int = 1_000_000) -> tuple[int, int]:
    """Rewrite the parts of `outdir` into files of about `rows_per_file` rows each.
    Returns (parts before, parts after)."""
    if rows_per_file < 1:
        raise JobError(f"--rows-per-file must be >= 1, got {rows_per_file}")
    manifest = outdir.read_manifest()
    if manifest is None:
        raise JobError(f"{outdir.path} holds no batchinfer output (no {outdir.manifest_path})")
    outdir.open(manifest, fresh=False)
    try:
        old = outdir.part_paths(manifest)
        if len(old) <= 1:
            return len(old), len(old)
        schema = schema_from_json(manifest.output_schema)
        new_parts: list[dict] = []
        writer = None
        current: dict = {}

        def finish() -> None:
            nonlocal writer
            writer.close()
            handle.flush()
            os.fsync(handle.fileno())
            handle.close()
            os.replace(outdir.path / f".{current['file']}.tmp", outdir.path / current["file"])
            new_parts.append(dict(current))
            writer = None

        for path in old:
            for batch in pq.ParquetFile(path).iter_batches(batch_size=65536):
                if writer is None:
                    current = {"file": outdir.new_part_name(manifest), "rows": 0, "input_rows": 0}
                    handle = open(outdir.path / f".{current['file']}.tmp", "wb")
                    writer = pq.ParquetWriter(handle, schema, compression="zstd")
                writer.write_batch(batch.cast(schema) if batch.schema != schema else batch)
                current["rows"] += batch.num_rows
                current["input_rows"] += pc.sum(pc.equal(batch.column("sample_index"), 0)).as_py() or 0
                if current["rows"] >= rows_per_file:
                    finish()
        if writer is not None:
            finish()
        fsync_dir(outdir.path)
        manifest.parts = new_parts
        outdir.save(manifest)
        for path in old:
            path.unlink()
        fsync_dir(outdir.path)
        return len(old), len(new_parts)
    finally:
        outdir.close()
