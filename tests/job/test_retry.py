"""Validate and retry (--max-attempts): invalid completions are generated again with a
derived seed before their row is committed, exactly once under kills."""
from __future__ import annotations

import io
import json
import os
import re
import signal
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from batchinfer.job.options import JobOptions
from batchinfer.job.retry import invalid_reason, retry_seed
from batchinfer.job.runner import run_job
from batchinfer.sampling_params import StructuredOutputsParams
from fake_engine import SeededEngine
from faults import Faults
from kill_sweep import in_child

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_invalid_reasons():
    choice = StructuredOutputsParams(choice=["yes", "no"])
    assert invalid_reason("yes", "stop", choice) is None
    assert "not one of the choices" in invalid_reason("yess", "stop", choice)
    assert "cut off by max_tokens" in invalid_reason("ye", "length", choice)
    regex = StructuredOutputsParams(regex=r"[A-Z]{2}-\d{3}")
    assert invalid_reason("AB-123", "stop", regex) is None
    assert "does not match the regex" in invalid_reason("AB-1234", "stop", regex)  # whole
    assert "does not match the regex" in invalid_reason("xAB-123", "stop", regex)
    schema = StructuredOutputsParams(json=SCHEMA)
    assert invalid_reason('{"a": 3}', "stop", schema) is None
    assert "not JSON" in invalid_reason('{"a": 3', "stop", schema)
    assert "at /a" in invalid_reason('{"a": "x"}', "stop", schema)
    assert "'a' is a required property" in invalid_reason('{"b": 1}', "stop", schema)
    as_text = StructuredOutputsParams(json=json.dumps(SCHEMA))
    assert "at /a" in invalid_reason('{"a": 1.5}', "stop", as_text)
    assert "cut off" in invalid_reason('{"a": 3}', "length", schema)  # even when it parses


def test_retry_seeds_are_reproducible_and_distinct():
    seeds = {retry_seed(None, "row-7", s, a) for s in range(4) for a in range(2, 6)}
    assert len(seeds) == 16 and all(0 <= s < 2 ** 62 for s in seeds)
    assert retry_seed(None, "row-7", 0, 2) == retry_seed(None, "row-7", 0, 2)
    assert retry_seed(None, "row-7", 0, 2) != retry_seed(None, "row-8", 0, 2)
    # a seeded row: sample i of seed s is seed s + i, as the engine seeds samples
    assert retry_seed(5, "a", 1, 3) == retry_seed(6, "b", 0, 3)
    assert retry_seed(5, "a", 0, 3) != retry_seed(5, "a", 0, 2)


REPLIES = "x|7|42|nope|y|1234"  # the first attempt (no seed) gets "x", which never matches


def write_rows(path: Path, rows: int = 20) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"row {i}|replies:{REPLIES}"}) + "\n"
                            for i in range(rows)))
    return path


def options(tmp_path: Path, out: str = "out", **kwargs) -> JobOptions:
    path = tmp_path / "in.jsonl"
    if not path.exists():
        write_rows(path)
    kwargs = {"regex": r"\d{1,3}", "max_attempts": 3, "temperature": 1.0, "max_tokens": 8,
              "progress": False, "reorder_window": 0, **kwargs}
    return JobOptions(input=str(path), model="stand-in", output=str(tmp_path / out), **kwargs)


def run_seeded(opts: JobOptions):
    return run_job(opts, lambda m, k: SeededEngine(4), out=io.StringIO(), err=io.StringIO())


def rows_of(out: Path) -> list[dict]:
    return sorted(ds.dataset(out, format="parquet").to_table().to_pylist(),
                  key=lambda r: (r["id"], r["sample_index"]))


def comparable(rows: list[dict]) -> list[dict]:
    """Rows without their timings."""
    return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rows]


@pytest.mark.parametrize("n", [1, 3])
def test_invalid_samples_are_retried_up_to_max_attempts(tmp_path, n):
    result = run_seeded(options(tmp_path, n=n))
    assert result.exit_code == 0
    rows = rows_of(tmp_path / "out")
    assert len(rows) == 20 * n
    for r in rows:
        assert 2 <= r["attempts"] <= 3, r  # the first attempt never matches
        if r["error"] is None:
            assert re.fullmatch(r"\d{1,3}", r["completion"]), r
        else:  # still invalid after 3: its last output, why, and its finish_reason
            assert r["attempts"] == 3 and not re.fullmatch(r"\d{1,3}", r["completion"]), r
            assert "does not match the regex" in r["error"] and r["finish_reason"] == "stop"
    attempts = {r["attempts"] for r in rows}
    assert attempts == {2, 3}
    assert {r["error"] is None for r in rows if r["attempts"] == 3} == {True, False}
    summary = result.summary
    assert summary["retried"] == len(rows) and summary["errors"] == 0
    assert summary["invalid"] == sum(r["error"] is not None for r in rows)
    # a rerun derives the same seeds: the same outputs
    assert run_seeded(options(tmp_path, out="again", n=n)).exit_code == 0
    assert comparable(rows_of(tmp_path / "again")) == comparable(rows)


def test_one_attempt_leaves_outputs_unchecked(tmp_path):
    """--max-attempts 1, the default: outputs are as the engine gives them (as vLLM's)."""
    result = run_seeded(options(tmp_path, max_attempts=1))
    rows = rows_of(tmp_path / "out")
    assert {(r["completion"], r["attempts"], r["error"]) for r in rows} == {("x", 1, None)}
    assert result.summary["retried"] == 0 and result.summary["invalid"] == 0


def test_greedy_rows_are_not_retried(tmp_path):
    run_seeded(options(tmp_path, temperature=0.0))
    assert {r["attempts"] for r in rows_of(tmp_path / "out")} == {1}


def test_rows_without_a_constraint_are_not_checked(tmp_path):
    result = run_seeded(options(tmp_path, regex=None))
    rows = rows_of(tmp_path / "out")
    assert {(r["completion"], r["attempts"], r["error"]) for r in rows} == {("x", 1, None)}
    assert result.summary["invalid"] == 0


def test_per_line_constraints_and_response_format_are_retried(tmp_path):
    schema_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    bodies = {
        "schema": ({"response_format": schema_format}, 'x|{"a": 1}|{"a": "one"}|[1]'),
        "regex": ({"guided_regex": "[a-z]+"}, "1|2|abc|3"),
        "choice": ({"structured_outputs": {"choice": ["red", "green"]}}, "x|blue|green"),
        "free": ({}, "x|y"),
    }
    lines = [{"custom_id": f"{name}-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": f"q{i}|replies:{replies}"}],
                       "temperature": 1.0, **body}}
             for name, (body, replies) in bodies.items() for i in range(6)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    result = run_seeded(options(tmp_path, regex=None, max_attempts=4, output_format="openai"))
    assert result.exit_code == 0
    rows = {r["id"]: r for r in rows_of(tmp_path / "out")}
    for i in range(6):
        schema_row = rows[f"schema-{i}"]
        assert schema_row["attempts"] >= 2
        if schema_row["error"] is None:
            assert isinstance(json.loads(schema_row["completion"])["a"], int)
        else:
            assert schema_row["attempts"] == 4
        regex_row = rows[f"regex-{i}"]
        assert (regex_row["completion"] == "abc") == (regex_row["error"] is None)
        choice_row = rows[f"choice-{i}"]
        assert (choice_row["completion"] == "green") == (choice_row["error"] is None)
        assert rows[f"free-{i}"]["attempts"] == 1 and rows[f"free-{i}"]["error"] is None
    assert any(rows[f"schema-{i}"]["error"] is None for i in range(6))
    errors = [rows[f"schema-{i}"]["error"] for i in range(6) if rows[f"schema-{i}"]["error"]]
    assert all("JSON schema" in e or "not JSON" in e for e in errors)
    # the Batch output keeps the last completion (status 200); the error is the Parquet's
    out = [json.loads(line) for line in
           (tmp_path / "out" / "__batchinfer__" / "openai_output.jsonl").open()]
    by_id = {o["custom_id"]: o["response"] for o in out}
    assert by_id["choice-0"]["status_code"] == 200
    assert by_id["choice-0"]["body"]["choices"][0]["message"]["content"] \
        == rows["choice-0"]["completion"]


class KilledAtARetry(SeededEngine):
    """Kills the process (SIGKILL) when asked for the `at`-th attempt beyond the first."""

    def __init__(self, at: int):
        super().__init__(4)
        self.at = at

    def add_request(self, request_id, prompt, params, *args, **kwargs):
        if ":" in request_id:  # a sample asked for again
            self.at -= 1
            if self.at == 0:
                os.kill(os.getpid(), signal.SIGKILL)
        super().add_request(request_id, prompt, params, *args, **kwargs)


@pytest.mark.parametrize("at", [1, 9, 25])
def test_a_kill_between_attempts_recomputes_the_row_once(tmp_path, at):
    """SIGKILL while rows wait for another attempt (some rows committed before): the
    restart computes those rows again from attempt 1 and writes each exactly once, as a
    clean run does."""
    assert run_seeded(options(tmp_path, out="clean")).exit_code == 0
    opts = options(tmp_path, commit_rows=3)

    def killed_run() -> int:
        return run_job(opts, lambda m, k: KilledAtARetry(at), out=io.StringIO(),
                       err=io.StringIO()).exit_code

    assert in_child(killed_run, None) == "killed"  # (killed by the engine, not a fault)
    seen = [r["id"] for r in rows_of(tmp_path / "out")] if (tmp_path / "out").exists() else []
    assert len(seen) == len(set(seen)) < 20
    with Faults() as faults:  # (file operations still counted, none failing)
        assert run_seeded(opts).exit_code == 0
    assert faults.steps > 0
    assert comparable(rows_of(tmp_path / "out")) == comparable(rows_of(tmp_path / "clean"))


@pytest.mark.slow
def test_a_real_model_retries_outputs_cut_off_by_max_tokens(tmp_path, run_cli):
    """The random-weight model under a regex often needs more than 3 tokens: such samples
    end by length and are generated again, until one fits or 6 attempts are spent."""
    prompts = [f"Question {i}:" for i in range(8)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n"
                                               for p in prompts))
    flags = ["--regex", "[a-z]{2,8}", "--max-tokens", "3", "--temperature", "1",
             "--seed", "3", "--max-attempts", "6"]
    for out in ("out", "again"):
        result = run_cli(tmp_path / "in.jsonl", "-o", tmp_path / out, *flags)
        assert result.exit_code == 0, result.output
    rows = rows_of(tmp_path / "out")
    for r in rows:
        if r["error"] is None:
            assert r["finish_reason"] == "stop" and re.fullmatch("[a-z]{2,8}", r["completion"])
        else:
            assert r["attempts"] == 6 and r["finish_reason"] == "length"
            assert "cut off by max_tokens" in r["error"]
    assert any(r["attempts"] > 1 and r["error"] is None for r in rows)
    summary = json.loads((tmp_path / "out" / "__batchinfer__" / "summary.json").read_text())
    assert summary["retried"] == sum(r["attempts"] > 1 for r in rows)
    assert summary["invalid"] == sum(r["error"] is not None for r in rows)
    again = rows_of(tmp_path / "again")
    assert [(r["completion"], r["attempts"]) for r in again] \
        == [(r["completion"], r["attempts"]) for r in rows]
