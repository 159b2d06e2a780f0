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
