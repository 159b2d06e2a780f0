"""The bounds on a pattern's automaton: counted repeats built once with a counter (checked
against the parse tree's own meaning), the size refused from the tree before anything is
built, and the limits that hold while the DFA is built."""
from __future__ import annotations

import json
import random
import time
import tracemalloc

import pytest

from batchinfer import SamplingParams
from batchinfer.engine import regex_automaton
from batchinfer.engine.json_schema import json_schema_regex
from batchinfer.engine.regex_automaton import RegexAutomaton
from batchinfer.engine.regex_syntax import (MAX_NFA_STATES, MAX_PATTERN_CHARS, RegexTooLarge,
                                            check_pattern, measure, parse)

HOSTILE_REGEX = "((a{0,1000}){0,1000}){0,1000}"
# arrays of up to 1000 arrays, each of strings or of integers: which one is only known
# after its first item, so the outer count is not known as it is read
HOSTILE_SCHEMA = {"type": "array", "maxItems": 1000, "items": {"anyOf": [
    {"type": "array", "items": {"type": "string", "maxLength": 1000}, "maxItems": 1000},
    {"type": "array", "items": {"type": "integer"}, "maxItems": 1000}]}}
STRINGS = {"type": "array", "items": {"type": "string", "maxLength": 1000}, "maxItems": 1000}


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


@pytest.mark.parametrize("constraint", [HOSTILE_REGEX, HOSTILE_SCHEMA,
                                        "((a{1,1000}){1,1000}b?){2,1000}"])
def test_hostile_constraints_are_refused_fast_naming_the_limit(constraint):
    kind = "regex" if isinstance(constraint, str) else "json"
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(ValueError, match=rf"too large: .* automaton states \(limit "
                                             rf"{MAX_NFA_STATES}\)"):
            SamplingParams(structured_outputs={kind: constraint})
        seconds = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert seconds < 0.5 and peak < 5 * 2**20, (seconds, peak)
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


def test_nesting_and_length_are_bounded_before_parsing_goes_deep():
    assert RegexAutomaton("(" * 100 + "a" + ")" * 100).matches(b"a")
    with pytest.raises(ValueError, match="nested more than 100 deep"):
        check_pattern("(" * 101 + "a" + ")" * 101)
    with pytest.raises(RegexTooLarge, match=f"characters long \\(limit {MAX_PATTERN_CHARS}\\)"):
        check_pattern("a" * (MAX_PATTERN_CHARS + 1))


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
