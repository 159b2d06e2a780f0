"""Bad rows become failed output rows and never stop the job; fatal mistakes exit 2 with one
line, before any model is loaded."""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchinfer import SamplingParams
from batchinfer.bench.structured import HOSTILE, REALISTIC
from batchinfer.structured.grammar import MAX_JSON_DEPTH, MAX_SPEC_CHARS
from fake_engine import FakeEngine
from jobtools import corrupt_row_group, nested_list

GOOD = ["The river runs", "Once upon a time", "A short note on"]


def test_corrupted_jsonl_keeps_good_rows_and_flags_bad_ones(tmp_path, run_cli, reference_llm):
    long_prompt = " ".join(["word"] * 200)
    lines = [
        json.dumps({"prompt": GOOD[0], "n": 0}).encode(),
        b'{"prompt": "unterminated',                                   # bad JSON
        json.dumps({"prompt": 42, "n": 2}).encode(),                   # wrong type
        json.dumps({"prompt": ["a", "list"], "n": 3}).encode(),        # wrong type
        json.dumps({"prompt": GOOD[1], "n": 4}).encode(),
        json.dumps({"prompt": "", "n": 5}).encode(),                   # empty
        json.dumps({"prompt": "   ", "n": 6}).encode(),                # blank
        json.dumps({"n": 7}).encode(),                                 # missing
        json.dumps({"prompt": long_prompt, "n": 8}).encode(),          # longer than max_model_len
        b'{"prompt": "caf\xe9 latte", "n": 9}',                        # invalid UTF-8 (latin-1)
        b'[1, 2, 3]',                                                  # not an object
        json.dumps({"prompt": None, "n": 11}).encode(),                # null
        json.dumps({"prompt": GOOD[2], "n": 12}).encode(),
        b'{"prompt": "bad \\ud800 x", "n": 13}',                    # a lone surrogate
    ]
    (tmp_path / "bad.jsonl").write_bytes(b"\n".join(lines) + b"\n\n")
    result = run_cli(tmp_path / "bad.jsonl", "-o", tmp_path / "out", "--max-tokens", "4",
                     "--temperature", "0", "--max-model-len", "64")
    assert result.exit_code == 0, result.output
    rows = {r["id"]: r for r in ds.dataset(tmp_path / "out").to_table().to_pylist()}
    assert sorted(rows) == list(range(len(lines)))  # the trailing blank line is not a row

    expected = reference_llm.generate(GOOD, SamplingParams(max_tokens=4, temperature=0))
    for index, out in zip((0, 4, 12), expected):
        assert rows[index]["completion"] == out.outputs[0].text
        assert rows[index]["error"] is None and rows[index]["finish_reason"] != "error"
        assert rows[index]["n"] == index

    reasons = {1: "invalid JSON", 2: "must be text", 3: "must be text", 5: "empty",
               6: "empty", 7: "missing", 8: "max_model_len", 9: "invalid UTF-8",
               10: "expected a JSON object", 11: "missing", 13: "not valid Unicode"}
    for index, reason in reasons.items():
        row = rows[index]
        assert row["finish_reason"] == "error", index
        assert reason in row["error"], (index, row["error"])
        assert row["completion"] is None
    assert "bad.jsonl:2" in rows[1]["error"] and "bad.jsonl:10" in rows[9]["error"]
    # Values of failed rows are kept where they fit the column, else null.
    assert rows[2]["n"] == 2 and rows[2]["prompt"] is None and rows[8]["prompt"] == long_prompt
    summary = json.loads((tmp_path / "out" / "__batchinfer__" / "summary.json").read_text())
    assert summary["rows"] == len(lines) and summary["errors"] == len(reasons)
    # the over-long prompt's length is reported on its row, but it never ran: the
    # summary's prompt tokens are the good rows' alone
    assert rows[8]["prompt_tokens"] > 64
    assert summary["prompt_tokens"] == sum(rows[i]["prompt_tokens"] for i in (0, 4, 12))


def test_truncate_prompt_tokens_runs_long_rows(tmp_path, run_cli, reference_llm):
    long_prompt = " ".join(["word"] * 200)
    rows = [{"prompt": long_prompt}, {"prompt": GOOD[0]}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = run_cli(tmp_path / "in.jsonl", "-o", tmp_path / "out", "--max-tokens", "4",
                     "--temperature", "0", "--max-model-len", "64",
                     "--truncate-prompt-tokens", "32")
    assert result.exit_code == 0, result.output
    got = {r["id"]: r for r in ds.dataset(tmp_path / "out").to_table().to_pylist()}
    assert got[0]["error"] is None and got[0]["prompt_tokens"] == 32
    ids = reference_llm.get_tokenizer().encode(long_prompt)
    expected = reference_llm.generate([ids[-32:], GOOD[0]],
                                      SamplingParams(max_tokens=4, temperature=0))
    assert [got[0]["completion"], got[1]["completion"]] == [o.outputs[0].text for o in expected]
    fit = run_cli(tmp_path / "in.jsonl", "-o", tmp_path / "fit", "--max-tokens", "4",
                  "--temperature", "0", "--max-model-len", "64", "--ignore-eos",
                  "--truncate-prompt-tokens", "-1")
    assert fit.exit_code == 0, fit.output
    row = next(r for r in ds.dataset(tmp_path / "fit").to_table().to_pylist() if r["id"] == 0)
    assert row["prompt_tokens"] == 60 and row["output_tokens"] == 4  # room for max_tokens
    for value in ("0", "64"):  # 64 leaves no room for output within --max-model-len 64
        bad = run_cli(tmp_path / "in.jsonl", "-o", tmp_path / f"bad{value}", "--max-model-len",
                      "64", "--truncate-prompt-tokens", value)
        assert bad.exit_code == 2 and "--truncate-prompt-tokens" in bad.output, bad.output


HOSTILE_REGEX = HOSTILE["nested-counted-regex"]
DEEPER = functools.reduce(lambda inner, _: [inner], range(MAX_JSON_DEPTH), [])
HOSTILE_SCHEMA = HOSTILE["nested-maxItems-anyOf"]
DEEP = HOSTILE["maxItems-30-deep"]
STRINGS = REALISTIC["strings-1000x1000"][0]


def test_a_constraint_too_large_fails_its_row_alone(tmp_path, run_cli):
    """OpenAI lines whose regex or schema is past a bound, or that llguidance refuses, fail
    with an error naming the bound or the reason; the lines around them complete, hostile
    ones for an eager compiler (generated within llguidance's bounds per token, or ended
    at one) and an array of up to 1000 strings of up to 1000 characters among them."""
    bodies = {"digits": {"guided_regex": "[0-9]{2}"},
              "regex": {"guided_regex": HOSTILE_REGEX},
              "schema": {"response_format": {"type": "json_schema", "json_schema": {
                  "name": "nested", "schema": HOSTILE_SCHEMA}}},
              "deep": {"guided_json": DEEP},
              "deeper": {"guided_json": {"type": "array", "items": DEEPER}},
              "long": {"guided_regex": "a" * (MAX_SPEC_CHARS + 1)},
              "refused": {"guided_json": {"type": "array", "uniqueItems": True}},
              "strings": {"guided_json": STRINGS},
              "plain": {}}
    lines = [{"custom_id": name, "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "Answer:", "temperature": 0, "max_tokens": 6, **body}}
             for name, body in bodies.items()]
    (tmp_path / "batch.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    result = run_cli(tmp_path / "batch.jsonl", "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    rows = {r["custom_id"]: r for r in ds.dataset(tmp_path / "out").to_table().to_pylist()}
    assert f"nesting deeper than {MAX_JSON_DEPTH}" in rows["deeper"]["error"]
    assert f"regex too large: {MAX_SPEC_CHARS + 1} characters (limit {MAX_SPEC_CHARS})" \
        in rows["long"]["error"]
    assert 'Unimplemented keys: ["uniqueItems"]' in rows["refused"]["error"]
    for name in ("deeper", "long", "refused"):
        assert rows[name]["finish_reason"] == "error"
    assert rows["regex"]["error"] is None or "lexer error" in rows["regex"]["error"]
    for name in ("digits", "schema", "deep", "strings", "plain"):
        assert rows[name]["error"] is None and rows[name]["finish_reason"] in ("stop", "length")
    assert rows["strings"]["completion"].startswith("[")


def test_a_stop_asked_for_while_requests_are_added_is_seen_before_the_next(tmp_path):
    """Adding a request may build its pattern's automaton: a SIGTERM that arrives during
    one is seen before the next row's, not after the whole batch of them."""
    import io
    import signal

    from batchinfer.job.options import JobOptions
    from batchinfer.job.runner import run_job

    added = []

    class SignalledEngine(FakeEngine):
        def add_request(self, request_id, prompt, params, arrival_time=None):
            added.append(request_id)
            if len(added) == 1:
                signal.raise_signal(signal.SIGTERM)
            super().add_request(request_id, prompt, params, arrival_time)

    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"prompt": f"row {i}"}) + "\n"
                                               for i in range(200)))
    options = JobOptions(input=str(tmp_path / "in.jsonl"), model="stand-in",
                         output=str(tmp_path / "out"), max_tokens=2, progress=False)
    result = run_job(options, engine_factory=lambda model, kwargs: SignalledEngine(),
                     out=io.StringIO(), err=io.StringIO())
    assert result.exit_code == 128 + signal.SIGTERM and len(added) == 1


def test_a_large_plausible_schema_runs_as_the_jobs_constraint(tmp_path, run_cli):
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in GOOD))
    result = run_cli(tmp_path / "in.jsonl", "-o", tmp_path / "out", "--max-tokens", "6",
                     "--temperature", "0", "--json-schema", json.dumps(STRINGS))
    assert result.exit_code == 0, result.output
    rows = ds.dataset(tmp_path / "out").to_table().to_pylist()
    assert [r["error"] for r in rows] == [None] * len(GOOD)
    assert all(r["completion"].startswith("[") for r in rows)


@pytest.fixture
def no_model_load(monkeypatch):
    """Any attempt to load an engine fails the test: fatal errors must come first."""
    def refuse(model, kwargs):
        raise AssertionError("the model was loaded before the mistake was reported")
    monkeypatch.setattr("batchinfer.job.runner.load_engine", refuse)


def assert_fatal(result, *words: str) -> None:
    assert result.exit_code == 2, result.output
    message = result.stderr.strip()
    assert message.startswith("Error: ") and "\n" not in message, message
    for word in words:
        assert word in message, message


@pytest.mark.parametrize("flags, words", [
    (["--max-tokens", "0"], ["--max-tokens"]),
    (["--temperature", "-1"], ["--temperature"]),
    (["--top-p", "1.5"], ["--top-p"]),
    (["--max-num-seqs", "0"], ["--max-num-seqs"]),
    (["--block-size", "7"], ["--block-size"]),
    (["--kv-cache-memory", "4XB"], ["--kv-cache-memory"]),
    (["--reorder-window", "-1"], ["--reorder-window"]),
    (["--attention-backend", "fast"], ["--attention-backend"]),
    (["--kv-cache-dtype", "fp8_e5m2"], ["--kv-cache-dtype", "'auto', 'fp8', 'fp8_e4m3'"]),
    (["--max-tokens", "many"], ["--max-tokens"]),
    (["--prompt-column", "text", "--messages-column", "m"], ["--prompt-column"]),
    (["--output-format", "openai"], ["--output-format openai"]),
    (["--system-prompt", "@/nonexistent/system.txt"], ["--system-prompt"]),
    (["--chat-template", "/nonexistent/template.jinja"], ["--chat-template", "cannot read"]),
    (["--choice", ""], ["--choice", "non-empty strings"]),
    (["--regex", "(?=x)"], ["--regex", "look-around"]),
    (["--regex", "a", "--choice", "b"], ["--choice and --regex"]),
    (["--json-schema", '{"type": "array", "uniqueItems": true}'],
     ["--json-schema", "uniqueItems"]),
    (["--grammar", "start: nowhere"], ["--grammar", "unknown name"]),
    (["--grammar", "@/nonexistent/grammar.lark"], ["--grammar", "cannot read"]),
    (["--grammar", "start: x", "--json-object"], ["--json-object and --grammar"]),
    (["--json-schema", "{oops"], ["--json-schema", "not valid JSON"]),
    (["--json-schema", "@/nonexistent/schema.json"], ["--json-schema", "cannot read"]),
    (["--regex", "a" * (MAX_SPEC_CHARS + 1)], ["--regex", f"(limit {MAX_SPEC_CHARS})"]),
    (["--regex", HOSTILE_REGEX], ["--regex", "reaches a bound", "too many expressions"]),
    (["--json-schema", json.dumps(DEEPER)],
     ["--json-schema", f"nesting deeper than {MAX_JSON_DEPTH}"]),
    (["--chat-template", "BAD_TEMPLATE"], ["--chat-template", "line 1"]),
    (["--chat-template-kwargs", "enable_thinking=false"], ["--chat-template-kwargs", "JSON"]),
    (["--chat-template-kwargs", '["x"]'], ["--chat-template-kwargs", "must be an object"]),
    (["--chat-template-kwargs", '{"tokenize": true}'], ["cannot set tokenize"]),
    (["--device", "tpu"], ["--device", "'cpu', 'cuda' or 'cuda:N'"]),
    (["--device", "cuda:99"], ["--device 'cuda:99'"]),
    (["--tokenizer", "/nonexistent/tokenizer"], ["--tokenizer", "not found"]),
    (["--metrics-textfile", "/nonexistent/dir/m.prom"], ["--metrics-textfile"]),
    (["--metrics-textfile", "OUT/m.prom"], ["read as part of the Parquet dataset"]),
])
def test_bad_flag_values(tmp_path, run_cli, no_model_load, flags, words):
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}{{ m['content'] }}")
    flags = [f.replace("OUT", str(tmp_path / "out")).replace("BAD_TEMPLATE",
                                                             str(tmp_path / "bad.jinja"))
             for f in flags]
    assert_fatal(run_cli(tmp_path / "in.jsonl", "-o", tmp_path / "out", *flags), *words)
    assert not (tmp_path / "out").exists()


def test_fatal_input_and_model_mistakes(tmp_path, run_cli, no_model_load):
    (tmp_path / "in.jsonl").write_text('{"text": "hi", "label": 1}\n')
    assert_fatal(run_cli(tmp_path / "missing.jsonl", "-o", tmp_path / "o"), "missing.jsonl")
    assert_fatal(run_cli(tmp_path / "in.jsonl", "-o", tmp_path / "o"), "no prompt column",
                 "text, label")
    assert_fatal(run_cli(tmp_path / "in.jsonl", "-o", tmp_path / "o", "--prompt-column", "body"),
                 "--prompt-column", "'body'")
    assert_fatal(run_cli(tmp_path / "in.jsonl", "-o", tmp_path / "o", "--model",
                         str(tmp_path / "no-model"), model=False), "--model", "no-model")
    assert_fatal(run_cli(tmp_path / "in.jsonl", model=True), "--output")
    (tmp_path / "in.txt").write_text("hi\n")
    assert_fatal(run_cli(tmp_path / "in.txt", "-o", tmp_path / "o"), ".txt")
    (tmp_path / "num.jsonl").write_text('{"prompt": 1}\n{"prompt": 2}\n')
    assert_fatal(run_cli(tmp_path / "num.jsonl", "-o", tmp_path / "o"), "'prompt'", "--prompt-column")
    (tmp_path / "clash.jsonl").write_text('{"prompt": "hi", "completion": "x"}\n')
    assert_fatal(run_cli(tmp_path / "clash.jsonl", "-o", tmp_path / "o"), "completion")
    assert_fatal(run_cli(tmp_path / "in.jsonl", "-o", tmp_path / "in.jsonl" / "sub"),
                 "in.jsonl is a file, not a directory")
    assert_fatal(run_cli(tmp_path / "in.jsonl", "-o", tmp_path / "o", "--split", "test"),
                 "--split test", "has no splits")
    assert not (tmp_path / "o").exists()


def test_outdir_of_another_job_is_refused(tmp_path, run_cli):
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    out = tmp_path / "out"
    assert run_cli(tmp_path / "in.jsonl", "-o", out, "--max-tokens", "2").exit_code == 0
    again = run_cli(tmp_path / "in.jsonl", "-o", out, "--max-tokens", "2")
    assert again.exit_code == 0 and "already done" in again.stderr
    assert_fatal(run_cli(tmp_path / "in.jsonl", "-o", out, "--max-tokens", "3"),
                 "different job", "sampling.max_tokens", "--overwrite")
    replaced = run_cli(tmp_path / "in.jsonl", "-o", out, "--max-tokens", "3", "--overwrite")
    assert replaced.exit_code == 0, replaced.output
    assert ds.dataset(out).to_table().column("output_tokens").to_pylist()[0] <= 3
    assert len(list(out.glob("part-*.parquet"))) == 1

    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert_fatal(run_cli(tmp_path / "in.jsonl", "-o", other), "not empty")
    assert (other / "notes.txt").read_text() == "mine"


def test_ctrl_c_while_starting_exits_130(tmp_path, run_cli, monkeypatch):
    # before the job installs its own signal handling (while it reads and checks the
    # input), Ctrl-C is a KeyboardInterrupt: the exit code is still the shell's 130
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr("batchinfer.job.runner.run_job", interrupted)
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    result = run_cli(tmp_path / "in.jsonl", "-o", tmp_path / "out")
    assert result.exit_code == 130, result.output
    assert "Interrupted while starting" in result.stderr


@pytest.mark.parametrize("flags, words", [
    (["--logprobs", "100000"], ["--logprobs 100000 exceeds the vocabulary size"]),
    (["--stop-token-ids", "999999"], ["--stop-token-ids must be token ids in [0, "]),
])
def test_flags_beyond_the_models_vocabulary(tmp_path, run_cli, flags, words):
    # only the model knows its vocabulary: checked once it is loaded, before any row runs
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    assert_fatal(run_cli(tmp_path / "in.jsonl", "-o", tmp_path / "out", *flags), *words)
    assert not list((tmp_path / "out").glob("part-*"))


# ---- inputs that reach the limits of the parsers and of Parquet (the stand-in engine) ---
@pytest.fixture
def fake_cli(monkeypatch):
    """`batchinfer run` with the stand-in engine (no model): the job machinery alone."""
    from batchinfer.job.cli import run
    monkeypatch.setattr("batchinfer.job.runner.check_model", lambda model, tokenizer: None)
    monkeypatch.setattr("batchinfer.job.runner.load_engine", FakeEngine.factory)

    def invoke(*args):
        argv = ["--model", "stand-in", "--max-tokens", "2", "--no-progress", *map(str, args)]
        return CliRunner().invoke(run, argv, catch_exceptions=False)
    return invoke


def read_output(outdir) -> dict:
    """The output rows by id (every part file read, with one schema)."""
    return {r["id"]: r for r in ds.dataset(outdir).to_table().to_pylist()}


# A job in a process of its own: a crash (a C stack overflow) fails the test, not the run,
# and peak memory is the job's.
JOB_SCRIPT = """
import io, json, resource, sys, time
from fake_engine import FakeEngine
import batchinfer.config  # (torch: imported by the option checks, before any row is read)
from batchinfer.job.options import JobOptions
from batchinfer.job.runner import run_job
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
start = time.monotonic()
options = JobOptions(input=sys.argv[1], model="stand-in", output=sys.argv[2], max_tokens=2,
                     progress=False)
result = run_job(options, engine_factory=FakeEngine.factory, out=io.StringIO(),
                 err=io.StringIO())
print(json.dumps({"exit_code": result.exit_code, "seconds": time.monotonic() - start,
                  "growth_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base}))
"""


def run_job_process(source: Path, out: Path, timeout: float = 120) -> dict:
    proc = subprocess.run([sys.executable, "-c", JOB_SCRIPT, str(source), str(out)],
                          capture_output=True, text=True, timeout=timeout,
                          cwd=Path(__file__).parent)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def openai_line(custom_id: str, text: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "x", "messages": [{"role": "user", "content": text}], **body}}


def test_values_nested_too_deep_for_parquet_are_json_text_and_the_output_reads(tmp_path,
                                                                                fake_cli):
    # 50 nested lists: pyarrow writes such a column, but no Parquet reader opens the file;
    # one in a column the job reads (body.metadata of an OpenAI Batch line), one in another
    lines = [openai_line("a", "Hello", metadata={"deep": nested_list(50)}),
             openai_line("b", "Hi"), openai_line("c", "Hey")]
    lines[1]["extra"] = nested_list(60)
    (tmp_path / "batch.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    result = fake_cli(tmp_path / "batch.jsonl", "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    rows = read_output(tmp_path / "out")
    assert sorted(rows) == ["a", "b", "c"]
    import pandas as pd
    assert len(pd.read_parquet(tmp_path / "out")) == 3
    assert all(r["error"] is None and r["completion"] for r in rows.values())
    assert json.loads(rows["a"]["body"])["metadata"]["deep"] == nested_list(50)
    assert json.loads(rows["b"]["extra"]) == nested_list(60)
    # a run again finds the job done
    assert fake_cli(tmp_path / "batch.jsonl", "-o", tmp_path / "out").exit_code == 0


def test_json_nested_beyond_the_parser_fails_its_row_without_crashing(tmp_path):
    # Arrow's JSON reader overflows its stack on ~10,000 levels (the process dies);
    # Python's parser raises RecursionError
    deep = '{"prompt": "deep", "x": ' + "[" * 20_000 + "]" * 20_000 + "}"
    (tmp_path / "in.jsonl").write_text(f'{{"prompt": "a"}}\n{deep}\n{{"prompt": "b"}}\n')
    report = run_job_process(tmp_path / "in.jsonl", tmp_path / "out")
    assert report["exit_code"] == 0 and report["seconds"] < 30
    rows = read_output(tmp_path / "out")
    assert rows[1]["finish_reason"] == "error" and "in.jsonl:2" in rows[1]["error"]
    assert "nested too deeply" in rows[1]["error"]
    assert [rows[i]["completion"] is not None for i in (0, 2)] == [True, True]


def test_a_50mb_line_fails_while_read_in_bounded_memory(tmp_path):
    with open(tmp_path / "in.jsonl", "w") as f:
        f.write('{"prompt": "a"}\n{"prompt": "')
        for _ in range(50):
            f.write("x" * 1_000_000)
        f.write('"}\n{"prompt": "b"}\n')
    report = run_job_process(tmp_path / "in.jsonl", tmp_path / "out")
    assert report["exit_code"] == 0
    # without the limit: 1 GiB over the start with the stand-in engine (7.3 GB with a
    # real tokenizer), the row failing only at the engine's length check
    assert report["growth_mib"] < 100 and report["seconds"] < 10, report
    rows = read_output(tmp_path / "out")
    assert "in.jsonl:2: longer than 16777216 bytes" in rows[1]["error"]
    assert "--max-row-bytes" in rows[1]["error"] and rows[1]["prompt"] is None
    assert rows[0]["completion"] is not None and rows[2]["completion"] is not None


def test_max_row_bytes_flag(tmp_path, fake_cli):
    (tmp_path / "in.jsonl").write_text('{"prompt": "short"}\n{"prompt": "%s"}\n' % ("y" * 500))
    result = fake_cli(tmp_path / "in.jsonl", "-o", tmp_path / "out", "--max-row-bytes", "100")
    assert result.exit_code == 0, result.output
    rows = read_output(tmp_path / "out")
    assert rows[0]["error"] is None and "longer than 100 bytes" in rows[1]["error"]
    result = fake_cli(tmp_path / "in.jsonl", "-o", tmp_path / "out2", "--max-row-bytes", "0")
    assert_fatal(result, "--max-row-bytes")


def test_long_csv_fields_and_huge_integers_are_read(tmp_path, fake_cli):
    digits = "9" * 5000  # more than int() converts
    (tmp_path / "in.csv").write_text(f'prompt,n\n"{"z" * 200_000}",1\nhello,{digits}\nbye,3\n')
    result = fake_cli(tmp_path / "in.csv", "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    rows = read_output(tmp_path / "out")
    assert [rows[i]["error"] for i in range(3)] == [None] * 3
    assert [rows[i]["n"] for i in range(3)] == ["1", digits, "3"]
    (tmp_path / "in.jsonl").write_text(f'{{"prompt": "a", "n": {digits}}}\n{{"prompt": "b"}}\n')
    result = fake_cli(tmp_path / "in.jsonl", "-o", tmp_path / "out2")
    assert result.exit_code == 0, result.output
    assert read_output(tmp_path / "out2")[0]["n"] == digits


@pytest.mark.parametrize("body", [b"", b"truncated"])
def test_an_unreadable_parquet_file_exits_2_naming_it(tmp_path, fake_cli, no_model_load, body):
    if body:
        pq.write_table(pa.table({"prompt": ["a", "b"]}), tmp_path / "in.parquet")
        body = (tmp_path / "in.parquet").read_bytes()[:-30]
    (tmp_path / "in.parquet").write_bytes(body)
    assert_fatal(fake_cli(tmp_path / "in.parquet", "-o", tmp_path / "out"), "in.parquet",
                 "not a readable Parquet file")


def test_a_corrupt_parquet_page_fails_its_row_group_and_the_job_finishes(tmp_path, fake_cli):
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": [f"prompt number {i} " * 5 for i in range(3000)]}), path,
                   row_group_size=1000, compression="snappy")
    corrupt_row_group(path, 1)
    result = fake_cli(path, "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    rows = read_output(tmp_path / "out")
    assert len(rows) == 3000
    failed = sorted(i for i, r in rows.items() if r["finish_reason"] == "error")
    assert failed == list(range(1000, 2000))
    assert "row group 1 cannot be read" in rows[1500]["error"]
    again = fake_cli(path, "-o", tmp_path / "out")
    assert again.exit_code == 0 and "already done" in again.stderr


def test_input_names_that_are_not_utf8(tmp_path, fake_cli):
    folder = os.fsencode(tmp_path / "in")
    os.mkdir(folder)
    with open(folder + b"/caf\xe9.jsonl", "wb") as f:
        f.write(b'{"prompt": "a"}\n{"prompt": \n')
    for source in (os.fsdecode(folder), os.fsdecode(folder + b"/caf\xe9.jsonl")):
        out = tmp_path / f"out{len(source)}"
        result = fake_cli(source, "-o", out)
        assert result.exit_code == 0, result.output
        rows = read_output(out)
        assert rows[0]["error"] is None and rows[1]["error"].startswith("caf\ufffd.jsonl:2: ")
        assert fake_cli(source, "-o", out).exit_code == 0  # resumed: the same input


def test_an_outdir_inside_the_input_folder_is_not_input(tmp_path, fake_cli):
    (tmp_path / "data").mkdir()
    pq.write_table(pa.table({"prompt": ["a", "b", "c"]}), tmp_path / "data" / "in.parquet")
    out = tmp_path / "data" / "out"
    assert fake_cli(tmp_path / "data", "-o", out, "--limit", "2").exit_code == 0
    again = fake_cli(tmp_path / "data", "-o", out)  # continues: same input, one more row
    assert again.exit_code == 0, again.output
    assert sorted(read_output(out)) == [0, 1, 2]
    # another job's output in the folder is not input either
    other = fake_cli(tmp_path / "data", "-o", tmp_path / "elsewhere")
    assert other.exit_code == 0, other.output
    assert sorted(read_output(tmp_path / "elsewhere")) == [0, 1, 2]


def test_an_outdir_holding_a_column_too_deep_to_read_back_is_refused(tmp_path, fake_cli):
    # such an OUTDIR was written before these columns became JSON text: continuing it
    # would add parts no reader opens
    from batchinfer.job.schema import schema_to_json
    (tmp_path / "in.jsonl").write_text('{"prompt": "a", "x": 1}\n{"prompt": "b", "x": 2}\n')
    out = tmp_path / "out"
    assert fake_cli(tmp_path / "in.jsonl", "-o", out, "--limit", "1").exit_code == 0
    manifest_path = out / "__batchinfer__" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    deep = pa.schema([("prompt", pa.string()), ("x", pa.array([nested_list(50)]).type)])
    manifest["input_schema"] = schema_to_json(deep)
    manifest_path.write_text(json.dumps(manifest))
    assert_fatal(fake_cli(tmp_path / "in.jsonl", "-o", out), "nested deeper", "--overwrite")
