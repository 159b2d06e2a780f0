"""The row-oriented text formats — JSON lines, a JSON array, CSV — as raw rows, each with
where it is, and parsed into values.

Every row is bounded: a JSONL line, a JSON array element or a CSV record longer than
`max_row_bytes` is skipped without being held whole and comes out as an error (so are JSON
nested deeper than Python's parser goes, a stray CSV quote), and reading goes on with the
next row.
"""
from __future__ import annotations

import csv
import io
import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchinfer.job.errors import JobError
from batchinfer.job.schema import contains_type, storable

# The longest row read (a JSONL line, a JSON array element, a CSV record): a longer one is a
# failed row, skipped without being held in memory whole (--max-row-bytes).
MAX_ROW_BYTES = 16 * 2**20
_INT = re.compile(r"[+-]?\d+")
_FLOAT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?|[+-]?(inf|nan)", re.IGNORECASE)
_SURROGATE = re.compile("[\udc80-\udcff]")
_MAX_QUOTED = 80
TOO_DEEP = "JSON nested too deeply to parse"

Where = tuple[str, int]  # ("name.jsonl:", line) or ("name.json: element ", n)


def raw_rows(path: Path, fmt: str, max_row_bytes: int) -> Iterator[tuple[Where, Any]]:
    """Each row of the file unparsed, or the exception saying why it cannot be read, with
    where it is (formatted only when a row turns out bad)."""
    if fmt == "csv":
        return _csv_rows(path, max_row_bytes)
    if _is_json_array(path):
        return _json_array_rows(path, max_row_bytes)
    return _jsonl_rows(path, max_row_bytes)


def parse_row(fmt: str, raw: Any, converters: dict[str, Callable] | None
              ) -> tuple[dict[str, Any] | None, str | None]:
    """A raw row's values, or why it has none."""
    if fmt == "csv":
        return _parse_csv(raw, converters)
    return _parse_json(raw)


def shown_name(name: str | os.PathLike) -> str:
    """A file name as text that can be printed and stored: bytes that are not UTF-8 (which
    Python keeps as lone surrogates) become U+FFFD."""
    return os.fsencode(name).decode("utf-8", "replace")


# ---- JSON ----------------------------------------------------------------------------
def arrow_json_schema(files: list[Path], max_row_bytes: int) -> tuple[pa.Schema, int] | None:
    """The schema and row count of JSON lines files as Arrow's JSON reader (C++, ~20x
    faster than a Python scan) sees them, for the common case of clean JSON lines with one
    type per column. None when anything is unusual (a bad line, a column whose type
    changes, a JSON array, text Arrow would read as a timestamp, a line too long or too
    deeply nested): the Python scan then handles it row by row."""
    import pyarrow.json as pj
    if any(_is_json_array(p) or not _plain_lines(p, max_row_bytes) for p in files):
        return None
    schemas, rows = [], 0
    try:
        for path in files:
            with pa.OSFile(os.fsencode(path)) as f:  # pyarrow takes no path that is not UTF-8
                reader = pj.open_json(f)
                for batch in reader:
                    rows += batch.num_rows
                schemas.append(reader.schema)
        schema = pa.unify_schemas(schemas)
    except (pa.ArrowException, OSError):
        return None
    if rows == 0 or any(not storable(f.type) or contains_type(f.type, pa.types.is_temporal)
                        for f in schema):
        return None
    # Arrow reads an integer beyond int64 as a float64 (and the rows then fail to convert):
    # the Python scan keeps such a column as JSON text, exactly
    if any(contains_type(f.type, pa.types.is_floating) for f in schema) and any(
            _has_big_integer(p) for p in files):
        return None
    return schema, rows


# Arrow's JSON reader recurses once per level of nesting and overflows its stack (a crash,
# not an error) somewhere past 5,000 levels; a line with more brackets than this is read by
# the Python scan, whose parser stops at Python's recursion limit.
_ARROW_JSON_BRACKETS = 1000


def _plain_lines(path: Path, max_row_bytes: int) -> bool:
    """Whether no line of the file is longer than `max_row_bytes` or holds more than
    _ARROW_JSON_BRACKETS opening brackets (at least its depth of nesting)."""
    with open(path, "rb") as f:
        for line in _bounded_lines(f, max_row_bytes):
            if line is None or line.count(b"[") + line.count(b"{") > _ARROW_JSON_BRACKETS:
                return False
    return True


def _bounded_lines(f: io.BufferedIOBase, limit: int) -> Iterator[bytes | None]:
    """The lines of a binary file; None for a line longer than `limit` bytes (its newline
    not counted), which is skipped without being held whole."""
    while line := f.readline(limit + 1):
        if len(line) > limit and not line.endswith(b"\n"):
            while (rest := f.readline(1 << 20)) and not rest.endswith(b"\n"):
                pass
            yield None
        else:
            yield line


def _too_long(limit: int) -> ValueError:
    return ValueError(f"longer than {limit} bytes; --max-row-bytes sets the limit")


def _has_big_integer(path: Path, chunk: int = 1 << 24) -> bool:
    """Whether the file holds a _BIG_INTEGER, read a chunk at a time (chunks overlap, so a
    number across a boundary is seen whole)."""
    tail = b""
    with open(path, "rb") as f:
        while data := f.read(chunk):
            if _BIG_INTEGER.search(tail + data):
                return True
            tail = data[-64:]
    return False


# an integer literal of 19 digits or more: it may not fit int64 (JSON strings that hold
# such digits match too; they only cost the faster inspection)
_BIG_INTEGER = re.compile(rb"(?<![\d.eE])-?\d{19,}(?![\d.eE])")


def _jsonl_rows(path: Path, limit: int) -> Iterator[tuple[Where, bytes | Exception]]:
    prefix = f"{shown_name(path.name)}:"
    with open(path, "rb") as f:
        for lineno, line in enumerate(_bounded_lines(f, limit), 1):
            if line is None:
                yield (prefix, lineno), _too_long(limit)
                continue
            if lineno == 1 and line.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark
                line = line[3:]
            if line.strip():
                yield (prefix, lineno), line


def _is_json_array(path: Path) -> bool:
    if path.suffix.lower() != ".json":
        return False
    with open(path, "rb") as f:
        first = True
        while chunk := f.read(4096):
            if first and chunk.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark
                chunk = chunk[3:]
            first = False
            stripped = chunk.lstrip()
            if stripped:
                return stripped.startswith(b"[")
    return False


def _json_array_rows(path: Path, limit: int) -> Iterator[tuple[Where, Any]]:
    """Elements of a top-level JSON array, parsed one at a time from a growing buffer.

    An element longer than `limit` (counted in characters) or nested deeper than the parser
    goes is skipped unparsed and comes out as a failed row. A syntax error ends the file
    (there is no way to find the next element): it comes out as one failed row naming the
    position."""
    ws = re.compile(r"[ \t\n\r]*")
    prefix = f"{shown_name(path.name)}: element "
    # utf-8-sig: a byte order mark (as editors and Excel write) is skipped
    with open(path, encoding="utf-8-sig", errors="surrogateescape") as f:
        buf, pos, offset, eof, element = "", 0, 0, False, 0

        def fill() -> bool:
            nonlocal buf, pos, offset, eof
            chunk = f.read(1 << 20)
            if not chunk:
                eof = True
                return False
            offset += pos
            buf, pos = buf[pos:] + chunk, 0
            return True

        def skip_ws() -> str:
            nonlocal pos
            while True:
                pos = ws.match(buf, pos).end()
                if pos < len(buf) or not fill():
                    return buf[pos:pos + 1]

        def skip_value() -> bool:
            """Move past the value at `pos` without parsing it (nor holding it whole);
            False when the file ends first."""
            nonlocal pos
            depth, in_string = 0, False
            while True:
                if pos == len(buf) and not fill():
                    return False
                if in_string:
                    pos = _STRING_PART.match(buf, pos).end()
                    if pos == len(buf):
                        continue
                    if buf[pos] == "\\":
                        if pos + 1 == len(buf) and not fill():
                            return False
                        pos += 2
                        continue
                    pos += 1
                    in_string = False
                    if depth == 0:
                        return True
                    continue
                pos = _OUTSIDE_STRING.match(buf, pos).end()
                if pos == len(buf):
                    continue
                char = buf[pos]
                if char == '"':
                    in_string = True
                elif char in "[{":
                    depth += 1
                elif depth == 0:  # the "," or "]" after a number, true, false or null
                    return True
                elif char in "]}":
                    depth -= 1
                    if depth == 0:
                        pos += 1
                        return True
                pos += 1

        def failure(why: str) -> tuple[str, Exception]:
            return (prefix, element), ValueError(
                f"invalid JSON at character {offset + pos} ({why}); the rest of the file "
                "cannot be read")

        skip_ws()
        pos += 1  # the "["
        while True:
            char = skip_ws()
            if char == "]":
                return
            if char == "":
                yield failure("the array is not closed")
                return
            while True:
                try:
                    value, end = _raw_decode(buf, pos)
                except json.JSONDecodeError as e:
                    # an error short of the buffer's end is one more text cannot mend (an
                    # unclosed string's is reported where the string starts)
                    if e.pos < len(buf) - 16 and not e.msg.startswith("Unterminated string"):
                        yield failure(e.msg)
                        return
                    if len(buf) - pos > limit:
                        value, end = _too_long(limit), None
                        break
                    if not eof and fill():
                        continue
                    yield failure(e.msg)
                    return
                except RecursionError:
                    value, end = ValueError(TOO_DEEP), None
                    break
                if end == len(buf) and not eof and fill():
                    continue  # a number may continue in the next chunk
                break
            element += 1
            if end is None:
                if not skip_value():
                    yield (prefix, element - 1), value
                    return
            else:
                raw_text = buf[pos:end]
                pos = end
                if len(raw_text) > limit:
                    value = _too_long(limit)
                elif _SURROGATE.search(raw_text):
                    value = UnicodeError("invalid UTF-8")
            yield (prefix, element - 1), value
            char = skip_ws()
            if char == ",":
                pos += 1
            elif char != "]":
                yield failure("expected ',' or ']' after an element")
                return


_STRING_PART = re.compile(r'[^"\\]*')
_OUTSIDE_STRING = re.compile(r'[^"\[\]{},]*')


def _int_or_digits(text: str) -> int | str:
    """A JSON integer; its digits as text when there are more than int() converts (Python
    refuses over 4300 digits)."""
    try:
        return int(text)
    except ValueError:
        return text


_DECODER = json.JSONDecoder()
_LONG_INTEGER_DECODER = json.JSONDecoder(parse_int=_int_or_digits)


def _loads(text: str) -> Any:
    try:
        return _DECODER.decode(text)
    except json.JSONDecodeError:
        raise
    except ValueError:  # an integer longer than int() converts: parsed again, slower
        return _LONG_INTEGER_DECODER.decode(text)


def _raw_decode(text: str, pos: int) -> tuple[Any, int]:
    try:
        return _DECODER.raw_decode(text, pos)
    except json.JSONDecodeError:
        raise
    except ValueError:
        return _LONG_INTEGER_DECODER.raw_decode(text, pos)


def _parse_json(raw: Any) -> tuple[dict[str, Any] | None, str | None]:
    if isinstance(raw, Exception):
        return None, str(raw)
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            return None, f"invalid UTF-8 at byte {e.start}"
        try:
            raw = _loads(text)
        except json.JSONDecodeError as e:
            return None, f"invalid JSON ({e.msg} at column {e.colno}): {_quote(text)}"
        except RecursionError:
            return None, TOO_DEEP
    if not isinstance(raw, dict):
        return None, f"expected a JSON object, got {_json_type(raw)}"
    return raw, None


def _json_type(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def _quote(text: str) -> str:
    text = text.strip()
    return repr(text if len(text) <= _MAX_QUOTED else text[:_MAX_QUOTED] + "...")


# ---- CSV -----------------------------------------------------------------------------
class _RowTooLong(Exception):
    pass


class _CsvLines:
    """The lines of a CSV file, as csv.reader reads them, each at most `limit` bytes: a
    longer one is skipped (not held whole) and raises _RowTooLong. It counts lines and
    remembers where the second line of the record being read starts, so that reading can
    go back there after a record that turns out bad (`resume`)."""

    def __init__(self, path: Path, limit: int):
        self.file = open(path, "rb")
        self.text = self._text()
        self.limit = limit
        self.line = 0              # lines read
        self.offset = 0            # bytes read
        self.exhausted = False     # the end of the file was reached
        self.second_line: tuple[int, int] | None = None  # (line, offset) to resume from

    def _text(self) -> io.TextIOWrapper:
        # latin-1 gives one character per byte, so `offset` counts bytes; lines are
        # decoded as UTF-8 one by one; newline="": csv's own handling of line endings
        return io.TextIOWrapper(self.file, encoding="latin-1", newline="")

    def __iter__(self) -> "_CsvLines":
        return self

    def __next__(self) -> str:
        text = self.text.readline(self.limit + 1)
        if not text:
            self.exhausted = True
            raise StopIteration
        self.line += 1
        self.offset += len(text)
        if len(text) > self.limit and not text.endswith(("\n", "\r")):
            while rest := self.text.readline(1 << 20):
                self.offset += len(rest)
                if rest.endswith(("\n", "\r")):
                    break
            raise _RowTooLong
        if self.second_line is None:
            self.second_line = (self.line, self.offset)
        if self.line == 1 and text.startswith("\xef\xbb\xbf"):  # a UTF-8 byte order mark
            text = text[3:]
        return text.encode("latin-1").decode("utf-8", "surrogateescape")

    def start_record(self) -> None:
        self.second_line = None

    def resume(self) -> bool:
        """Go back to the second line of the record just read, if it had one."""
        if self.second_line is None or self.second_line[0] == self.line:
            return False
        self.line, self.offset = self.second_line
        self.text.detach()
        self.file.seek(self.offset)
        self.text = self._text()
        self.exhausted = False
        return True

    def close(self) -> None:
        self.file.close()


def _csv_rows(path: Path, limit: int) -> Iterator[tuple[Where, Any]]:
    """Each record with its header, or the reason it cannot be read: longer than `limit`,
    or malformed quoting. After such a record, reading goes on from the line after the one
    it started on.

    Quoting is strict: a quote that opens a field must close it and be followed by a comma
    or the line's end (a quote inside a quoted field is doubled). A stray quote (an
    unclosed one, or `"a "b" c"`) would otherwise make the lines after it part of one
    value, up to the next stray quote or the end of the file, and their records would be
    silently lost."""
    # csv's own limit on a field (128 KiB by default) is process-wide: set for each file
    csv.field_size_limit(limit)
    name, prefix = shown_name(path), f"{shown_name(path.name)}:"
    lines = _CsvLines(path, limit)
    try:
        reader = csv.reader(lines, strict=True)
        try:
            header = next(reader, None)
        except _RowTooLong:
            raise JobError(f"{name}: the header is longer than {limit} bytes; "
                           "--max-row-bytes sets the limit") from None
        except csv.Error as e:
            raise JobError(f"{name}: the header is not CSV: {e}") from None
        if header is None:
            return
        if len(set(header)) != len(header):
            raise JobError(f"{name}: the header repeats a column name: {header}")
        if any(_SURROGATE.search(h) for h in header):
            raise JobError(f"{name}: the header is not valid UTF-8")
        while True:
            lines.start_record()
            first = lines.line + 1
            try:
                record = next(reader)
            except StopIteration:
                return
            except _RowTooLong:
                problem = _too_long(limit)
            except csv.Error as e:
                if lines.exhausted:
                    problem = ValueError("a quote opened in this record is never closed")
                elif "field limit" in str(e):
                    problem = _too_long(limit)
                else:
                    problem = ValueError(f"malformed CSV quoting ({e}; a quote inside a "
                                         "quoted field is written twice)")
            else:
                if record:
                    yield (prefix, lines.line), (header, record)
                continue
            yield (prefix, first), problem
            if lines.resume():
                reader = csv.reader(lines, strict=True)
    finally:
        lines.close()


def _csv_value(text: str) -> Any:
    if text == "":
        return None
    if _INT.fullmatch(text):
        # more digits than int64 holds: the column is text anyway (and int() refuses more
        # than 4300 digits)
        return int(text) if len(text) <= 20 else text
    if _FLOAT.fullmatch(text):
        return float(text)
    return text


def csv_converters(schema: pa.Schema) -> dict[str, Callable[[str], Any]]:
    """Per numeric column, how to turn its text into a value; other columns stay text."""
    numeric = {pa.int64(): int, pa.float64(): float}
    return {f.name: numeric[f.type] for f in schema if f.type in numeric}


def _parse_csv(raw: tuple[list[str], list[str]] | Exception,
               converters: dict[str, Callable] | None
               ) -> tuple[dict[str, Any] | None, str | None]:
    if isinstance(raw, Exception):
        return None, str(raw)
    header, record = raw
    if len(record) != len(header):
        return None, f"expected {len(header)} fields, got {len(record)}"
    if any(_SURROGATE.search(v) for v in record):
        return None, "invalid UTF-8"
    if converters is None:  # inspecting: every value in its most specific kind
        return {h: _csv_value(v) for h, v in zip(header, record)}, None
    values = {}
    for name, text in zip(header, record):
        convert = converters.get(name)
        values[name] = None if text == "" else (convert(text) if convert else text)
    return values, None
