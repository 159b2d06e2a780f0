"""`batchinfer bench structured`: the realistic schemas compile within a time and memory
bound, the hostile ones are refused, and the command is wired."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from batchinfer.bench.cli import bench
from batchinfer.bench.structured import HOSTILE, REALISTIC, measure, refusal


@pytest.mark.parametrize("name", list(REALISTIC))
def test_realistic_schemas_compile_in_bounded_time_and_memory(name):
    """Check, build and walk an instance: well under a second (tens of milliseconds on an
    idle core; the bound leaves room for a shared machine) and a few MB at most."""
    cost = measure(*REALISTIC[name])
    assert cost.total_s < 1.0, cost
    assert cost.peak_bytes < 16 * 2**20, cost


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_constraints_are_refused_at_once(name):
    seconds, message = refusal(HOSTILE[name])
    assert seconds < 0.5 and "too large" in message and "(limit 100000)" in message


def test_allowed_tokens_are_timed_with_a_tokenizer(llama_dir):
    from transformers import AutoTokenizer

    from batchinfer.structured.regex_guide import VocabBytes, token_bytes
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    cost = measure(*REALISTIC["label"], tokenizer, VocabBytes(token_bytes(tokenizer)))
    assert cost.tokens_s is not None and cost.total_s < 2.0, cost


def test_structured_subcommand_is_wired():
    result = CliRunner().invoke(bench, ["structured", "--help"])
    assert result.exit_code == 0 and "Usage: bench structured" in result.output
    result = CliRunner().invoke(bench, ["structured", "--tokenizer", "no-such-shape"])
    assert result.exit_code == 2 and "--tokenizer" in result.output
