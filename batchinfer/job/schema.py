"""Arrow types for row-oriented inputs (JSONL, JSON arrays, CSV), inferred over every row.

Parquet parts of one output must share one schema, but a JSON file can hold a column that
is null in its first thousand rows and text later, or a struct whose keys vary by row. So
the reader scans the whole input once and records, per column and per kind of Python value
(str, int, list, ...), the Arrow type of those values, unified across batches. The final
type of a column is chosen once the prompt column is known: the prompt column keeps its
text values' type, so one bad row (a number where text belongs) cannot change the type of
every good row; any other column mixing kinds is stored as JSON text.
"""
from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterable
from typing import Any

import pyarrow as pa

_FIXED = {"str": pa.string(), "bool": pa.bool_(), "float": pa.float64()}
_FAILED = None  # the values of this kind have no single Arrow type
# Parquet readers refuse a schema more than 100 levels deep (pyarrow 26: "Parquet schema too
# deeply nested"), where a list or a map takes two levels and a struct one: 49 nested lists
# are the most pyarrow reads back, and Arrow IPC (the manifest's schemas) reads 62 nested
# maps. Deeper values are kept as JSON text.
MAX_NESTING = 32


def kind_of(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, (list, tuple)):
        return "list"
    if isinstance(value, dict):
        return "dict"
    return "other"


def contains_type(type_: pa.DataType, predicate: Callable[[pa.DataType], bool]) -> bool:
    """Whether the type, or one nested in it (struct fields, list and map values), is one
    that `predicate` picks."""
    return predicate(type_) or any(contains_type(type_.field(i).type, predicate)
                                   for i in range(type_.num_fields))


def nesting(type_: pa.DataType) -> int:
    """How many nested types (lists, structs, maps) deep the type goes, found without
    recursion (a type read from a JSON value can be hundreds of levels deep)."""
    deepest, stack = 0, [(type_, 0)]
    while stack:
        type_, depth = stack.pop()
        deepest = max(deepest, depth)
        stack += [(type_.field(i).type, depth + 1) for i in range(type_.num_fields)]
    return deepest


def storable(type_: pa.DataType) -> bool:
    """Whether Parquet readers can read the type back: nested at most MAX_NESTING deep, and
    no struct without fields (JSON's {}) at any depth."""
    return nesting(type_) <= MAX_NESTING and not contains_type(
        type_, lambda t: pa.types.is_struct(t) and t.num_fields == 0)


def _infer(kind: str, values: list[Any]) -> pa.DataType | None:
    if kind in _FIXED:
        return _FIXED[kind]
    if kind == "other":
        return _FAILED
    try:
        type_ = pa.array(values, type=pa.int64() if kind == "int" else None).type
    except (pa.ArrowException, OverflowError, TypeError, ValueError):
        return _FAILED
    return type_ if storable(type_) else _FAILED  # kept as JSON text


def _unify(a: pa.DataType | None, b: pa.DataType | None) -> pa.DataType | None:
    if a is _FAILED or b is _FAILED:
        return _FAILED
    if a == b:
        return a
    try:
        type_ = pa.unify_schemas([pa.schema([pa.field("v", a)]), pa.schema([pa.field("v", b)])],
                                 promote_options="permissive").field("v").type
    except (pa.ArrowException, TypeError, ValueError):
        return _FAILED
    return type_ if storable(type_) else _FAILED


class ColumnTypes:
    """Per column (in first-seen order), the Arrow type of each kind of value seen."""

    def __init__(self) -> None:
        self.kinds: dict[str, dict[str, pa.DataType | None]] = {}

    @property
    def columns(self) -> list[str]:
        return list(self.kinds)

    def observe(self, rows: Iterable[dict[str, Any]]) -> None:
        groups: dict[str, dict[str, list[Any]]] = {}
        for row in rows:
            for key, value in row.items():
                by_kind = groups.get(key)
                if by_kind is None:
                    by_kind = groups[key] = {}
                    self.kinds.setdefault(key, {})
                if value is not None:
                    kind = kind_of(value)
                    if kind in by_kind:
                        by_kind[kind].append(value)
                    else:
                        by_kind[kind] = [value]
        for key, by_kind in groups.items():
            known = self.kinds[key]
            for kind, values in by_kind.items():
                inferred = _infer(kind, values)
                known[kind] = _unify(known[kind], inferred) if kind in known else inferred

    def schema(self, restrict: dict[str, str] | None = None) -> tuple[pa.Schema, set[str]]:
        """The output schema of the input columns and the columns stored as JSON text.

        `restrict` maps a column to the one kind its valid values have ("str" for a prompt
        column, "list" for messages, "dict" for an OpenAI request body); values of other
        kinds in it are invalid rows, stored as null.
        """
        restrict = restrict or {}
        fields, json_columns = [], set()
        for name, known in self.kinds.items():
            wanted = restrict.get(name)
            if wanted is not None:
                type_, as_json = _restricted_type(known, wanted)
            else:
                type_, as_json = _free_type(known)
            fields.append(pa.field(name, type_))
            if as_json:
                json_columns.add(name)
        return pa.schema(fields), json_columns


def _restricted_type(known: dict[str, pa.DataType | None], wanted: str) -> tuple[pa.DataType, bool]:
    if wanted == "str" or wanted not in known:
        return pa.string(), False
    if known[wanted] is _FAILED:
        return pa.string(), True
    return known[wanted], False


def _free_type(known: dict[str, pa.DataType | None]) -> tuple[pa.DataType, bool]:
    kinds = set(known)
    if not kinds:
        return pa.null(), False
    if kinds == {"int", "float"} and known["int"] is not _FAILED:
        return pa.float64(), False
    if len(kinds) == 1 and known[next(iter(kinds))] is not _FAILED:
        return known[next(iter(kinds))], False
    return pa.string(), True


def encode_json_columns(values: dict[str, Any], json_columns: set[str]) -> None:
    """Store non-text values of JSON-text columns as JSON, in place."""
    for name in json_columns:
        value = values.get(name)
        if value is not None and not isinstance(value, str):
            values[name] = json.dumps(value, ensure_ascii=False, default=str)


def schema_to_json(schema: pa.Schema) -> str:
    """A schema as text for the manifest (Arrow IPC, base64)."""
    return base64.b64encode(schema.serialize().to_pybytes()).decode("ascii")


def schema_from_json(text: str) -> pa.Schema:
    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text)))
