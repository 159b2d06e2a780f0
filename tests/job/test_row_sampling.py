"""--sampling-columns: a row's columns named like the sampling flags override the job's
values for that row; a bad value fails its row alone, naming the column; a named column
the input lacks exits 2 before the model loads."""
from __future__ import annotations

import json

import pyarrow.dataset as ds
import pytest

from batchinfer import SamplingParams
from batchinfer.job.row_sampling import RowSampling

PROMPT = "The river runs"


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_rows(out) -> dict:
    return {r["id"]: r for r in ds.dataset(out).to_table().to_pylist()}


def test_per_row_max_tokens_and_seed(tmp_path, run_cli, reference_llm):
    rows = [{"prompt": PROMPT, "max_tokens": 3, "seed": 7},
            {"prompt": PROMPT, "max_tokens": 6, "seed": 7},
            {"prompt": PROMPT, "max_tokens": None, "seed": 11},
            {"prompt": "Once upon a time", "max_tokens": 5, "seed": None}]
    data = write_rows(tmp_path / "in.jsonl", rows)
    result = run_cli(data, "-o", tmp_path / "out", "--sampling-columns", "--ignore-eos",
                     "--max-tokens", "4", "--temperature", "1.0", "--seed", "3")
    assert result.exit_code == 0, result.output
    out = read_rows(tmp_path / "out")
    for i, want in enumerate((3, 6, 4, 5)):  # a null takes the job's --max-tokens
        assert out[i]["output_tokens"] == want and out[i]["finish_reason"] == "length"
    # the row's seed (else the job's) makes the row's sampling what it is alone
    for i, (tokens, seed) in enumerate(((3, 7), (6, 7), (4, 11), (5, 3))):
        ref = reference_llm.generate([rows[i]["prompt"]], SamplingParams(
            max_tokens=tokens, temperature=1.0, seed=seed, ignore_eos=True))[0]
        assert out[i]["completion"] == ref.outputs[0].text, i
    # rows 0 and 1 share a prompt and a seed: the shorter is the longer's start
    assert out[1]["completion"].startswith(out[0]["completion"])


def test_a_bad_value_fails_only_its_row_naming_the_column(tmp_path, run_cli):
    rows = [{"prompt": PROMPT, "temperature": 0.0},
            {"prompt": PROMPT, "temperature": -1.0},
            {"prompt": PROMPT, "top_p": 2.0},
            {"prompt": PROMPT, "n": 500},
            {"prompt": PROMPT, "json_schema": {"type": "nonsense"}},
            {"prompt": PROMPT, "regex": "(unclosed"},
            {"prompt": PROMPT, "choice": ["yes", "no"], "regex": "a+"},
            {"prompt": PROMPT, "stop": 5},
            {"prompt": PROMPT, "choice": ["yes", "no"]}]
    data = write_rows(tmp_path / "in.jsonl", rows)
    result = run_cli(data, "-o", tmp_path / "out", "--sampling-columns", "--max-tokens", "3")
    assert result.exit_code == 0, result.output
    out = read_rows(tmp_path / "out")
    assert out[0]["error"] is None and out[0]["output_tokens"] >= 1
    assert out[8]["error"] is None and out[8]["completion"] in ("yes", "no")
    for i, column in ((1, "temperature"), (2, "top_p"), (3, "n"), (4, "json_schema"),
                      (5, "regex"), (6, "choice"), (7, "stop")):
        assert out[i]["finish_reason"] == "error", (i, out[i])
        assert f"'{column}'" in out[i]["error"], (i, out[i]["error"])


def test_a_named_column_the_input_lacks_exits_2(tmp_path, run_cli, monkeypatch):
    data = write_rows(tmp_path / "in.jsonl", [{"prompt": PROMPT, "seed": 1}])
    monkeypatch.setattr("batchinfer.job.runner.load_engine", model_must_not_load)
    result = run_cli(data, "-o", tmp_path / "out", "--sampling-columns", "max_tokens,seed")
    assert result.exit_code == 2
    assert ("--sampling-columns: no column 'max_tokens' in INPUT (columns: prompt, seed)"
            in result.output)
    assert not (tmp_path / "out").exists()
    result = run_cli(data, "-o", tmp_path / "out", "--sampling-columns", "max_tokens,color")
    assert result.exit_code == 2 and "'color' is not a sampling column" in result.output


def model_must_not_load(*args):
    raise AssertionError("the model was loaded")


def test_only_the_named_columns_apply(tmp_path, run_cli):
    rows = [{"prompt": PROMPT, "max_tokens": 2, "n": 3}]
    data = write_rows(tmp_path / "in.jsonl", rows)
    result = run_cli(data, "-o", tmp_path / "out", "--sampling-columns", "max_tokens",
                     "--ignore-eos")
    assert result.exit_code == 0, result.output
    table = ds.dataset(tmp_path / "out").to_table().to_pylist()
    assert len(table) == 1 and table[0]["output_tokens"] == 2  # n is an ordinary column


def test_a_rows_n_gives_that_many_samples(tmp_path, run_cli):
    rows = [{"prompt": PROMPT, "n": 3}, {"prompt": PROMPT, "n": None}]
    data = write_rows(tmp_path / "in.jsonl", rows)
    result = run_cli(data, "-o", tmp_path / "out", "--sampling-columns", "n", "--max-tokens",
                     "2", "--temperature", "1.0")
    assert result.exit_code == 0, result.output
    table = ds.dataset(tmp_path / "out").to_table().to_pylist()
    samples = sorted((r["id"], r["sample_index"]) for r in table)
    assert samples == [(0, 0), (0, 1), (0, 2), (1, 0)]


def test_sampling_columns_in_a_job_file(tmp_path, run_cli):
    write_rows(tmp_path / "in.jsonl", [{"prompt": PROMPT, "max_tokens": 3, "seed": 1}])
    for value, tokens in (("true", 3), ('["seed"]', 5)):
        job = tmp_path / "job.toml"
        job.write_text(f'input = "in.jsonl"\noutput = "out-{tokens}"\nmax-tokens = 5\n'
                       f'ignore-eos = true\nsampling-columns = {value}\n')
        result = run_cli("--config", job)
        assert result.exit_code == 0, result.output
        row = ds.dataset(tmp_path / f"out-{tokens}").to_table().to_pylist()[0]
        assert row["output_tokens"] == tokens


def test_openai_lines_keep_their_own_settings(tmp_path, run_cli):
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2,
            "ignore_eos": True}
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body}
    data = write_rows(tmp_path / "in.jsonl", [line])
    result = run_cli(data, "-o", tmp_path / "out", "--max-tokens", "5")
    assert result.exit_code == 0, result.output
    assert read_rows(tmp_path / "out")["a"]["output_tokens"] == 2


@pytest.mark.parametrize("values, message", [
    ({"max_tokens": "8"}, "column 'max_tokens' must be a number"),
    ({"max_tokens": True}, "column 'max_tokens' must be a number"),
    ({"max_tokens": 0}, "column 'max_tokens'"),
    ({"top_k": 2.5}, "column 'top_k'"),
    ({"json_schema": "{not json"}, "column 'json_schema': not valid JSON"),
    ({"choice": []}, "column 'choice'"),
])
def test_row_sampling_values(values, message):
    with pytest.raises(ValueError, match=message):
        RowSampling(list(values), 8).apply(values, SamplingParams())


def test_row_sampling_takes_whole_floats_and_json_text():
    params = RowSampling(["max_tokens", "choice", "stop"], 8).apply(
        {"max_tokens": 8.0, "choice": '["a", "b"]', "stop": "\n"}, SamplingParams(n=2))
    assert params.max_tokens == 8 and params.n == 2 and params.stop == ["\n"]
    assert params.structured_outputs.choice == ["a", "b"]
    # a JSON-text column (a JSONL column of mixed kinds) holds its numbers as JSON
    params = RowSampling(["seed"], 8, {"seed"}).apply({"seed": "42"}, SamplingParams())
    assert params.seed == 42
