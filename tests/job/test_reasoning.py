"""--reasoning-parser in a job: the `reasoning` column, the OpenAI output's
reasoning_content, the flag in the job's identity (the stand-in engine's replies carry
the tags, tests/job/fake_engine.py)."""
import json

import pyarrow.dataset as ds
import pytest
from click.testing import CliRunner

from fake_engine import FakeEngine


@pytest.fixture
def fake_cli(monkeypatch):
    from batchinfer.job.cli import run
    monkeypatch.setattr("batchinfer.job.runner.check_model", lambda model, tokenizer: None)
    monkeypatch.setattr("batchinfer.job.runner.load_engine", FakeEngine.factory)

    def invoke(*args):
        argv = ["--model", "stand-in", "--no-progress", *map(str, args)]
        return CliRunner().invoke(run, argv, catch_exceptions=False)
    return invoke


def rows(outdir):
    return {r["id"]: r for r in ds.dataset(outdir).to_table().to_pylist()}


PROMPTS = ["a|reply:<think>why</think>yes",     # the model opens the tag
           "b<think>|reply:why</think>yes",     # the prompt opened it
           "c<think>|reply:still thinking",     # cut off inside the reasoning
           "d<think></think>|reply:yes"]        # the prompt closed it


def test_reasoning_column(tmp_path, fake_cli):
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    result = fake_cli(tmp_path / "in.jsonl", "-o", tmp_path / "out",
                      "--reasoning-parser", "deepseek_r1")
    assert result.exit_code == 0, result.output
    out = rows(tmp_path / "out")
    got = [(out[i]["reasoning"], out[i]["completion"], out[i]["finish_reason"]) for i in range(4)]
    assert got == [("why", "yes", "length"), ("why", "yes", "length"),
                   ("still thinking", "", "length"), (None, "yes", "length")]
    # without the flag: no column, and the same OUTDIR is another job
    result = fake_cli(tmp_path / "in.jsonl", "-o", tmp_path / "plain")
    assert "reasoning" not in ds.dataset(tmp_path / "plain").schema.names
    assert rows(tmp_path / "plain")[0]["completion"] == "<think>why</think>yes"
    result = fake_cli(tmp_path / "in.jsonl", "-o", tmp_path / "out")
    assert result.exit_code == 2 and "reasoning_parser" in result.output


def test_openai_output_has_reasoning_content(tmp_path, fake_cli):
    line = {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [
                {"role": "user", "content": "q|reply:<think>six times seven</think>42"}]}}
    (tmp_path / "in.jsonl").write_text(json.dumps(line) + "\n")
    result = fake_cli(tmp_path / "in.jsonl", "-o", tmp_path / "out", "--reasoning-parser",
                      "qwen3", "--output-format", "openai")
    assert result.exit_code == 0, result.output
    response = json.loads((tmp_path / "out" / "__batchinfer__" / "openai_output.jsonl")
                          .read_text())["response"]
    message = response["body"]["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "42",
                       "reasoning_content": "six times seven"}


def test_unknown_parser_is_one_line(tmp_path, fake_cli):
    (tmp_path / "in.jsonl").write_text('{"prompt": "x"}\n')
    result = fake_cli(tmp_path / "in.jsonl", "-o", tmp_path / "out", "--reasoning-parser", "r1")
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "--reasoning-parser" in result.output
    assert not (tmp_path / "out").exists()
