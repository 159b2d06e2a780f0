"""Structured outputs with two tensor-parallel ranks (gloo, CPU, float32): the same tokens
as one process for regex, JSON-schema and choice constraints, greedy and sampled, and the
same error rows where a grammar passes one of llguidance's bounds while generating; the
plans sent to the workers carry no compiled grammar."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from batchinfer import LLM, SamplingParams
from batchinfer.engine.scheduler import NewRequestData, SchedulerOutput
from batchinfer.engine.tensor_parallel import _for_workers
from batchinfer.structured import grammar

PROMPTS = ["The river runs", "Once upon a time", "A short note on"]
PHONE = r"\d{3}-\d{4}"
NAME = r"[A-Z][a-z]{1,5} [0-9]{1,2}"
SCHEMA = {"type": "object", "properties": {"label": {"enum": ["pos", "neg"]},
                                           "score": {"type": "integer", "minimum": -99,
                                                     "maximum": 99},
                                           "tags": {"type": "array", "items": {"type": "string",
                                                                               "maxLength": 6},
                                                    "maxItems": 2}},
          "required": ["label", "score", "tags"]}
CHOICES = ["positive", "negative", "a neutral opinion"]

CASES = [
    SamplingParams(max_tokens=16, temperature=0.0, structured_outputs={"regex": PHONE}),
    SamplingParams(max_tokens=16, temperature=1.0, seed=7, n=2, structured_outputs={"regex": NAME}),
    SamplingParams(max_tokens=80, temperature=0.8, n=2, structured_outputs={"json": SCHEMA}),
    SamplingParams(max_tokens=80, temperature=0.9, top_p=0.9, seed=3,
                   structured_outputs={"json": SCHEMA}),
    SamplingParams(max_tokens=16, temperature=0.0, structured_outputs={"choice": CHOICES}),
    SamplingParams(max_tokens=16, temperature=1.0, seed=5, n=3,
                   structured_outputs={"choice": CHOICES}),
]
# one batch mixing the three constraints with unconstrained rows
MIXED = [
    SamplingParams(max_tokens=16, temperature=1.0, seed=11, structured_outputs={"regex": NAME}),
    SamplingParams(max_tokens=10, temperature=0.7, seed=2, ignore_eos=True),
    SamplingParams(max_tokens=16, temperature=1.0, n=2, structured_outputs={"choice": CHOICES}),
]


def test_plans_reach_workers_without_compiled_grammars():
    """A compiled grammar (llguidance's tokenizer and lexer) stays on rank 0, which alone
    samples; the plan rank 0 runs keeps it."""
    guide = object()
    regex = SamplingParams(structured_outputs={"regex": PHONE}).clone(compiled_grammar=guide)
    plain = SamplingParams()
    plan = SchedulerOutput(new_requests=[NewRequestData("a", [1, 2], 2, regex, [0], 0),
                                         NewRequestData("b", [3], 1, plain, [1], 0)])
    sent = _for_workers(plan)
    assert [new.params.compiled_grammar for new in sent.new_requests] == [None, None]
    assert sent.new_requests[0].params.structured_outputs.regex == PHONE
    assert sent.new_requests[1] is plan.new_requests[1]
    assert plan.new_requests[0].params.compiled_grammar is guide
    plain_plan = SchedulerOutput(new_requests=plan.new_requests[1:])
    assert _for_workers(plain_plan) is plain_plan


def _outcomes(outs) -> list:
    return [(out.error, [(c.token_ids, c.text, c.finish_reason) for c in out.outputs])
            for out in outs]


def _limits(llm: LLM) -> list:
    """A completion whose grammar passes one of llguidance's bounds while generating (the
    lexer's states, its work per token), beside a plain row; the patterns asked again
    (compiled, and past their bounds, already); then plain rows."""
    plain = SamplingParams(max_tokens=8, temperature=0.0)
    slow = SamplingParams(max_tokens=8, structured_outputs={"regex": "[a-z]{1,20}"})
    wide = "a(" + "|".join(f"x{i}" for i in range(40)) + ")"
    large = SamplingParams(max_tokens=8, temperature=1.0, seed=1, n=2,
                           structured_outputs={"regex": wide})
    with pytest.MonkeyPatch.context() as patch:  # on rank 0: no other rank compiles
        patch.setitem(grammar.LIMITS, "max_lexer_states", 20)
        failed_slow = llm.generate(PROMPTS[:2], [slow, plain])
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(grammar.LIMITS, "step_lexer_fuel", 100)
        failed_large = llm.generate(PROMPTS[:2], [large, plain])
    again = llm.generate(PROMPTS[:2], [slow, large])
    after = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.8, seed=4))
    return [_outcomes(outs) for outs in (failed_slow, failed_large, again, after)]


def _all_outcomes(llm: LLM) -> dict:
    got = {i: _outcomes(llm.generate(PROMPTS, params)) for i, params in enumerate(CASES)}
    got["mixed"] = _outcomes(llm.generate(PROMPTS, MIXED))
    got["limits"] = _limits(llm)
    bypass = SamplingParams(max_tokens=8, structured_outputs={"regex": "a"})
    bypass.structured_outputs.regex = "(?=a)"  # past the check
    got["bypass"] = _outcomes(llm.generate(PROMPTS[:1], bypass))
    return got


@pytest.fixture(scope="module")
def outcomes(llama_dir: Path) -> tuple[dict, dict]:
    """(one process's, two ranks'): the one process runs first, since the parallel layers'
    state is the process's (no engine may step beside a parallel one)."""
    kwargs = dict(dtype="float32", device="cpu", num_kv_blocks=64, seed=0)
    expected = _all_outcomes(LLM(str(llama_dir), **kwargs))
    two = LLM(str(llama_dir), tensor_parallel_size=2, **kwargs)
    try:
        return expected, _all_outcomes(two)
    finally:
        two.shutdown()


def _check_constrained(params: SamplingParams, outcome: list) -> None:
    """Each completion is what its constraint allows (the constraint was applied)."""
    so = params.structured_outputs
    for error, samples in outcome:
        assert error is None
        for _, text, finish_reason in samples:
            assert finish_reason == "stop", text
            if so.choice is not None:
                assert text in CHOICES
            elif so.json is not None:
                value = json.loads(text)
                assert list(value) == ["label", "score", "tags"] and value["label"] in ("pos",
                                                                                        "neg")
                assert isinstance(value["score"], int) and len(value["tags"]) <= 2
            else:
                assert re.fullmatch(so.regex, text), text


@pytest.mark.slow  # starts process groups
@pytest.mark.parametrize("case", range(len(CASES)))
def test_two_ranks_give_one_process_tokens(outcomes, case):
    expected, got = outcomes
    _check_constrained(CASES[case], expected[case])
    assert got[case] == expected[case]


@pytest.mark.slow  # starts process groups
def test_a_batch_mixing_constraints_and_plain_rows(outcomes):
    expected, got = outcomes
    assert got["mixed"] == expected["mixed"]
    (_, regex), _, (_, choice) = expected["mixed"]
    assert re.fullmatch(NAME, regex[0][1]) and {c[1] for c in choice} <= set(CHOICES)


@pytest.mark.slow  # starts process groups
def test_a_bound_while_generating_fails_that_completion_alike(outcomes):
    """An error row, the batch's other rows unchanged, the pattern refused after, and
    the ranks still in step."""
    expected, got = outcomes
    assert got["limits"] == expected["limits"]
    (slow, plain), (large, _), (slow_again, large_again), after = expected["limits"]
    assert "too many states" in slow[0] and slow[1][0][2] == "error"
    assert plain[0] is None and plain[1][0][2] == "length"
    assert "too many expressions" in large[0] and [c[2] for c in large[1]] == ["error", "error"]
    assert slow_again[0] == slow[0] and large_again[0] == large[0]
    assert len(after) == 3 and all(error is None for error, _ in after)


@pytest.mark.slow  # starts process groups
def test_a_pattern_llguidance_refuses_is_refused_alike(outcomes):
    expected, got = outcomes
    assert "look-around" in expected["bypass"][0][0]
    assert got["bypass"] == expected["bypass"]


@pytest.mark.slow  # starts process groups
@pytest.mark.parametrize("flags", [
    ["--regex", NAME, "--temperature", "1.0", "--seed", "3", "--n", "2"],
    ["--json-schema", json.dumps(SCHEMA), "--temperature", "0.8"],
    ["--choice", "positive", "--choice", "negative", "--temperature", "1.0"],
], ids=["regex", "json-schema", "choice"])
def test_job_flags_with_two_ranks_write_what_one_writes(tmp_path, llama_dir, flags):
    import pyarrow.dataset as ds
    from click.testing import CliRunner

    from batchinfer.job.cli import run
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"row {i} says"}) + "\n" for i in range(5)))
    timings = {"queue_s", "ttft_s", "tpot_s", "e2e_s"}
    rows = {}
    for tp in ("1", "2"):
        result = CliRunner().invoke(run, [
            str(path), "--model", str(llama_dir), "-o", str(tmp_path / f"out{tp}"),
            "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "32", "--max-tokens",
            "80", "--no-progress", "--tensor-parallel-size", tp, *flags])
        assert result.exit_code == 0, result.output
        table = ds.dataset(str(tmp_path / f"out{tp}")).to_table().to_pylist()
        rows[tp] = sorted(({k: v for k, v in r.items() if k not in timings} for r in table),
                          key=lambda r: (r["id"], r["sample_index"]))
    assert len(rows["2"]) == 5 * (2 if "--n" in flags else 1)
    assert rows["2"] == rows["1"]
    assert all(r["finish_reason"] == "stop" and r["error"] is None for r in rows["1"])
