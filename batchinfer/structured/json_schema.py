"""A JSON schema as a regular expression over its instances, written compactly: objects as
{"a": 1, "b": [true, null]} (", " and ": " separators, as json.dumps writes them), every
property of an object in the schema's order, so json.loads reads each completion and the
schema validates it.

Covered: type (string, integer, number, boolean, null, or a list of them), object with
properties (each present, in order; no additional ones), array with items and
minItems/maxItems, enum, const, anyOf/oneOf, string minLength/maxLength, integer and
number without bounds, local $ref to #/$defs or #/definitions (not recursive). Anything
else (format, pattern, minimum, allOf, a recursive $ref, ...) is refused with a ValueError
naming it, rather than generating output that might not validate.
"""
from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable
from typing import Any

from batchinfer.structured.regex_syntax import MAX_PATTERN_CHARS

# one character of a JSON string: raw (not a quote, backslash or control character), or
# escaped; \u escapes of surrogates are left out (a pair is one character, which a length
# bound would count as two). The escapes share their backslash, so where one character
# ends is plain from the next byte, and a length bound costs one counter (regex_syntax).
_STRING_CHAR = (r'([^"\\\x00-\x1f]|\\(["\\/bfnrt]'
                r'|u([0-9a-cA-CefEF][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2})))')
_INTEGER = r"-?(0|[1-9][0-9]{0,15})"
# exponents of at most two digits: every number written stays finite as a float
_NUMBER = _INTEGER + r"(\.[0-9]{1,16})?([eE][+-]?[0-9]{1,2})?"
_SCALARS = {"integer": _INTEGER, "number": _NUMBER, "boolean": "(true|false)", "null": "null"}
# keywords that do not constrain instances
_ANNOTATIONS = {"title", "description", "examples", "default", "$schema", "$id", "$comment",
                "$defs", "definitions", "readOnly", "writeOnly", "deprecated"}
_MAX_DEPTH = 32
# the keywords each type takes, beyond the annotations
_KEYWORDS = {"string": {"minLength", "maxLength"},
             "object": {"properties", "required", "additionalProperties"},
             "array": {"items", "minItems", "maxItems"}}


def _is_type(value: Any, kind: str) -> bool:
    """Whether a JSON value is of a JSON schema type."""
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer())
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, {"string": str, "boolean": bool, "null": type(None),
                              "object": dict, "array": list}.get(kind, ()))


def _literal(value: Any) -> str:
    return re.escape(json.dumps(value, ensure_ascii=False))


class _Converter:
    def __init__(self, root: dict):
        self.root = root
        self.refs: list[str] = []

    def fail(self, what: str) -> ValueError:
        return ValueError(f"json schema: {what} is not supported")

    def convert(self, schema: Any, depth: int = 0) -> str:
        """The schema's regex, refused as soon as it grows past MAX_PATTERN_CHARS (an array
        writes its item twice, so nested arrays double it a level, and a $ref is written
        out where it is used)."""
        regex = self._convert(schema, depth)
        if len(regex) > MAX_PATTERN_CHARS:
            raise _too_long()
        return regex

    def _convert(self, schema: Any, depth: int) -> str:
        if depth > _MAX_DEPTH:
            raise self.fail(f"nesting deeper than {_MAX_DEPTH}")
        if schema is True or schema == {}:
            raise self.fail("an unconstrained value (a schema of {} or true)")
        if not isinstance(schema, dict):
            raise ValueError(f"json schema: expected an object, got {schema!r}")
        if "oneOf" in schema:
            raise self.fail("oneOf (an instance may match only one branch; anyOf is)")
        for key in ("$ref", "const", "enum", "anyOf"):
            if key in schema:
                # alone with the annotations (and a type beside const or enum): other
                # keywords would constrain it further
                typed = {"type"} if key in ("const", "enum") else set()
                others = sorted(set(schema) - _ANNOTATIONS - {key} - typed)
                if others:
                    raise self.fail(f"{key} beside {', '.join(others)}")
                break
        if "$ref" in schema:
            return self.ref(schema["$ref"], depth)
        if "const" in schema or "enum" in schema:
            values = [schema["const"]] if "const" in schema else schema["enum"]
            if not isinstance(values, list) or not values:
                raise ValueError("json schema: enum must be a non-empty list")
            if "type" in schema:
                kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
                values = [v for v in values if any(_is_type(v, k) for k in kinds)]
                if not values:
                    raise ValueError("json schema: no enum or const value has the given type")
            return "(" + _joined((_literal(v) for v in values), "|") + ")"
        if "anyOf" in schema:
            options = schema["anyOf"]
            if not isinstance(options, list) or not options:
                raise ValueError("json schema: anyOf must be a non-empty list")
            return "(" + _joined((self.convert(s, depth + 1) for s in options), "|") + ")"
        kind = schema.get("type")
        if kind is None:
            if "properties" in schema:
                kind = "object"
            elif "items" in schema:
                kind = "array"
            else:
                raise self.fail(f"a schema without a type ({sorted(schema)})")
        if isinstance(kind, list):
            if not kind:
                raise ValueError("json schema: type must not be an empty list")
            # each type with the keywords that apply to it (any other is refused by all)
            known = set().union(*(_KEYWORDS.get(k, set()) for k in kind))
            return "(" + _joined((self.convert(
                {key: v for key, v in schema.items()
                 if key in _KEYWORDS.get(k, set()) or key not in known}
                | {"type": k}, depth + 1) for k in kind), "|") + ")"
        allowed = _ANNOTATIONS | {"type"} | _KEYWORDS.get(kind, set())
        unknown = sorted(set(schema) - allowed)
        if unknown:
            raise self.fail(", ".join(unknown) + f" (on a {kind})")
        if kind in _SCALARS:
            return _SCALARS[kind]
        if kind == "string":
            low, high = self.bounds(schema, "minLength", "maxLength")
            return '"' + _STRING_CHAR + (f"{{{low},{'' if high is None else high}}}"
                                         if (low, high) != (0, None) else "*") + '"'
        if kind == "array":
            return self.array(schema, depth)
        if kind == "object":
            return self.object(schema, depth)
        raise self.fail(f"type {kind!r}")

    def bounds(self, schema: dict, low_key: str, high_key: str) -> tuple[int, int | None]:
        low, high = schema.get(low_key, 0), schema.get(high_key)
        for name, value in ((low_key, low), (high_key, high)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or not 0 <= value <= 1000):
                raise ValueError(f"json schema: {name} must be an integer in [0, 1000]")
        if high is not None and high < low:
            raise ValueError(f"json schema: {high_key} is below {low_key}")
        return low, high

    def array(self, schema: dict, depth: int) -> str:
        if not isinstance(schema.get("items"), dict):
            raise self.fail("an array without an items schema")
        item = self.convert(schema["items"], depth + 1)
        low, high = self.bounds(schema, "minItems", "maxItems")
        if high == 0:
            return r"\[\]"
        more = f"(, {item}){{{max(low - 1, 0)},{'' if high is None else high - 1}}}"
        return rf"\[{item}{more}\]" if low > 0 else rf"\[({item}{more})?\]"

    def object(self, schema: dict, depth: int) -> str:
        properties = schema.get("properties", {})
        if not isinstance(properties, dict):
            raise ValueError("json schema: properties must be an object")
        if not properties and schema.get("additionalProperties") not in (None, False):
            raise self.fail("an object with no properties but additionalProperties")
        missing = [name for name in schema.get("required", []) if name not in properties]
        if missing:
            raise self.fail(f"required properties without a schema ({', '.join(missing)})")
        # every listed property is written, in order (valid whatever `required` says, and
        # whatever additionalProperties allows beyond them)
        fields = (_literal(name) + ": " + self.convert(sub, depth + 1)
                  for name, sub in properties.items())
        return r"\{" + _joined(fields, ", ") + r"\}"

    def ref(self, ref: Any, depth: int) -> str:
        if not isinstance(ref, str) or not ref.startswith("#/"):
            raise self.fail(f"$ref {ref!r} (only local #/$defs/... references are)")
        if ref in self.refs:
            raise self.fail(f"the recursive $ref {ref!r}")
        target: Any = self.root
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise ValueError(f"json schema: $ref {ref!r} points nowhere")
            target = target[part]
        self.refs.append(ref)
        try:
            return self.convert(target, depth + 1)
        finally:
            self.refs.pop()


def _joined(parts: Iterable[str], separator: str) -> str:
    """separator.join(parts), refused as soon as it grows past MAX_PATTERN_CHARS."""
    out, size = [], 0
    for part in parts:
        size += len(part) + len(separator)
        if size > MAX_PATTERN_CHARS:
            raise _too_long()
        out.append(part)
    return separator.join(out)


def _too_deep() -> ValueError:
    """For JSON nested deeper than Python's json module reads or writes (the schema's
    own limit, _MAX_DEPTH, is far below)."""
    return ValueError(f"json schema: nesting deeper than {_MAX_DEPTH} is not supported")


def _too_long() -> ValueError:
    return ValueError(f"json schema too large: its regex is more than {MAX_PATTERN_CHARS} "
                      f"characters long (limit {MAX_PATTERN_CHARS})")


def json_schema_regex(schema: Any) -> str:
    """The regex whose matches are the schema's instances as written compactly (a schema
    given as JSON text is parsed first)."""
    if not isinstance(schema, str):
        try:
            schema = json.dumps(schema)
        except (TypeError, ValueError) as e:
            raise ValueError(f"json schema is not JSON data: {e}") from None
        except RecursionError:
            raise _too_deep() from None
    return _convert_text(schema)


@functools.lru_cache(maxsize=256)
def _convert_text(text: str) -> str:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"json schema is not valid JSON: {e}") from None
    except RecursionError:
        raise _too_deep() from None
    if not isinstance(schema, dict):
        raise ValueError(f"json schema must be an object, got {type(schema).__name__}")
    return _Converter(schema).convert(schema)
