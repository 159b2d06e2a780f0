"""Inputs: Parquet, JSONL/JSON, CSV, a directory of them, a `datasets.save_to_disk` folder or
`hf:NAME[:SPLIT]` from the local cache — read as streaming batches of rows.

Rows are numbered 0, 1, ... across the whole input (all files of a directory in sorted
order); that index is how a resumed job knows which rows are done. A row that cannot be
parsed (bad JSON, invalid UTF-8, wrong field count, longer than `max_row_bytes`, an
unreadable Parquet row group) is still a row: it comes out with an error and no values, so
the job writes it as a failed row instead of stopping.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchinfer.job.errors import JobError
from batchinfer.job.manifest import META_DIR
from batchinfer.job.rangeset import RangeSet
from batchinfer.job.schema import ColumnTypes, encode_json_columns, storable
from batchinfer.job.shard import BLOCK_ROWS, Shard
from batchinfer.job.text_rows import (MAX_ROW_BYTES, TOO_DEEP, arrow_json_schema, csv_converters,
                                      parse_row, raw_rows, shown_name)

BATCH_ROWS = 1024
FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".ndjson": "json",
           ".csv": "csv"}


@dataclass(slots=True)
class InputRow:
    index: int
    values: dict[str, Any]
    error: str | None = None


@dataclass
class Inspection:
    """What a first look at the input found: its columns, their types, its row count."""
    columns: list[str]
    num_rows: int | None
    types: ColumnTypes | None = None       # row-oriented formats: types per kind of value
    arrow_schema: pa.Schema | None = None  # columnar formats: the stored schema

    def schema(self, restrict: dict[str, str]) -> tuple[pa.Schema, set[str]]:
        if self.arrow_schema is not None:
            schema, json_columns = self.arrow_schema, set()
            for i, field_ in enumerate(self.arrow_schema):
                if not storable(field_.type):  # nested deeper than Parquet readers go
                    schema = schema.set(i, field_.with_type(pa.string()))
                    json_columns.add(field_.name)
                elif field_.name in restrict and pa.types.is_dictionary(field_.type):
                    # a dictionary-encoded prompt column (a pandas Categorical) is read decoded
                    schema = schema.set(i, field_.with_type(field_.type.value_type))
            return schema, json_columns
        return self.types.schema(restrict)


@dataclass
class Source:
    """A resolved input. `inspect()` may read it all once; `batches()` streams it."""
    spec: str
    format: str                       # parquet | json | csv | arrow
    files: list[Path] = field(default_factory=list)
    dataset_path: str | None = None   # arrow: a save_to_disk folder or a hub name
    split: str | None = None
    max_row_bytes: int = MAX_ROW_BYTES
    _identity: dict[str, Any] | None = field(default=None, repr=False, compare=False)
    # columnar inputs: the first dictionary read of each dictionary-typed column, so the
    # writer keeps its order (an ordered pandas Categorical's)
    dictionaries: dict[str, pa.Array] = field(default_factory=dict, repr=False, compare=False)

    def identity(self) -> dict[str, Any]:
        """What names this input in a job's fingerprint (worked out once: it reads a
        little of every file)."""
        if self._identity is None:
            if self.format == "arrow" and not self.files:
                self._identity = {"dataset": self.dataset_path, "split": self.split}
            else:
                self._identity = {
                    "format": self.format, "split": self.split,
                    "files": [[str(p.resolve()), p.stat().st_size, sampled_digest(p)]
                              for p in self.files]}
        return self._identity

    def inspect(self) -> Inspection:
        if self.format == "parquet":
            schemas, rows = [], 0
            for path in self.files:
                with _parquet_file(path) as parquet:
                    schemas.append(parquet.schema_arrow)
                    rows += parquet.metadata.num_rows
            schema = _unify_schemas(schemas, self.spec)
            return Inspection(schema.names, rows, arrow_schema=schema)
        if self.format == "arrow":
            dataset = self._dataset()
            schema = dataset.features.arrow_schema
            return Inspection(schema.names, dataset.num_rows, arrow_schema=schema)
        if self.format == "json":
            fast = arrow_json_schema(self.files, self.max_row_bytes)
            if fast is not None:
                schema, rows = fast
                return Inspection(schema.names, rows, arrow_schema=schema)
        types, rows, batch = ColumnTypes(), 0, []
        for _, raw in self._raw_rows():
            rows += 1
            values, error = self._parse(raw, None)
            if error is None:
                batch.append(values)
                if len(batch) >= BATCH_ROWS:
                    types.observe(batch)
                    batch = []
        types.observe(batch)
        if not types.columns:
            raise JobError(f"{self.spec}: no readable rows (is it a {self.format} file?)")
        return Inspection(types.columns, rows, types=types)

    def batches(self, schema: pa.Schema, json_columns: set[str], done: RangeSet,
                stop: int | None = None, shard: Shard | None = None) -> Iterator[list[InputRow]]:
        """Rows not in `done` with index < `stop` (and owned by `shard`), in input order,
        in batches."""
        if self.format in ("parquet", "arrow"):
            yield from self._columnar_batches(schema, json_columns, done, stop, shard)
            return
        converters = csv_converters(schema) if self.format == "csv" else None
        # a job whose schema names the first CSV column with the byte order mark in front
        # (the mark read as part of the name) continues with that name
        marked = (schema.names[0] if self.format == "csv" and len(schema)
                  and schema.names[0].startswith("\ufeff") else None)
        batch: list[InputRow] = []
        index = -1
        for where, raw in self._raw_rows():
            if marked is not None and isinstance(raw, tuple) and raw[0][0] == marked[1:]:
                raw = ([marked, *raw[0][1:]], raw[1])
            index += 1
            if stop is not None and index >= stop:
                break
            if index in done or (shard is not None and not shard.owns(index)):
                continue
            values, error = self._parse(raw, converters)
            if error is None and json_columns:
                try:
                    encode_json_columns(values, json_columns)
                except RecursionError:
                    error = TOO_DEEP
            if error is not None:
                batch.append(InputRow(index, {}, f"{where[0]}{where[1]}: {error}"))
            else:
                batch.append(InputRow(index, values))
            if len(batch) >= BATCH_ROWS:
                yield batch
                batch = []
        if batch:
            yield batch

    # ---- row-oriented formats --------------------------------------------------------
    def _raw_rows(self) -> Iterator[tuple[tuple[str, int], Any]]:
        """Each row unparsed (or why it cannot be read), with where it is."""
        for path in self.files:
            yield from raw_rows(path, self.format, self.max_row_bytes)

    def _parse(self, raw: Any, converters: dict[str, Callable] | None
               ) -> tuple[dict[str, Any] | None, str | None]:
        return parse_row(self.format, raw, converters)

    # ---- columnar formats ------------------------------------------------------------
    def _columnar_batches(self, schema: pa.Schema, json_columns: set[str], done: RangeSet,
                          stop: int | None, shard: Shard | None) -> Iterator[list[InputRow]]:
        start = 0
        for batch in self._arrow_batches():
            if isinstance(batch, pa.RecordBatch):
                for name, column in zip(batch.schema.names, batch.columns):
                    if pa.types.is_dictionary(column.type) and name not in self.dictionaries:
                        self.dictionaries[name] = column.dictionary
            end = start + batch.num_rows
            first, last = start, end if stop is None else min(end, stop)
            start = end
            if first >= last:
                if stop is not None and first >= stop:
                    return
                continue
            out: list[InputRow] = []
            for a, b in _owned_runs(first, last, shard):
                if done.covers(a, b):
                    continue
                if isinstance(batch, _Unreadable):
                    rows = [InputRow(i, {}, batch.reason) for i in range(a, b)]
                else:
                    rows = _columnar_rows(batch.slice(a - first, b - a), a, schema, json_columns)
                out += [row for row in rows if row.index not in done]
            if out:
                yield out

    def _arrow_batches(self) -> Iterator[pa.RecordBatch | _Unreadable]:
        if self.format == "parquet":
            for path in self.files:
                yield from _parquet_batches(path)
            return
        for table in self._dataset().with_format("arrow").iter(batch_size=BATCH_ROWS):
            yield from table.to_batches()

    def _dataset(self):
        if self.files:
            return _load_from_disk(Path(self.dataset_path), self.split, self.spec)
        return _load_hub_dataset(self.dataset_path, self.split or "train", self.spec)


@dataclass
class _Unreadable:
    """Rows of a Parquet row group that could not be read, and why."""
    num_rows: int
    reason: str


@contextmanager
def _parquet_file(path: Path) -> Iterator[pq.ParquetFile]:
    """The file opened, its footer read; JobError naming it when it is not readable Parquet
    (empty, truncated, not Parquet, a schema nested deeper than Parquet readers go)."""
    try:
        # a file opened here, not a path: pyarrow takes no path whose name is not UTF-8
        source = pa.OSFile(os.fsencode(path))
    except OSError as e:
        raise JobError(f"INPUT {shown_name(path)}: cannot open it: {_first_line(e)}") from None
    with source:
        try:
            parquet = pq.ParquetFile(source)
        except (pa.ArrowException, OSError) as e:
            raise JobError(f"INPUT {shown_name(path)}: not a readable Parquet file: "
                           f"{_first_line(e)}") from None
        yield parquet


def _parquet_batches(path: Path) -> Iterator[pa.RecordBatch | _Unreadable]:
    """The file's rows in batches, row group by row group: a row group that fails to read
    (a corrupt page) gives its unread rows, counted by the footer, as one _Unreadable."""
    with _parquet_file(path) as parquet:
        for group in range(parquet.num_row_groups):
            expected, read = parquet.metadata.row_group(group).num_rows, 0
            try:
                for batch in parquet.iter_batches(BATCH_ROWS, row_groups=[group]):
                    read += batch.num_rows
                    yield batch
            except (pa.ArrowException, OSError) as e:
                yield _Unreadable(expected - read, f"{shown_name(path.name)}: row group {group} "
                                                   f"cannot be read: {_first_line(e)}")


def _first_line(error: Exception) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _owned_runs(first: int, last: int, shard: Shard | None) -> Iterator[tuple[int, int]]:
    """The runs of rows in [first, last) that `shard` owns (all of them without one)."""
    if shard is None:
        yield first, last
        return
    a = shard.next_owned(first)
    while a < last:
        b = min(last, (a // BLOCK_ROWS + 1) * BLOCK_ROWS)
        yield a, b
        a = shard.next_owned(b)


def sampled_digest(path: Path, whole_below: int = 1 << 20, piece: int = 1 << 16,
                   pieces: int = 16) -> str:
    """A digest of a file's content that reads little of a large one: the whole file below
    1 MiB, else 16 evenly spaced 64 KiB pieces (the first and the last among them). An edit
    that keeps the size is seen wherever it touches those."""
    digest = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size <= whole_below:
            digest.update(f.read())
        else:
            for i in range(pieces):
                f.seek((size - piece) * i // (pieces - 1))
                digest.update(f.read(piece))
    return digest.hexdigest()[:16]


def open_input(spec: str, split: str | None = None, *, output: str | None = None,
               max_row_bytes: int = MAX_ROW_BYTES) -> Source:
    """Resolve INPUT (a file, a directory, or hf:NAME[:SPLIT]); no rows are read yet. A
    directory's files leave out the job's `output` folder and any other job's output."""
    path = Path(spec).expanduser()
    spec = shown_name(spec)  # as messages name it
    if spec.startswith("hf:"):
        name, _, hf_split = spec[3:].partition(":")
        if not name:
            raise JobError(f"INPUT {spec!r}: write hf:NAME or hf:NAME:SPLIT")
        return Source(spec, "arrow", dataset_path=name, split=hf_split or split)
    if not path.exists():
        raise JobError(f"INPUT {spec}: no such file or directory")
    if path.is_dir():
        return _open_directory(spec, path, split, output, max_row_bytes)
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise JobError(f"INPUT {spec}: unknown file type {shown_name(path.suffix) or '(none)'}; "
                       "use .parquet, .jsonl, .json or .csv (or a directory of them)")
    return Source(spec, fmt, [path], split=split, max_row_bytes=max_row_bytes)


def _open_directory(spec: str, path: Path, split: str | None, output: str | None,
                    max_row_bytes: int) -> Source:
    files = _files_under(path, Path(output).expanduser().resolve() if output else None)
    if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
        return Source(spec, "arrow", files, dataset_path=str(path), split=split)
    files = [p for p in files if p.suffix.lower() in FORMATS
             and not any(part.startswith((".", "_")) for part in p.relative_to(path).parts)]
    if not files:
        raise JobError(f"INPUT {spec}: the directory holds no .parquet, .jsonl, .json or "
                       ".csv files")
    formats = {FORMATS[p.suffix.lower()] for p in files}
    if len(formats) > 1:
        raise JobError(f"INPUT {spec}: the directory mixes formats ({', '.join(sorted(formats))}); "
                       "give one directory per format")
    return Source(spec, formats.pop(), files, split=split, max_row_bytes=max_row_bytes)


def _files_under(path: Path, output: Path | None) -> list[Path]:
    """The files in `path` and its subfolders, sorted, without the folders of job output:
    `output` (this job's) and any folder holding a batchinfer manifest, whose part files
    would otherwise be read as input (and change it while the job runs)."""
    files = []
    for root, folders, names in os.walk(path):
        folders[:] = [name for name in folders if not _is_job_output(Path(root, name), output)]
        files += [Path(root, name) for name in names if Path(root, name).is_file()]
    return sorted(files)


def _is_job_output(folder: Path, output: Path | None) -> bool:
    return ((folder / META_DIR / "manifest.json").is_file()
            or (output is not None and folder.resolve() == output))


def _unify_schemas(schemas: list[pa.Schema], spec: str) -> pa.Schema:
    try:
        return pa.unify_schemas(schemas, promote_options="permissive")
    except (pa.ArrowException, TypeError) as e:
        raise JobError(f"INPUT {spec}: the Parquet files have incompatible schemas: {e}")


# what converting a value to the job's schema or to Python can raise
_VALUE_ERRORS = (pa.ArrowException, OverflowError, ValueError, NotImplementedError)


def _columnar_rows(batch: pa.RecordBatch, first: int, schema: pa.Schema,
                   json_columns: set[str]) -> list[InputRow]:
    """The batch's rows as InputRows numbered from `first`. A row holding a value that does
    not fit the job's column type (files of a directory whose types were unified) or that
    Python cannot hold (a timestamp past year 9999) is a failed row, not a failed job."""
    try:
        return [InputRow(first + i, values) for i, values in
                enumerate(_python_rows(_conform(batch, schema, json_columns), json_columns))]
    except _VALUE_ERRORS:
        pass
    rows = []
    for i in range(batch.num_rows):
        try:
            values = _python_rows(_conform(batch.slice(i, 1), schema, json_columns),
                                  json_columns)[0]
            rows.append(InputRow(first + i, values))
        except _VALUE_ERRORS as e:
            rows.append(InputRow(first + i, {}, f"a value cannot be read as its column's "
                                                f"type: {_first_line(e)}"))
    return rows


def _python_rows(table: pa.Table, json_columns: set[str]) -> list[dict[str, Any]]:
    rows = table.to_pylist()
    if json_columns:
        for values in rows:
            encode_json_columns(values, json_columns)
    return rows


def _conform(batch: pa.RecordBatch, schema: pa.Schema, json_columns: set[str]) -> pa.Table:
    """The batch with exactly `schema`'s columns and types (missing columns as nulls); a
    JSON-text column keeps the type it has, to be written as JSON text from Python."""
    if batch.schema.equals(schema):
        return pa.Table.from_batches([batch])
    columns, fields = [], []
    for f in schema:
        i = batch.schema.get_field_index(f.name)
        column = batch.column(i) if i >= 0 else pa.nulls(batch.num_rows, f.type)
        if f.name in json_columns:
            f = f.with_type(column.type)
        elif column.type != f.type:
            column = column.cast(f.type)
        columns.append(column)
        fields.append(f)
    return pa.Table.from_arrays(columns, schema=pa.schema(fields, metadata=schema.metadata))


def _load_from_disk(path: Path, split: str | None, spec: str):
    import datasets
    try:
        loaded = datasets.load_from_disk(str(path))
    except (OSError, ValueError) as e:
        raise JobError(f"INPUT {spec}: cannot load the saved dataset: {e}")
    if isinstance(loaded, datasets.DatasetDict):
        return _pick_split(loaded, split, spec)
    return loaded


def _load_hub_dataset(name: str, split: str, spec: str):
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    import datasets
    datasets.config.HF_HUB_OFFLINE = True
    if Path(name).expanduser().is_dir():
        name = str(Path(name).expanduser())
    try:
        loaded = datasets.load_dataset(name)
    except Exception as e:  # datasets raises many types for "not available offline"
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise JobError(f"INPUT {spec}: dataset {name!r} is not in the local Hugging Face "
                       f"cache (HF_HOME={datasets.config.HF_CACHE_HOME}); batchinfer never "
                       f"downloads — {reason}")
    return _pick_split(loaded, split, spec)


def _pick_split(loaded, split: str | None, spec: str):
    if split is None:
        if len(loaded) == 1:
            return next(iter(loaded.values()))
        split = "train"
    if split not in loaded:
        raise JobError(f"INPUT {spec}: no split {split!r}; splits: {', '.join(loaded)} "
                       "(choose one with --split or hf:NAME:SPLIT)")
    return loaded[split]
