"""The bounds on a pattern's automaton: counted repeats built once with a counter (checked
against the parse tree's own meaning), the size refused from the tree before anything is
built, and the limits that hold while the DFA is built, down to the engine's outputs."""
from __future__ import annotations

import json
import random
import re
import time
import tracemalloc
from pathlib import Path

import pytest
import torch

from batchinfer import LLM, SamplingParams
from batchinfer.bench.structured import HOSTILE, REALISTIC
from batchinfer.structured import regex_automaton, regex_guide
from batchinfer.structured.json_schema import json_schema_regex
from batchinfer.structured.regex_automaton import RegexAutomaton
from batchinfer.structured.regex_guide import RegexGuide, RegexMatcher, VocabBytes
from batchinfer.structured.regex_syntax import (MAX_NFA_STATES, MAX_PATTERN_CHARS,
                                                RegexTooLarge, check_pattern, measure, parse)

HOSTILE_REGEX = HOSTILE["nested-counted-regex"]
HOSTILE_SCHEMA = HOSTILE["nested-maxItems-anyOf"]
DEEP = HOSTILE["maxItems-30-deep"]
STRINGS = REALISTIC["strings-1000x1000"][0]


def _random_pattern(rng: random.Random, depth: int) -> str:
    roll = rng.random()
    if depth == 0 or roll < 0.3:
        return rng.choice(["a", "b", "[ab]", "."])
    if roll < 0.5:
        return "".join(_random_pattern(rng, depth - 1) for _ in range(rng.randint(1, 3)))
    if roll < 0.65:
        return "(" + "|".join(_random_pattern(rng, depth - 1)
                              for _ in range(rng.randint(2, 3))) + ")"
    low = rng.randint(0, 3)
    high = low + rng.randint(0, 3)
    quantifier = rng.choice(["*", "+", "?", f"{{{low}}}", f"{{{low},}}", f"{{{low},{high}}}"])
    return "(" + _random_pattern(rng, depth - 1) + ")" + quantifier


def _tree_matches(tree, text: str) -> bool:
    """Whether the tree matches all of text, read from the tree's meaning: the set of
    positions each node can end at, from each position it can start at."""
    memo: dict[tuple[int, int], frozenset[int]] = {}

    def ends(node, i: int) -> frozenset[int]:
        key = (id(node), i)
        if key not in memo:
            memo[key] = frozenset(_ends(node, i))
        return memo[key]

    def _ends(node, i: int) -> set[int]:
        kind = node[0]
        if kind == "set":
            cs = node[1]
            ok = i < len(text) and (text[i] not in cs.chars if cs.negated
                                    else text[i] in cs.chars)
            return {i + 1} if ok else set()
        if kind == "cat":
            at = {i}
            for item in node[1]:
                at = {e for p in at for e in ends(item, p)}
            return at
        if kind == "alt":
            return {e for branch in node[1] for e in ends(branch, i)}
        _, inner, low, high = node
        out = {i} if low == 0 else set()
        at, done = {i}, 0
        reached: set[int] = set()
        while at and (high is None or done < high):
            at = {e for p in at for e in ends(inner, p)}
            done += 1
            if done >= low:
                if high is None:
                    at -= reached
                    reached |= at
                out |= at
        return out

    return len(text) in ends(tree, 0)


def test_counted_repeats_agree_with_the_tree():
    """Random patterns of nested, overlapping, empty-matching counted repeats: the counter
    automaton (with its dropped, covered configurations) matches what the tree does."""
    rng = random.Random(0)
    for _ in range(150):
        pattern = _random_pattern(rng, 4)
        automaton, tree = RegexAutomaton(pattern), parse(pattern)
        for _ in range(60):
            text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 14)))
            assert automaton.matches(text.encode()) == _tree_matches(tree, text), \
                (pattern, text)


@pytest.mark.parametrize("pattern", [
    r"a", r"(ab|c)*d", r"[^x]{0,50}", r"\d{0,3}-(x|yz)?", r"é.+", r'"([^"]{0,100})"',
    r"((ab){0,5}c){0,7}"])
def test_size_is_the_nfa_built(pattern):
    """measure() counts the states the NFA builds (each once: no repeat here has a
    minimum, and the nested one's body is read one repeat at a time)."""
    assert measure(parse(pattern))[1] == len(RegexAutomaton(pattern).nfa.edges)


@pytest.mark.parametrize("constraint, limit", [
    (HOSTILE_REGEX, f"automaton states (limit {MAX_NFA_STATES})"),
    (HOSTILE_SCHEMA, f"automaton states (limit {MAX_NFA_STATES})"),
    ("((a{1,1000}){1,1000}b?){2,1000}", f"automaton states (limit {MAX_NFA_STATES})"),
    (DEEP, f"characters long (limit {MAX_PATTERN_CHARS})")])
def test_hostile_constraints_are_refused_fast_naming_the_limit(constraint, limit):
    kind = "regex" if isinstance(constraint, str) else "json"
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(ValueError, match=r"too large: .*" + re.escape(limit)):
            SamplingParams(structured_outputs={kind: constraint})
        seconds = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert seconds < 0.5 and peak < 5 * 2**20, (seconds, peak)
    if constraint is not DEEP:  # (its regex is refused before it is written out)
        pattern = constraint if kind == "regex" else json_schema_regex(constraint)
        with pytest.raises(RegexTooLarge, match=f"limit {MAX_NFA_STATES}"):
            RegexAutomaton(pattern)  # the engine's own check, before it builds anything


def test_bounded_strings_and_items_cost_one_counter_each():
    """An array of up to 1000 strings of up to 1000 characters, and arrays nested three
    deep of up to 1000 items each: a few hundred NFA states, bounds enforced exactly."""
    strings = json_schema_regex(STRINGS)
    nested = json_schema_regex({"type": "array", "maxItems": 1000, "items": {
        "type": "array", "maxItems": 1000, "items": {
            "type": "array", "maxItems": 1000, "items": {"type": "integer"}}}})
    assert measure(parse(strings))[1] < 1000 and measure(parse(nested))[1] < 1000
    automaton = RegexAutomaton(strings)
    for value, ok in ((["x" * 1000, "é" * 1000], True), (["x" * 1001], False),
                      ([""] * 1000, True), ([""] * 1001, False)):
        assert automaton.matches(json.dumps(value, ensure_ascii=False).encode()) == ok
    automaton = RegexAutomaton(nested)
    for value, ok in (([[[1, 2]], [[3] * 1000]], True), ([[[3] * 1001]], False),
                      ([[[]] * 1000], True), ([[[]] * 1001], False)):
        assert automaton.matches(json.dumps(value).encode()) == ok
    # a body whose counts are ambiguous as read is counted once per count
    assert measure(parse("(a{0,5}){0,10}"))[1] > 10 * measure(parse("a{0,5}"))[1]


def test_nesting_length_and_classes_are_bounded_before_parsing_goes_far():
    assert RegexAutomaton("(" * 100 + "a" + ")" * 100).matches(b"a")
    with pytest.raises(ValueError, match="nested more than 100 deep"):
        check_pattern("(" * 101 + "a" + ")" * 101)
    with pytest.raises(RegexTooLarge, match=f"characters long \\(limit {MAX_PATTERN_CHARS}\\)"):
        check_pattern("a" * (MAX_PATTERN_CHARS + 1))
    # overlapping ranges: refused by what they list, before the set of them is made
    start = time.perf_counter()
    with pytest.raises(RegexTooLarge, match=f"a class lists more than {MAX_NFA_STATES} "
                                            f"characters \\(limit {MAX_NFA_STATES}\\)"):
        check_pattern("[" + "\\u0100-\\u1100" * 7000 + "]")
    assert time.perf_counter() - start < 0.5


def test_a_dfa_state_over_the_limit_is_refused(monkeypatch):
    monkeypatch.setattr(regex_automaton, "MAX_DFA_STATE_SIZE", 50)
    with pytest.raises(RegexTooLarge, match=r"holds more than 50 NFA states \(limit 50\)"):
        RegexAutomaton("|".join(f"x{i}" for i in range(40)))


def test_building_stops_at_the_time_limit_and_can_go_on_after():
    automaton = RegexAutomaton(r"[a-z]{0,300}")
    with pytest.raises(RegexTooLarge, match=r"regex too slow: .* \(limit 0 s\)"):
        with automaton.time_limit(0.0):
            automaton.matches(b"abc")
    assert automaton.deadline is None
    assert automaton.matches(b"abc" * 100) and not automaton.matches(b"abc" * 101)


CPU = torch.device("cpu")
EOS = 4
VOCAB = [b"a", b"b", b"ab", b"ba", None]  # id 4: the end of sequence


def test_a_guide_forgets_its_states_past_the_limit_and_matchers_go_on(monkeypatch):
    """Every count of [ab]{0,40} is a state: past MAX_DFA_STATES the guide forgets them
    all, and a matcher finds its state again; its allowed tokens stay those of a guide
    that keeps everything."""
    monkeypatch.setattr(regex_guide, "MAX_DFA_STATES", 8)
    pattern = "[ab]{0,40}c?"
    guide, reference = RegexGuide(pattern, VocabBytes(VOCAB)), RegexGuide(pattern,
                                                                         VocabBytes(VOCAB))
    matcher = RegexMatcher(guide)
    rng = random.Random(0)
    generated, state = [], 0
    for _ in range(25):
        allowed = matcher.next_tokens(generated, frozenset({EOS}), CPU).tolist()
        assert allowed == reference.next_tokens(state, frozenset({EOS}), CPU).tolist()
        assert len(guide.automaton.sets) <= 8 + 16  # at most one call's states past it
        token = rng.choice([t for t in allowed if t != EOS] or [EOS])
        if token == EOS:
            break
        generated.append(token)
        state = reference.advance(state, token)
    assert guide.automaton.epoch > 1 and matcher.error is None


def test_a_completion_whose_automaton_passes_a_limit_can_only_end(monkeypatch):
    guide = RegexGuide("[ab]{0,40}", VocabBytes(VOCAB))
    matcher, other = RegexMatcher(guide), RegexMatcher(guide)
    assert other.next_tokens([], frozenset({EOS}), CPU).tolist() == [0, 1, 2, 3, EOS]
    monkeypatch.setattr(regex_guide, "BUILD_SECONDS", 0.0)
    assert matcher.next_tokens([0], frozenset({EOS}), CPU).tolist() == [EOS]
    assert "regex too slow" in matcher.error and "(limit 0 s)" in matcher.error
    assert guide.error == matcher.error
    # the guide's other completion ends at its next token, without building again
    assert other.next_tokens([1], frozenset({EOS}), CPU).tolist() == [EOS]
    assert other.error == matcher.error


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(model=str(llama_dir), dtype="float32", seed=0)


def test_the_engine_fails_that_completion_alone_and_the_pattern_after(llm, monkeypatch):
    regex = SamplingParams(max_tokens=8, structured_outputs={"regex": "[a-z]{1,20}"})
    plain = SamplingParams(max_tokens=8, temperature=0)
    prompts = ["The river runs", "Once upon a time"]
    expected = llm.generate(prompts[1:], plain)[0].outputs[0].text
    monkeypatch.setattr(regex_guide, "BUILD_SECONDS", 0.0)
    failed, other = llm.generate(prompts, [regex, plain])
    assert failed.outputs[0].finish_reason == "error" and "regex too slow" in failed.error
    assert other.error is None and other.outputs[0].text == expected
    monkeypatch.undo()  # the pattern stays refused, at once
    again = llm.generate(prompts[:1], regex)[0]
    assert again.error == failed.error and again.outputs[0].token_ids == []
    # a pattern made without the size check (params changed after they were made) is
    # refused by the engine's own before it builds anything
    bypass = SamplingParams(max_tokens=8, structured_outputs={"regex": "a"})
    bypass.structured_outputs.regex = HOSTILE_REGEX
    out = llm.generate(prompts[:1], bypass)[0]
    assert out.outputs[0].finish_reason == "error" and "limit 100000" in out.error
