"""Per-row sampling settings (--sampling-columns): columns named like the sampling flags
override the job's value for their row. A null leaves the job's value; a bad value is a
ValueError naming its column (the row fails alone)."""
from __future__ import annotations

import json
import re
from typing import Any

from batchinfer.sampling_params import SamplingParams, StructuredOutputsParams

# the columns --sampling-columns reads, by SamplingParams field (vLLM's names), then the
# constraints (one per row), by their StructuredOutputsParams field
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n", "stop")
CONSTRAINTS = {"json_schema": "json", "regex": "regex", "choice": "choice"}
SAMPLING_COLUMNS = (*SAMPLING_FIELDS, *CONSTRAINTS)
ALL_SAMPLING_COLUMNS = "all"  # the bare flag: each of them the input has


class RowSampling:
    """Applies a row's sampling columns to the job's SamplingParams."""

    def __init__(self, names: list[str], max_n: int, json_columns: set[str] = frozenset()):
        self.names = names
        self.max_n = max_n
        # columns of mixed kinds, read as JSON text (schema.py): a value that is JSON is
        # taken as what it encodes (3, not "3")
        self.json_columns = set(json_columns) & set(names)

    def apply(self, values: dict[str, Any], params: SamplingParams) -> SamplingParams:
        if self.json_columns:
            values = {**values, **{name: _decoded(values.get(name))
                                   for name in self.json_columns}}
        changes = {name: values[name] for name in self.names
                   if name in SAMPLING_FIELDS and values.get(name) is not None}
        constraints = [name for name in self.names
                       if name in CONSTRAINTS and values.get(name) is not None]
        if len(constraints) > 1:
            raise ValueError(f"columns {' and '.join(map(repr, constraints))} both constrain "
                             "the completion; give one per row")
        if constraints:
            name = constraints[0]
            try:
                changes["structured_outputs"] = StructuredOutputsParams(
                    **{CONSTRAINTS[name]: _constraint(name, values[name])})
            except ValueError as e:
                raise ValueError(f"column {name!r}: {_unprefixed(str(e))}") from None
        if not changes:
            return params
        for name, value in changes.items():
            if isinstance(value, bool) or (name != "stop" and isinstance(value, str)):
                raise ValueError(f"column {name!r} must be a number, got {value!r}")
        try:
            params = params.clone(**changes)
        except (TypeError, ValueError) as e:
            raise ValueError(re.sub(r"SamplingParams\.(\w+)", r"column '\1'", str(e))) from None
        if params.n > self.max_n:
            raise ValueError(f"column 'n' = {params.n} is over the limit of {self.max_n} "
                             "completions per row (--max-n)")
        return params


def _decoded(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _constraint(name: str, value: Any) -> Any:
    """A constraint column's value: JSON text is read (a CSV cell holds a schema or a list
    of choices that way)."""
    if isinstance(value, str) and name != "regex":
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON ({e})") from None
    if name == "json_schema" and not isinstance(value, (dict, bool)):
        raise ValueError(f"must be a JSON schema (an object), got {value!r}")
    if name == "regex" and not isinstance(value, str):
        raise ValueError(f"must be text, got {value!r}")
    return value


def _unprefixed(message: str) -> str:
    return re.sub(r"^StructuredOutputsParams(\.\w+)?:? ?", "", message)
