"""The example job files in jobs/ run as written on the built-in demo model."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow.dataset as ds
import pytest
from click.testing import CliRunner

from batchinfer.job.cli import run

JOBS = Path(__file__).resolve().parents[2] / "jobs"


def line_count(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if line.strip())


@pytest.mark.parametrize("name, rows, samples_per_row", [
    ("demo", line_count(JOBS / "data" / "demo.jsonl"), 1),
    ("reviews", 24, 1),
    ("chat", line_count(JOBS / "data" / "chat.jsonl"), 2),
    ("openai_batch", line_count(JOBS / "data" / "openai_batch.jsonl"), 1),
    ("templates", 24, 1),
])
def test_job_file_runs_as_written(tmp_path, demo_dir, name, rows, samples_per_row):
    # Only the output folder (kept out of the repository) and the length are overridden.
    out = tmp_path / name
    result = CliRunner().invoke(run, ["--config", str(JOBS / f"{name}.toml"), "--output",
                                      str(out), "--max-tokens", "4", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "random weights" in result.stderr  # the demo notice, printed plainly
    summary = json.loads((out / "__batchinfer__" / "summary.json").read_text())
    assert summary["rows"] == rows and summary["errors"] == 0
    assert summary["samples"] == rows * samples_per_row
    table = ds.dataset(out).to_table()
    assert table.num_rows == rows * samples_per_row
    if name == "reviews":
        assert sorted(table.column("id").to_pylist())[0] == "R1000"
        assert summary["prefix_cache_hit_rate"] > 0.3  # the shared system prompt
    if name == "templates":  # the last turn rendered from the row's columns
        first = table.filter(ds.field("id") == "R1000").to_pylist()[0]
        assert "Review (5 stars): The kettle boils fast" in first["prompt"]
        assert "You label kitchen product reviews" in first["prompt"]
    if name == "openai_batch":
        output = out / "__batchinfer__" / "openai_output.jsonl"
        assert line_count(output) == rows


def _run_recipe(tmp_path, name: str):
    out = tmp_path / name
    result = CliRunner().invoke(run, ["--config", str(JOBS / f"{name}.toml"), "--output",
                                      str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "__batchinfer__" / "summary.json").read_text())
    return ds.dataset(out).to_table().to_pylist(), summary


def test_the_review_label_schema_is_the_pydantic_models():
    pydantic = pytest.importorskip("pydantic")
    import importlib.util
    spec = importlib.util.spec_from_file_location("review_label",
                                                  JOBS / "data" / "review_label.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    written = json.loads((JOBS / "data" / "review_label.schema.json").read_text())
    assert written == module.ReviewLabel.model_json_schema()
    assert pydantic.VERSION


def test_recipe_label_reviews_retries_and_validates(tmp_path, demo_dir):
    import jsonschema
    rows, summary = _run_recipe(tmp_path, "label_reviews")
    schema = json.loads((JOBS / "data" / "review_label.schema.json").read_text())
    assert len(rows) == summary["rows"] == 24
    retried = [r for r in rows if r["attempts"] > 1]
    assert summary["retried"] == len(retried) > 0
    invalid = [r for r in rows if r["error"] is not None]
    assert summary["invalid"] == len(invalid)
    for r in invalid:
        assert r["attempts"] == 3 and r["finish_reason"] == "length"
        assert "cut off by max_tokens" in r["error"]
    for r in rows:
        if r["error"] is None:  # valid: an instance of the Pydantic model's schema
            jsonschema.validate(json.loads(r["completion"]), schema)
            assert r["finish_reason"] == "stop" and 1 <= r["attempts"] <= 3


def test_recipe_qa_pairs_renders_each_document(tmp_path, demo_dir):
    import jsonschema
    rows, summary = _run_recipe(tmp_path, "qa_pairs")
    schema = json.loads((JOBS / "data" / "qa_pairs.schema.json").read_text())
    assert sorted(r["doc_id"] for r in rows) == ["D1", "D2", "D3", "D4"]
    for r in rows:
        if r["error"] is None:
            pairs = json.loads(r["completion"])["pairs"]
            jsonschema.validate({"pairs": pairs}, schema)
    assert summary["errors"] == 0


def test_recipe_tool_calls_writes_calls(tmp_path, demo_dir):
    rows, _ = _run_recipe(tmp_path, "tool_calls")
    tools = {t["function"]["name"]
             for t in json.loads((JOBS / "data" / "tools.json").read_text())}
    assert len(rows) == 4
    for r in rows:
        if r["finish_reason"] != "stop":
            continue  # cut off inside its call: no call parsed, the text kept
        assert r["completion"] == "" and len(r["tool_calls"]) == 1
        call = r["tool_calls"][0]
        assert call["type"] == "function" and call["function"]["name"] in tools
        assert isinstance(json.loads(call["function"]["arguments"]), dict)
    assert any(r["tool_calls"] for r in rows)
