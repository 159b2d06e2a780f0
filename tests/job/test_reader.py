"""Readers: row numbering, streaming skips, types inferred over the whole input, bad rows."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchinfer.job.errors import JobError
from batchinfer.job.rangeset import RangeSet
from batchinfer.job.reader import open_input
from batchinfer.job.schema import ColumnTypes
from jobtools import corrupt_row_group, nested_list


def read_all(spec, restrict=None, done=(), stop=None):
    source = open_input(str(spec))
    inspection = source.inspect()
    schema, json_columns = inspection.schema(restrict or {"prompt": "str"})
    rows = [r for batch in source.batches(schema, json_columns, RangeSet(done), stop)
            for r in batch]
    return inspection, schema, json_columns, rows


def test_types_inferred_over_every_row_not_the_first_batch(tmp_path):
    lines = [{"prompt": f"p{i}", "late": None, "num": i} for i in range(3000)]
    lines.append({"prompt": "last", "late": "text at the end", "num": 2.5,
                  "meta": {"a": 1}})
    lines.append({"prompt": "after", "meta": {"b": "x"}, "mixed": 1})
    lines.append({"prompt": 7, "mixed": "one"})  # a bad prompt must not change the type
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    inspection, schema, json_columns, rows = read_all(tmp_path / "in.jsonl")
    assert inspection.num_rows == len(lines)
    assert schema.field("prompt").type == pa.string()
    assert schema.field("late").type == pa.string()
    assert schema.field("num").type == pa.float64()
    assert schema.field("meta").type == pa.struct([("a", pa.int64()), ("b", pa.string())])
    assert schema.field("mixed").type == pa.string() and json_columns == {"mixed"}
    assert rows[-2].values["mixed"] == "1" and rows[-1].values["mixed"] == "one"
    assert [r.index for r in rows] == list(range(len(lines)))


def test_skips_done_rows_and_stops_at_limit(tmp_path):
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n"
                                               for i in range(50)))
    _, _, _, rows = read_all(tmp_path / "in.jsonl", done=[(0, 10), (12, 40)], stop=45)
    assert [r.index for r in rows] == [10, 11, *range(40, 45)]
    table = pa.table({"prompt": [f"p{i}" for i in range(5000)]})
    pq.write_table(table, tmp_path / "in.parquet", row_group_size=700)
    _, _, _, rows = read_all(tmp_path / "in.parquet", done=[(0, 3000), (3001, 4990)])
    assert [(r.index, r.values["prompt"]) for r in rows] == \
        [(3000, "p3000")] + [(i, f"p{i}") for i in range(4990, 5000)]


def test_json_array_streams_and_reports_a_broken_tail(tmp_path):
    items = [{"prompt": "x" * 5000 + str(i)} for i in range(300)]  # larger than one chunk
    text = json.dumps(items)
    (tmp_path / "ok.json").write_text(text)
    _, _, _, rows = read_all(tmp_path / "ok.json")
    assert [r.values["prompt"] for r in rows] == [i["prompt"] for i in items]
    (tmp_path / "broken.json").write_text(text[:-3000] + ', {"prompt": oops}]')
    _, _, _, rows = read_all(tmp_path / "broken.json")
    assert all(r.error is None for r in rows[:-1]) and len(rows) > 200
    assert "rest of the file" in rows[-1].error and "broken.json: element" in rows[-1].error


def test_csv_bad_rows_and_types(tmp_path):
    (tmp_path / "in.csv").write_bytes(b'prompt,n,score\n"a, b",1,0.5\nc,2\nd,x,1\n'
                                      b'\xff\xfe,3,2\n"multi\nline",4,3\n')
    inspection, schema, _, rows = read_all(tmp_path / "in.csv")
    assert inspection.num_rows == 5
    assert schema.field("n").type == pa.string()  # "x" is not a number
    assert schema.field("score").type == pa.float64()
    assert rows[0].values == {"prompt": "a, b", "n": "1", "score": 0.5}
    assert "expected 3 fields, got 2" in rows[1].error and "in.csv:3" in rows[1].error
    assert rows[2].values["n"] == "x"
    assert "invalid UTF-8" in rows[3].error
    assert rows[4].values["prompt"] == "multi\nline"


@pytest.mark.parametrize("name, body", [
    ("in.csv", b"prompt,id\r\nhello,1\r\nworld,2\r\n"),       # Excel's "CSV UTF-8"
    ("in.json", b'[\n {"prompt": "hello", "id": 1},\n {"prompt": "world", "id": 2}\n]\n'),
    ("in.jsonl", b'{"prompt": "hello", "id": 1}\n{"prompt": "world", "id": 2}\n'),
])
def test_a_utf8_byte_order_mark_is_skipped(tmp_path, name, body):
    (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + body)
    _, schema, _, rows = read_all(tmp_path / name)
    assert schema.names[:2] == ["prompt", "id"]
    assert [(r.values["prompt"], r.error) for r in rows] == [("hello", None), ("world", None)]


def test_a_schema_naming_the_first_csv_column_with_its_byte_order_mark_keeps_it(tmp_path):
    # such a schema is what a job that took the mark as part of the name recorded
    (tmp_path / "in.csv").write_bytes(b"\xef\xbb\xbfkey,prompt\nk1,hello\n")
    source = open_input(str(tmp_path / "in.csv"))
    schema = pa.schema([("\ufeffkey", pa.string()), ("prompt", pa.string())])
    rows = [r for batch in source.batches(schema, set(), RangeSet([])) for r in batch]
    assert rows[0].values == {"\ufeffkey": "k1", "prompt": "hello"}


def test_a_dictionary_encoded_prompt_column_is_read_decoded(tmp_path):
    prompts = pa.array(["hello", "world", "hello"]).dictionary_encode()  # a Categorical
    labels = pa.array(["a", "b", "a"]).dictionary_encode()
    pq.write_table(pa.table({"prompt": prompts, "label": labels}), tmp_path / "in.parquet")
    _, schema, _, rows = read_all(tmp_path / "in.parquet")
    assert schema.field("prompt").type == pa.string()
    assert pa.types.is_dictionary(schema.field("label").type)  # passed through as stored
    assert [r.values["prompt"] for r in rows] == ["hello", "world", "hello"]


def test_json_values_parquet_cannot_hold_as_they_are_stay_exact(tmp_path):
    # a clean file (read by Arrow's JSON reader): {} has no Parquet type, and an integer
    # beyond int64 would become a float; both are kept as JSON text, exactly
    (tmp_path / "in.jsonl").write_text(
        '{"prompt": "a", "meta": {}, "big": 18446744073709551615, "score": 0.5}\n'
        '{"prompt": "b", "meta": {}, "big": 1, "score": 1.5}\n')
    _, schema, json_columns, rows = read_all(tmp_path / "in.jsonl")
    assert {"meta", "big"} <= json_columns and schema.field("score").type == pa.float64()
    assert [(r.values["meta"], r.values["big"]) for r in rows] == \
        [("{}", "18446744073709551615"), ("{}", "1")]
    # nested in a struct or a list too
    (tmp_path / "nested.jsonl").write_text(
        '{"prompt": "a", "m": {"n": 12345678901234567890123}, "l": [123456789012345678901, 1]}\n'
        '{"prompt": "b", "m": {"n": 1}, "l": [2]}\n')
    _, _, json_columns, rows = read_all(tmp_path / "nested.jsonl")
    assert {"m", "l"} <= json_columns
    assert (rows[0].values["m"], rows[0].values["l"]) == \
        ('{"n": 12345678901234567890123}', "[123456789012345678901, 1]")


def test_a_value_that_cannot_be_read_fails_its_row_only(tmp_path):
    # files of a directory unified to int64, one holding a uint64 beyond it; and a
    # timestamp past year 9999, which Python cannot hold
    (tmp_path / "d").mkdir()
    pq.write_table(pa.table({"prompt": ["a"], "n": pa.array([1], pa.int64())}),
                   tmp_path / "d" / "1.parquet")
    pq.write_table(pa.table({"prompt": ["b", "c"], "n": pa.array([2, 2 ** 64 - 1], pa.uint64())}),
                   tmp_path / "d" / "2.parquet")
    _, _, _, rows = read_all(tmp_path / "d")
    assert [(r.values.get("n"), r.error is None) for r in rows[:2]] == [(1, True), (2, True)]
    assert "cannot be read as its column's type" in rows[2].error
    far = pa.array([0, 300_000_000_000_000_000], pa.timestamp("us"))  # year ~11476
    pq.write_table(pa.table({"prompt": ["a", "b"], "t": far}), tmp_path / "far.parquet")
    _, _, _, rows = read_all(tmp_path / "far.parquet")
    assert rows[0].error is None and "cannot be read" in rows[1].error


def test_open_input_mistakes(tmp_path):
    with pytest.raises(JobError, match="no such file"):
        open_input(str(tmp_path / "nope.jsonl"))
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.jsonl").write_text('{"prompt": "a"}\n')
    (tmp_path / "mixed" / "b.csv").write_text("prompt\nb\n")
    with pytest.raises(JobError, match="mixes formats"):
        open_input(str(tmp_path / "mixed"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(JobError, match="no .parquet"):
        open_input(str(tmp_path / "empty"))
    with pytest.raises(JobError, match="not in the local Hugging Face cache"):
        open_input("hf:nobody/no-such-dataset").inspect()


def test_column_types_unify_nested_and_fall_back_to_json():
    types = ColumnTypes()
    types.observe([{"m": [{"role": "user", "content": "a"}]}, {"x": 1}])
    types.observe([{"m": [{"role": "user", "content": "b", "name": "n"}]}, {"x": [1]}])
    schema, json_columns = types.schema({"m": "list"})
    assert schema.field("m").type == pa.list_(pa.struct(
        [("role", pa.string()), ("content", pa.string()), ("name", pa.string())]))
    assert schema.field("x").type == pa.string() and json_columns == {"x"}


def test_parquet_directory_with_evolving_schema(tmp_path):
    (tmp_path / "d").mkdir()
    pq.write_table(pa.table({"prompt": ["a", "b"], "x": pa.array([1, 2], pa.int32())}),
                   tmp_path / "d" / "0.parquet")
    pq.write_table(pa.table({"prompt": ["c"], "x": pa.array([3], pa.int64()), "y": ["new"]}),
                   tmp_path / "d" / "1.parquet")
    inspection, schema, _, rows = read_all(tmp_path / "d")
    assert inspection.num_rows == 3 and schema.field("x").type == pa.int64()
    assert [r.values for r in rows] == [{"prompt": "a", "x": 1, "y": None},
                                        {"prompt": "b", "x": 2, "y": None},
                                        {"prompt": "c", "x": 3, "y": "new"}]


def test_extension_typed_columns_come_back_through_the_writer():
    from batchinfer.job.writer import to_table
    type_ = pa.bool8()
    schema = pa.schema([("flag", type_)])
    table = to_table([{"flag": True}, {"flag": False}, {"flag": None}], schema)
    assert table.schema.field("flag").type == type_
    assert table.column("flag").to_pylist() == [True, False, None]


@pytest.mark.parametrize("body", [b"", b"PAR1", b"truncated"])
def test_an_unreadable_parquet_file_is_refused_by_name(tmp_path, body):
    if body == b"truncated":
        pq.write_table(pa.table({"prompt": ["a", "b"]}), tmp_path / "x.parquet")
        body = (tmp_path / "x.parquet").read_bytes()[:-20]
    (tmp_path / "d").mkdir()
    pq.write_table(pa.table({"prompt": ["fine"]}), tmp_path / "d" / "0.parquet")
    (tmp_path / "d" / "1.parquet").write_bytes(body)
    with pytest.raises(JobError, match=r"1\.parquet"):
        open_input(str(tmp_path / "d")).inspect()


def test_a_corrupt_row_group_fails_its_rows_only(tmp_path):
    prompts = [f"prompt number {i} " * 5 for i in range(3000)]
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": prompts, "n": list(range(3000))}), path,
                   row_group_size=1000, compression="snappy")
    corrupt_row_group(path, 1)
    inspection, _, _, rows = read_all(path)
    assert inspection.num_rows == 3000 and [r.index for r in rows] == list(range(3000))
    assert all(r.error is None and r.values["n"] == r.index for r in rows[:1000] + rows[2000:])
    assert all(r.values == {} and "in.parquet: row group 1" in r.error for r in rows[1000:2000])
    # the skips of a resumed job still count those rows
    _, _, _, rows = read_all(path, done=[(0, 1500)], stop=2002)
    assert [r.index for r in rows] == list(range(1500, 2002)) and rows[-1].error is None


@pytest.mark.parametrize("kind", ["clean.jsonl", "mixed.jsonl", "array.json"])
def test_values_nested_deeper_than_parquet_reads_are_json_text(tmp_path, kind):
    # 50 nested lists are 100 Parquet schema levels: pyarrow writes them but reads no file
    # holding them back. Arrow's JSON reader reads clean lines, the Python scan the rest.
    rows = [{"prompt": "deep", "x": nested_list(50), "ok": [[1]]},
            {"prompt": "flat", "x": None, "ok": [[2]]}]
    if kind == "mixed.jsonl":
        rows.append({"prompt": "mixed", "ok": [[3]], "extra": 1})
        rows.append({"prompt": "mixed", "ok": [[4]], "extra": "one"})
    path = tmp_path / kind
    if kind.endswith(".json"):
        path.write_text(json.dumps(rows))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, schema, json_columns, got = read_all(path)
    assert "x" in json_columns and schema.field("x").type == pa.string()
    assert schema.field("ok").type == pa.list_(pa.list_(pa.int64()))
    assert json.loads(got[0].values["x"]) == nested_list(50) and got[1].values["x"] is None
    assert all(r.error is None for r in got)
    buffer = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist([r.values for r in got], schema=schema), buffer)
    assert pq.read_table(pa.BufferReader(buffer.getvalue())).num_rows == len(rows)


def test_parquet_columns_nested_too_deep_are_json_text_or_refused(tmp_path):
    deep = pa.array([nested_list(40), None])
    pq.write_table(pa.table({"prompt": ["a", "b"], "x": deep}), tmp_path / "deep.parquet")
    _, schema, json_columns, rows = read_all(tmp_path / "deep.parquet")
    assert json_columns == {"x"} and schema.field("x").type == pa.string()
    assert json.loads(rows[0].values["x"]) == nested_list(40) and rows[1].values["x"] is None
    # 50 nested lists: written by pyarrow, but no Parquet reader opens the file
    pq.write_table(pa.table({"x": pa.array([nested_list(50)])}), tmp_path / "deeper.parquet")
    with pytest.raises(JobError, match="deeper.parquet.*too deeply nested"):
        open_input(str(tmp_path / "deeper.parquet")).inspect()


def test_a_json_array_element_nested_beyond_the_parser_fails_alone(tmp_path):
    # json.loads gives up (RecursionError) around 1000 levels: the element fails, and the
    # elements after it are read (JSON lines: test_bad_input, in a process of its own)
    deep = '{"prompt": "deep", "x": ' + "[" * 20_000 + "]" * 20_000 + "}"
    (tmp_path / "in.json").write_text(f'[{{"prompt": "a"}}, {deep}, {{"prompt": "b"}}]')
    inspection, _, _, rows = read_all(tmp_path / "in.json")
    assert inspection.num_rows == 3
    assert [r.values.get("prompt") for r in rows] == ["a", None, "b"]
    assert "nested too deeply" in rows[1].error and rows[0].error is rows[2].error is None


def test_integers_longer_than_python_converts_are_text(tmp_path):
    # Python refuses int() of more than 4300 digits; such a number is read as its digits
    digits = "7" * 5000
    (tmp_path / "in.jsonl").write_text(f'{{"prompt": "a", "n": {digits}, "m": [{digits}]}}\n'
                                       '{"prompt": "b", "n": 1, "m": [1]}\n')
    _, _, json_columns, rows = read_all(tmp_path / "in.jsonl")
    assert {"n", "m"} <= json_columns
    assert [r.values["n"] for r in rows] == [digits, "1"]
    assert json.loads(rows[0].values["m"]) == [digits]
    (tmp_path / "in.json").write_text(f'[{{"prompt": "a", "n": {digits}}}, {{"prompt": "b"}}]')
    _, _, _, rows = read_all(tmp_path / "in.json")
    assert [r.values.get("n") for r in rows] == [digits, None]
    (tmp_path / "in.csv").write_text(f"prompt,n,k\na,{digits},1\nb,2,{digits}\nc,3,4\n")
    _, _, _, rows = read_all(tmp_path / "in.csv")
    assert [(r.values["n"], r.values["k"]) for r in rows] == \
        [(digits, "1"), ("2", digits), ("3", "4")]


def test_file_names_that_are_not_utf8(tmp_path):
    import os
    folder = os.fsencode(tmp_path / "d")
    os.mkdir(folder)
    for name in (b"caf\xe9.jsonl", b"z\xff.jsonl"):
        with open(os.path.join(folder, name), "wb") as f:
            f.write(b'{"prompt": "ok"}\n{"prompt": ')
    source = open_input(os.fsdecode(folder))
    json.dumps(source.identity())  # (a fingerprint)
    inspection, _, _, rows = read_all(os.fsdecode(folder))
    assert inspection.num_rows == 4 and [r.values.get("prompt") for r in rows[::2]] == ["ok"] * 2
    assert rows[1].error.startswith("caf\ufffd.jsonl:2: ") and "z\ufffd.jsonl:2" in rows[3].error
    rows[1].error.encode("utf-8")
    name = os.fsencode(tmp_path) + b"/t\xe9.parquet"
    with open(name, "wb") as f:
        pq.write_table(pa.table({"prompt": ["p"]}), f)
    _, _, _, rows = read_all(os.fsdecode(name))
    assert rows[0].values == {"prompt": "p"}


def test_csv_fields_beyond_the_csv_modules_default_limit(tmp_path):
    big = "x" * 200_000  # csv's own limit is 128 KiB
    (tmp_path / "in.csv").write_text(f'prompt,n\n"{big}",1\nhello,2\n')
    _, _, _, rows = read_all(tmp_path / "in.csv")
    assert [(r.values["prompt"], r.values["n"], r.error) for r in rows] == \
        [(big, 1, None), ("hello", 2, None)]


@pytest.mark.parametrize("body, bad_line", [
    # a stray quote on line 3 would take the lines after it into one value, up to the next
    # quote (the last record's) or to the end of the file
    ('prompt,note\na,1\nb,"stray\nc,3\nd,"multi\nline"\ne,5\n', 3),
    ('prompt,note\na,"multi\nline"\nb,"never closed\nc,3\nd,4\n', 4),
    ('prompt,note\na,1\nb,"quoted" then text\nc,3\n', 3),
])
def test_stray_csv_quotes_fail_their_record_and_reading_goes_on(tmp_path, body, bad_line):
    (tmp_path / "in.csv").write_text(body)
    inspection, _, _, rows = read_all(tmp_path / "in.csv")
    good = [r for r in rows if r.error is None]
    bad = [r for r in rows if r.error is not None]
    assert inspection.num_rows == len(rows)
    assert [r.values["prompt"] for r in good] == [p for p in "acde" if f"\n{p}," in body]
    assert len(bad) == 1 and bad[0].error.startswith(f"in.csv:{bad_line}: ")
    assert "quote" in bad[0].error and bad[0].values == {}
    assert all("\n" not in str(r.values["note"]) or r.values["note"] == "multi\nline"
               for r in good)


@pytest.mark.parametrize("name", ["in.jsonl", "in.json", "in.csv"])
def test_rows_longer_than_max_row_bytes_fail_without_being_read(tmp_path, name):
    long = "y" * 5000
    rows = [{"prompt": "a"}, {"prompt": long}, {"prompt": "b"}]
    if name == "in.json":
        (tmp_path / name).write_text(json.dumps(rows))
    elif name == "in.csv":
        (tmp_path / name).write_text("prompt\n" + "".join(r["prompt"] + "\n" for r in rows))
    else:
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = open_input(str(tmp_path / name), max_row_bytes=1000)
    inspection = source.inspect()
    schema, json_columns = inspection.schema({"prompt": "str"})
    got = [r for batch in source.batches(schema, json_columns, RangeSet([])) for r in batch]
    assert inspection.num_rows == 3
    assert [r.values.get("prompt") for r in got] == ["a", None, "b"]
    assert "1000 bytes" in got[1].error and "--max-row-bytes" in got[1].error
    _, _, _, got = read_all(tmp_path / name)  # the default limit reads it
    assert got[1].values["prompt"] == long


def test_a_json_array_element_longer_than_the_limit_is_skipped_across_chunks(tmp_path):
    # read 1 MiB at a time: the long element spans chunks, and its strings hold brackets,
    # quotes and backslashes that must not end it early
    tricky = {"s": 'a \\" ] } [ { , \\\\', "n": [1, {"k": "}"}, [[]]], "t": True,
              "pad": "p" * 300}
    long = {"prompt": "long", "x": [tricky] * 4000}
    items = [{"prompt": "a"}, long, "text", 12.5, {"prompt": "b"}, long, {"prompt": "c"}]
    (tmp_path / "in.json").write_text(json.dumps(items))
    assert len(json.dumps(long)) > 1.2 * 2**20
    source = open_input(str(tmp_path / "in.json"), max_row_bytes=100_000)
    rows = [r for _, r in source._raw_rows()]
    assert [r.get("prompt") if isinstance(r, dict) else r for r in rows[::2]] == \
        ["a", "text", "b", "c"]
    assert "100000 bytes" in str(rows[1]) and rows[3] == 12.5 and "100000" in str(rows[5])


def test_a_json_array_syntax_error_is_not_taken_for_a_long_element(tmp_path):
    # more text after the error than the limit: still reported as the error it is
    rest = ", ".join('{"prompt": "p%d"}' % i for i in range(200))
    (tmp_path / "in.json").write_text(f'[{{"prompt": "a"}}, {{"prompt": oops}}, {rest}]')
    source = open_input(str(tmp_path / "in.json"), max_row_bytes=1000)
    rows = [r for _, r in source._raw_rows()]
    assert len(rows) == 2 and rows[0] == {"prompt": "a"}
    assert "invalid JSON" in str(rows[1]) and "rest of the file" in str(rows[1])


def test_a_csv_quote_running_past_the_limit_fails_its_record(tmp_path):
    # no quote closes it: csv would gather the rest of the file into one field
    body = 'prompt,n\na,1\nb,"runaway\n' + "".join(f"r{i},{i}\n" for i in range(300)) + "z,9\n"
    (tmp_path / "in.csv").write_text(body)
    source = open_input(str(tmp_path / "in.csv"), max_row_bytes=1000)
    inspection = source.inspect()
    schema, json_columns = inspection.schema({"prompt": "str"})
    rows = [r for batch in source.batches(schema, json_columns, RangeSet([])) for r in batch]
    assert inspection.num_rows == len(rows) == 303
    assert rows[1].error.startswith("in.csv:3: longer than 1000 bytes")
    assert [r.values["prompt"] for r in rows[2:]] == [f"r{i}" for i in range(300)] + ["z"]
