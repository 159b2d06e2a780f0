"""The bounds on a constraint, down to the engine's outputs: hostile regexes and schemas
(bombs for a compiler that builds automata eagerly, deep nesting, huge enums) are checked
or refused at once, generating under them costs a bounded time per token and ends at a
named bound, and a completion past a bound is an error row on its own."""
from __future__ import annotations

import random
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from batchinfer import LLM, SamplingParams, StructuredOutputsParams
from batchinfer.bench.structured import HOSTILE, REALISTIC, constraint_params, random_walk
from batchinfer.structured import grammar
from batchinfer.structured.grammar import (MAX_JSON_DEPTH, MAX_SPEC_CHARS, PROBE_SECONDS,
                                           GrammarCompiler, GrammarMatcher, probe)

HOSTILE_REGEX = HOSTILE["nested-counted-regex"]
BOMBS = {**HOSTILE, "nested-counted-3": "((a{1,1000}){1,1000}b?){2,1000}",
         "alternation-2000": "|".join(f"word{i}" for i in range(2000)),
         "class-7000-ranges": "[" + "\\u0100-\\u1100" * 7000 + "]"}


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(model=str(llama_dir), dtype="float32", seed=0)


@pytest.mark.parametrize("name", list(BOMBS))
def test_hostile_constraints_are_checked_fast_in_bounded_memory(name):
    constraint = BOMBS[name]
    kind = "regex" if isinstance(constraint, str) else "json"
    grammar._checked.cache_clear()
    tracemalloc.start()
    start = time.perf_counter()
    try:
        StructuredOutputsParams(**{kind: constraint})
        seconds = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert seconds < 0.5 and peak < 5 * 2**20, (seconds, peak)


@pytest.mark.parametrize("name", list(BOMBS))
def test_generating_under_hostile_constraints_is_bounded_per_token(llm, name):
    """Tokens drawn at random from each mask: every mask within tens of milliseconds
    (llguidance's per-token fuel; the bound leaves room for a shared machine), and the
    regex bombs end at llguidance's bound on the lexer, named."""
    compiler = llm.llm_engine.grammars
    steps = 60
    start = time.perf_counter()
    mask_s, masks, error = random_walk(compiler, BOMBS[name], steps, seed=0)
    assert mask_s / masks < 0.25 and time.perf_counter() - start < 30, (mask_s, masks)
    if name == "nested-counted-regex":
        assert error is not None and "too many expressions" in error


def test_nesting_length_and_size_are_bounded_before_llguidance_sees_them():
    with pytest.raises(ValueError, match=f"characters \\(limit {MAX_SPEC_CHARS}\\)"):
        StructuredOutputsParams(regex="a" * (MAX_SPEC_CHARS + 1))
    with pytest.raises(ValueError, match=f"nesting deeper than {MAX_JSON_DEPTH}"):
        StructuredOutputsParams(json="[" * 100_000)
    deep = HOSTILE["maxItems-30-deep"]
    StructuredOutputsParams(json=deep)  # 30 arrays deep: 61 levels of JSON
    with pytest.raises(ValueError, match="regex refused: .*nest"):
        StructuredOutputsParams(regex="(" * 10_000 + "a" + ")" * 10_000)
    with pytest.raises(ValueError, match=r"too big \(limit for this grammar"):
        with pytest.MonkeyPatch.context() as patch:
            patch.setitem(grammar.LIMITS, "initial_lexer_fuel", 10)
            grammar._checked.cache_clear()
            StructuredOutputsParams(regex="[a-z]{1,20}x")
    grammar._checked.cache_clear()


def test_a_completion_past_a_bound_can_only_end(llm, monkeypatch):
    """A matcher past llguidance's bound on its lexer states allows only the
    end-of-sequence tokens from then on, and says why; the grammar's lexer is shared by
    its completions, so another one ends too as it next needs a lexer state."""
    compiler = llm.llm_engine.grammars
    eos = frozenset(compiler.eos_token_ids)
    monkeypatch.setitem(grammar.LIMITS, "max_lexer_states", 20)
    start = compiler.compile(StructuredOutputsParams(regex="[a-z]{1,20}y").grammar_text())
    monkeypatch.undo()
    row = np.empty(-(-compiler.vocab_size // 32), dtype=np.int32)
    matcher, other = GrammarMatcher(start), GrammarMatcher(start)
    ids = compiler.hf_tokenizer.encode("abcdefghij", add_special_tokens=False)
    for i in range(len(ids) + 1):
        matcher.fill(ids[:i], eos, row)
        if matcher.error is not None:
            break
    assert "too many states" in matcher.error and "20" in matcher.error
    allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")).tolist()
    assert allowed == sorted(eos)
    other.fill([], eos, row)
    assert other.error == matcher.error
    assert np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")).tolist() \
        == sorted(eos)


def test_the_engine_fails_that_completion_alone(llm, monkeypatch):
    regex = SamplingParams(max_tokens=8, structured_outputs={"regex": "[a-z]{1,20}z"})
    plain = SamplingParams(max_tokens=8, temperature=0)
    prompts = ["The river runs", "Once upon a time"]
    expected = llm.generate(prompts[1:], plain)[0].outputs[0].text
    monkeypatch.setitem(grammar.LIMITS, "max_lexer_states", 20)
    llm.llm_engine.grammars._compiled.clear()
    failed, other = llm.generate(prompts, [regex, plain])
    assert failed.outputs[0].finish_reason == "error" and "too many states" in failed.error
    assert other.error is None and other.outputs[0].text == expected
    monkeypatch.undo()  # the compiled grammar, kept, stays past its bound
    again = llm.generate(prompts[:1], regex)[0]
    assert again.error == failed.error and again.outputs[0].finish_reason == "error"
    assert len(again.outputs[0].token_ids) <= 1  # at most the end-of-sequence token
    llm.llm_engine.grammars._compiled.clear()  # compiled again: within its bounds
    fresh = llm.generate(prompts[:1], regex)[0]
    assert fresh.error is None and fresh.outputs[0].finish_reason in ("stop", "length")
    # a constraint changed after the params were checked is checked again by the engine
    bypass = SamplingParams(max_tokens=8, structured_outputs={"regex": "a"})
    bypass.structured_outputs.regex = "(?=a)"
    out = llm.generate(prompts[:1], bypass)[0]
    assert out.outputs[0].finish_reason == "error" and "look-around" in out.error


def test_random_walks_are_reproducible(llm):
    compiler = llm.llm_engine.grammars
    first = random_walk(compiler, r"[a-c]{0,30}", 20, seed=random.Random(4).randint(0, 9))
    again = random_walk(compiler, r"[a-c]{0,30}", 20, seed=random.Random(4).randint(0, 9))
    assert first[1:] == again[1:]


def test_the_probe_before_a_job_finds_the_regex_bomb_and_passes_the_realistic(llm):
    """grammar.probe, which a job runs on its constraint before the model loads: the
    nested counted regex reaches llguidance's bound on the lexer; the realistic schemas
    and the other hostile constraints, within their bounds, do not."""
    engine = llm.llm_engine
    constraints = {**{name: schema for name, (schema, _) in REALISTIC.items()}, **HOSTILE}
    for name, constraint in constraints.items():
        compiler = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size,
                                   engine.eos_token_ids)  # (a lexer of its own)
        start = time.perf_counter()
        error = probe(compiler, constraint_params(constraint).grammar_text())
        assert time.perf_counter() - start < 2 * PROBE_SECONDS
        if name == "nested-counted-regex":
            assert error is not None and "too many expressions" in error
        else:
            assert error is None, (name, error)
