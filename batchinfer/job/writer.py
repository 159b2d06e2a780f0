"""Output rows: the schema, one row per generated sample, and buffered commits of parts."""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from batchinfer.job.errors import JobError
from batchinfer.job.durable import NotSynced
from batchinfer.job.manifest import Manifest, OutputDir
from batchinfer.job.prompts import PromptSpec, WorkItem
from batchinfer.job.rangeset import RangeSet
from batchinfer.outputs import FlatLogprobs, RequestOutput

STAT_FIELDS = [
    pa.field("sample_index", pa.int32()),
    pa.field("completion", pa.string()),
    pa.field("prompt_tokens", pa.int64()),
    pa.field("cached_tokens", pa.int64()),
    pa.field("output_tokens", pa.int64()),
    pa.field("finish_reason", pa.string()),
    pa.field("queue_s", pa.float64()),
    pa.field("ttft_s", pa.float64()),
    pa.field("tpot_s", pa.float64()),
    pa.field("e2e_s", pa.float64()),
    pa.field("preemptions", pa.int64()),
    pa.field("attempts", pa.int32()),
    pa.field("error", pa.string()),
]
TOKEN_ID_FIELDS = [pa.field("prompt_token_ids", pa.list_(pa.int32())),
                   pa.field("token_ids", pa.list_(pa.int32()))]
LOGPROB_ENTRY = pa.struct([("token_id", pa.int32()), ("token", pa.string()),
                           ("logprob", pa.float32()), ("rank", pa.int32())])
LOGPROB_FIELDS = [pa.field("cumulative_logprob", pa.float64()),
                  pa.field("logprobs", pa.list_(pa.list_(LOGPROB_ENTRY)))]
# per prompt token (null for the first): the token's logprob first, then the top K there
PROMPT_LOGPROB_FIELDS = [pa.field("prompt_logprob_sum", pa.float64()),
                         pa.field("prompt_logprobs", pa.list_(pa.list_(LOGPROB_ENTRY)))]
REASONING_FIELD = pa.field("reasoning", pa.string())  # with --reasoning-parser
PROMPT_FIELD = pa.field("prompt", pa.string())  # with --keep-prompt: the text tokenized
# with --tool-call-parser: the calls found in the completion, as OpenAI writes them
TOOL_CALL = pa.struct([("id", pa.string()), ("type", pa.string()),
                       ("function", pa.struct([("name", pa.string()),
                                               ("arguments", pa.string())]))])
TOOL_CALLS_FIELD = pa.field("tool_calls", pa.list_(TOOL_CALL))
FLAT_COLUMNS = ("logprobs", "prompt_logprobs")  # rows may hold FlatLogprobs (to_table)


def output_schema(input_schema: pa.Schema, spec: PromptSpec, save_token_ids: bool,
                  logprobs: bool, prompt_logprobs: bool = False,
                  reasoning: bool = False, keep_prompt: bool = False,
                  tool_calls: bool = False) -> pa.Schema:
    """Every input column unchanged, then `id` (and `prompt` where asked), the per-sample
    stats (with `reasoning` and `tool_calls` after `completion` where asked) and optional
    lists."""
    stats = (STAT_FIELDS[:2] + [REASONING_FIELD] * reasoning + [TOOL_CALLS_FIELD] * tool_calls
             + STAT_FIELDS[2:])
    added = [pa.field("id", _id_type(input_schema, spec)),
             *([PROMPT_FIELD] if keep_prompt else []), *stats]
    if save_token_ids:
        added += TOKEN_ID_FIELDS
    if logprobs:
        added += LOGPROB_FIELDS
    if prompt_logprobs:
        added += PROMPT_LOGPROB_FIELDS
    reuse_id = spec.id_column == "id"
    clash = [f.name for f in added if f.name in input_schema.names
             and not (f.name == "id" and reuse_id)]
    if clash:
        raise JobError(f"INPUT column(s) {', '.join(clash)} have the names of output columns; "
                       "rename them in the input")
    if reuse_id:
        added = added[1:]
    # pandas' and Hugging Face's descriptions of the input columns (nullable integers, an
    # index, ClassLabel names) stay with them; readers infer the added columns
    carried = {k: v for k, v in (input_schema.metadata or {}).items()
               if k in (b"pandas", b"huggingface")}
    return pa.schema([*input_schema, *added], metadata=carried or None)


def _id_type(input_schema: pa.Schema, spec: PromptSpec) -> pa.DataType:
    if spec.id_column is None:
        return pa.int64()
    type_ = input_schema.field(spec.id_column).type
    return pa.string() if type_ == pa.null() else type_


def error_rows(item: WorkItem) -> list[dict[str, Any]]:
    """The one row of an input row that never reached the engine."""
    return [{**item.row.values, "id": item.row_id, **_kept_prompt(item),
             "sample_index": 0, "completion": None,
             "output_tokens": 0, "finish_reason": "error", "preemptions": 0, "attempts": 0,
             "error": item.error}]


def _kept_prompt(item: WorkItem) -> dict[str, str]:
    """The `prompt` column's value (with --keep-prompt, the only case a text is kept)."""
    return {} if item.text is None else {"prompt": item.text}


def sample_rows(item: WorkItem, out: RequestOutput, save_token_ids: bool,
                logprobs: bool, prompt_logprobs: bool = False,
                reasoning: bool = False) -> list[dict[str, Any]]:
    """One row per completion of a finished request (one row if the request failed)."""
    prompt_tokens = len(out.prompt_token_ids) or None
    if out.error is not None:
        row = error_rows(WorkItem(item.row, item.row_id, error=out.error, text=item.text))[0]
        row.update(prompt_tokens=prompt_tokens, attempts=1)
        return [row]
    rows = []
    for c in out.outputs:
        m = c.metrics or out.metrics
        row = {**item.row.values, "id": item.row_id, **_kept_prompt(item),
               "sample_index": c.index,
               "completion": c.text, "prompt_tokens": prompt_tokens,
               "cached_tokens": out.num_cached_tokens, "output_tokens": len(c.token_ids),
               "finish_reason": c.finish_reason, "preemptions": m.num_preemptions if m else 0,
               "attempts": 1, "error": None}
        if m is not None:
            row.update(queue_s=m.queue_s, ttft_s=m.ttft_s, tpot_s=m.tpot_s(len(c.token_ids)),
                       e2e_s=m.e2e_s)
        if reasoning:
            row["reasoning"] = c.reasoning_content
        if save_token_ids:
            row.update(prompt_token_ids=out.prompt_token_ids, token_ids=c.token_ids)
        if logprobs:  # FlatLogprobs go to to_table as they are
            row.update(cumulative_logprob=c.cumulative_logprob,
                       logprobs=c.logprobs if isinstance(c.logprobs, FlatLogprobs)
                       else _logprob_lists(c.logprobs))
        if prompt_logprobs and out.prompt_logprobs is not None:
            steps = out.prompt_logprobs
            if isinstance(steps, FlatLogprobs):  # each position's first entry: its token
                total = sum(steps.logprobs[a] for a, b in zip(steps.starts, steps.starts[1:])
                            if b > a)
            else:
                total = sum(step[tid].logprob
                            for tid, step in zip(out.prompt_token_ids[1:], steps[1:]))
                steps = _logprob_lists(steps)
            row.update(prompt_logprobs=steps, prompt_logprob_sum=total)
        rows.append(row)
    return rows


def _logprob_lists(steps: Sequence[dict | None] | None) -> list[list[dict[str, Any]] | None] | None:
    if steps is None:
        return None
    return [None if step is None else
            [{"token_id": tid, "token": lp.decoded_token, "logprob": lp.logprob, "rank": lp.rank}
             for tid, lp in step.items()] for step in steps]


def _flat_logprobs_array(column: list[FlatLogprobs | None], type_: pa.ListType) -> pa.Array:
    """A logprobs column (list of positions, each a list of entries, null where a position
    has none) built from the rows' flat lists, with no Python object per entry."""
    row_offsets, position_offsets = [0], [0]
    ids: list[int] = []
    texts: list[str] = []
    values: list[float] = []
    ranks: list[int] = []
    for steps in column:
        if steps is not None:
            base = len(ids)
            position_offsets += [base + end for end in steps.starts[1:]]
            ids += steps.token_ids
            texts += steps.decoded_tokens
            values += steps.logprobs
            ranks += steps.ranks
        row_offsets.append(len(position_offsets) - 1)
    entry = type_.value_type.value_type
    entries = pa.StructArray.from_arrays(
        [pa.array(data, type=entry.field(name).type) for name, data in
         (("token_id", ids), ("token", texts), ("logprob", values), ("rank", ranks))],
        fields=list(entry))
    offsets = np.array(position_offsets, dtype=np.int32)
    positions = pa.ListArray.from_arrays(pa.array(offsets), entries, type=type_.value_type,
                                         mask=pa.array(offsets[1:] == offsets[:-1]))
    return pa.ListArray.from_arrays(pa.array(row_offsets, pa.int32()), positions, type=type_,
                                    mask=pa.array([steps is None for steps in column]))


def to_table(rows: list[dict[str, Any]], schema: pa.Schema,
             dictionaries: dict[str, pa.Array] | None = None) -> pa.Table:
    """Rows as a table of `schema`. Columns Arrow cannot build from Python values directly
    (extension types) are built by a cast; a value that still does not fit its column
    becomes null (the values of rows already marked failed, see schema.py).
    `dictionaries`: the input's dictionary of a dictionary-typed column, whose order (an
    ordered pandas Categorical's) the column keeps."""
    arrays = []
    for f in schema:
        column = [r.get(f.name) for r in rows]
        if f.name in FLAT_COLUMNS and any(isinstance(v, FlatLogprobs) for v in column):
            if all(v is None or isinstance(v, FlatLogprobs) for v in column):
                arrays.append(_flat_logprobs_array(column, f.type))
                continue
            column = [_logprob_lists(v) if isinstance(v, FlatLogprobs) else v for v in column]
        known = (dictionaries or {}).get(f.name)
        try:
            if known is not None and pa.types.is_dictionary(f.type):
                arrays.append(_with_dictionary(column, f.type, known))
            else:
                arrays.append(pa.array(column, type=f.type))
            continue
        except (pa.ArrowException, OverflowError, TypeError, ValueError):
            pass
        try:  # types Arrow builds only by a cast, such as extension types (bool8)
            arrays.append(pa.array(column).cast(f.type))
        except (pa.ArrowException, OverflowError, TypeError, ValueError, NotImplementedError):
            arrays.append(pa.array([_fit(v, f.type) for v in column], type=f.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def _with_dictionary(column: list[Any], type_: pa.DictionaryType,
                     known: pa.Array) -> pa.DictionaryArray:
    """The column encoded against `known` (values it lacks are appended in order)."""
    position = {v: i for i, v in enumerate(known.to_pylist())}
    extra: list[Any] = []
    indices = []
    for value in column:
        if value is not None and value not in position:
            position[value] = len(position)
            extra.append(value)
        indices.append(None if value is None else position[value])
    dictionary = pa.concat_arrays([known, pa.array(extra, type=known.type)]) if extra else known
    return pa.DictionaryArray.from_arrays(pa.array(indices, type=type_.index_type), dictionary,
                                          ordered=type_.ordered)


def _fit(value: Any, type_: pa.DataType) -> Any:
    try:
        pa.scalar(value, type=type_)
        return value
    except (pa.ArrowException, OverflowError, TypeError, ValueError):
        return None


class PartWriter:
    """Buffers finished rows and commits them as a part every `commit_rows` input rows or
    `commit_seconds` seconds, whichever comes first."""

    def __init__(self, outdir: OutputDir, manifest: Manifest, schema: pa.Schema,
                 done: RangeSet, commit_rows: int, commit_seconds: float,
                 dictionaries: dict[str, pa.Array] | None = None):
        self.outdir = outdir
        self.manifest = manifest
        self.schema = schema
        self.dictionaries = dictionaries  # filled by the reader as it goes (see to_table)
        self.done = done
        self.commit_rows = commit_rows
        self.commit_seconds = commit_seconds
        self.started = time.monotonic()
        self.run = manifest.runs[-1]
        self._rows: list[tuple[int, int, dict[str, Any]]] = []
        self._indices: list[int] = []
        self._last_commit = self.started

    def add(self, index: int, rows: list[dict[str, Any]]) -> None:
        self._indices.append(index)
        self._rows.extend((index, r["sample_index"], r) for r in rows)

    def due(self) -> bool:
        if not self._indices:
            return False
        return (len(self._indices) >= self.commit_rows
                or time.monotonic() - self._last_commit >= self.commit_seconds)

    def commit(self, complete: bool = False) -> int:
        """Commit what is buffered (and record the run's time); returns the input rows.
        If it raises, what is buffered stays buffered and the manifest is as it was, except
        for NotSynced (committed, see OutputDir.commit)."""
        count = len(self._indices)
        run_before, complete_before = dict(self.run), self.manifest.complete
        self.run["wall_s"] = round(time.monotonic() - self.started, 3)
        self.manifest.complete = complete
        try:
            if count:
                self._rows.sort(key=lambda t: (t[0], t[1]))
                table = to_table([r for _, _, r in self._rows], self.schema, self.dictionaries)
                rows = RangeSet()
                rows.update(self._indices)
                done = self.done.copy()
                done.update(self._indices)
                self.run["input_rows"] = self.run.get("input_rows", 0) + count
                self.outdir.commit(self.manifest, table, rows, done)
            else:
                self.outdir.save(self.manifest)
        except NotSynced:
            self._committed()
            raise
        except BaseException:
            self.run.update(run_before)
            self.manifest.complete = complete_before
            raise
        self._committed()
        return count

    def _committed(self) -> None:
        self.done.update(self._indices)
        self._rows, self._indices = [], []
        self._last_commit = time.monotonic()
