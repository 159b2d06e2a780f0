"""`batchinfer bench structured`: the realistic schemas check and compile within a time and
memory bound, their masks are timed per token, the hostile ones are checked at once, and
the command is wired."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from batchinfer.bench.cli import bench
from batchinfer.bench.structured import HOSTILE, REALISTIC, compiler_for, measure, refusal


@pytest.mark.parametrize("name", list(REALISTIC))
def test_realistic_schemas_check_in_bounded_time_and_memory(name):
    """Checked by llguidance: well under a second (milliseconds on an idle core; the bound
    leaves room for a shared machine) and a few MB of Python memory at most."""
    cost = measure(*REALISTIC[name])
    assert cost.check_s < 1.0, cost
    assert cost.peak_bytes < 16 * 2**20, cost


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_constraints_are_checked_at_once(name):
    seconds, reason = refusal(HOSTILE[name])
    assert seconds < 0.5, (seconds, reason)


def test_masks_are_timed_with_a_tokenizer(llama_dir):
    cost = measure(*REALISTIC["label"], compiler_for(str(llama_dir)))
    assert cost.mask_s is not None and cost.num_tokens > 10
    assert cost.compile_s < 2.0 and cost.mask_per_token_s < 0.1, cost


def test_structured_subcommand_is_wired(llama_dir):
    result = CliRunner().invoke(bench, ["structured", "--help"])
    assert result.exit_code == 0 and "Usage: bench structured" in result.output
    result = CliRunner().invoke(bench, ["structured", "--tokenizer", "no-such-shape"])
    assert result.exit_code == 2 and "--tokenizer" in result.output
    result = CliRunner().invoke(bench, ["structured", "--tokenizer", str(llama_dir)])
    assert result.exit_code == 0, result.output
    assert "mask us/token" in result.output and "nested-counted-regex" in result.output
