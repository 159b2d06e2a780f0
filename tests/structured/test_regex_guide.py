"""Completions constrained by a regular expression: the byte automaton against Python's
re, the vocabulary's bytes, and the engine's outputs matching their pattern."""
from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from batchinfer import LLM, SamplingParams
from batchinfer.structured.regex_automaton import RegexAutomaton
from batchinfer.structured.regex_guide import RegexGuide, VocabBytes, token_bytes

PATTERNS = [r"\d+", r"(yes|no)", r"[A-Z][a-z]{2,4}", r"\d{3}-\d{4}", r"(ab|a)*c?", r"[^abc]+",
            r".{1,3}x", r"\w+@\w+\.com", r"(?:foo|bar)+\s?", r"[-+]?\d*\.?\d+", r"é[a-cà]*",
            r"[\d\s]+", r"a{2}b{0,2}", r"^x(y|z)$", r"\S+", r"[.]\.", r"(a|b)*?c", r"\{x\}",
            r"[\]a]+", r"\u00e9|\x41", r"(?P<word>ab)+", r"a{,2}b", r"\012x|\0", r"a{x}",
            # counted repeats entered at many places, nested, over bodies that overlap
            r"a*a{2,4}", r"(a{0,3}){0,3}b", r"(x[0-9]{1,3}){2,4}", r"(ab|a){2,5}", r"(a?){3}b",
            r"[a-c]{2,}c", r"(.{1,2}b){1,3}"]


def test_automaton_agrees_with_python_re():
    alphabet = list("abcxyzABC019 -+.@é\n]{}àÿ日\0") + ["foo", "bar", ".com", "ab", "{x}"]
    rng = random.Random(0)
    for pattern in PATTERNS:
        automaton, python = RegexAutomaton(pattern), re.compile(pattern, re.ASCII)
        matched = 0
        for _ in range(2000):
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8)))
            expected = python.fullmatch(text) is not None
            assert automaton.matches(text.encode()) == expected, (pattern, text)
            matched += expected
        for text in ("123", "yes", "Abcd", "555-1234", "abaab", "xyé", "éàx", "a@b.com",
                     "foobar ", "-1.5", "éàa", "xz", "日本", "A", "abab"):
            assert automaton.matches(text.encode()) == (python.fullmatch(text) is not None)


def test_any_character_is_well_formed_utf8():
    automaton = RegexAutomaton("x.y")
    for good in ("é", "日", "\U0001F600", "\u07ff", "\uffff"):
        assert automaton.matches(f"x{good}y".encode())
    # overlong, a surrogate, beyond U+10FFFF, a lone continuation byte
    for bad in (b"\xe0\x80\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf", b"\x80"):
        assert not automaton.matches(b"x" + bad + b"y"), bad


@pytest.mark.parametrize("pattern, what", [
    (r"(?=a)", "lookarounds"), (r"a\1", r"\1"), (r"\b", r"\b"), (r"a^b", "'^'"),
    (r"(?i)a", "flags"), ("[", "missing ]"), ("a{2,1}", "bad repeat"), ("*a", "nothing to repeat"),
    (r"[^é]", "non-ASCII"), ("a{2000}", "above"), ("", "non-empty"), ("a**", "multiple repeat"),
    ("a{2}{3}", "multiple repeat")])
def test_unsupported_patterns_are_refused_by_name(pattern, what):
    with pytest.raises(ValueError, match=re.escape(what)):
        RegexAutomaton(pattern)
    with pytest.raises(ValueError):
        SamplingParams(structured_outputs={"regex": pattern})


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(model=str(llama_dir), dtype="float32", seed=0)


def test_token_bytes_are_what_tokens_add_to_a_text(llm):
    tokenizer = llm.get_tokenizer()
    pieces = token_bytes(tokenizer)
    assert len(pieces) == len(tokenizer)
    for text in ("The river runs, 42 times.", "café — naïve 日本語", "  two  spaces\nline"):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert b"".join(pieces[t] for t in ids) == text.encode()
    assert all(pieces[t] is None for t in tokenizer.all_special_ids)
    # a token added as special but not among the named special tokens is never allowed
    from transformers import AutoTokenizer
    fresh = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    fresh.add_tokens(["<|reserved_0|>"], special_tokens=True)
    reserved = fresh.convert_tokens_to_ids("<|reserved_0|>")
    assert token_bytes(fresh)[reserved] is None


def test_allowed_tokens_are_those_whose_bytes_keep_a_match(llm):
    """The vectorised walk over the vocabulary gives exactly the tokens that stepping each
    one's bytes through the automaton keeps alive, in every state a random walk reaches
    (the walk's moves table grows as it finds states)."""
    pieces = token_bytes(llm.get_tokenizer())
    vocab = VocabBytes(pieces)
    rng = random.Random(1)
    for pattern in PATTERNS[:12] + [r'"([^"\\]|\\.){0,6}"', r"[^\n]*\n"]:
        guide = RegexGuide(pattern, vocab)
        state = 0
        for _ in range(8):
            expected = [t for t, data in enumerate(pieces)
                        if data and guide.advance(state, t) >= 0]
            allowed = guide.allowed(state)
            assert allowed.tolist() == expected, (pattern, state)
            if not expected:
                break
            state = guide.advance(state, rng.choice(expected))


def test_a_state_reached_only_by_advancing_can_be_listed():
    # advance() makes automaton states the vectorised walk has not seen yet
    guide = RegexGuide("a{40}", VocabBytes([b"a", b"b", b"aa", None]))
    state = 0
    for _ in range(16):
        state = guide.advance(state, 2)
    assert guide.allowed(state).tolist() == [0, 2]
    assert guide.allowed(guide.advance(state, 0)).tolist() == [0, 2]  # 33 of 40: both still fit


@pytest.mark.parametrize("pattern", [
    r"\d{3}-\d{4}", r"(yes|no|maybe)", r"[A-Z][a-z]{1,5} [0-9]{1,2}",
    r"\{\"label\": \"(pos|neg)\", \"score\": 0\.\d{2}\}", r"é+[a-c]{2}", r"(ha){1,4}!?"])
def test_completions_match_their_pattern(llm, pattern):
    prompts = ["The river runs", "Once upon a time", "A short note on", "Hello"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=48, temperature=1.0, seed=7, n=2,
                                                structured_outputs={"regex": pattern}))
    for out in outs:
        for sample in out.outputs:
            assert sample.finish_reason == "stop", (pattern, sample.text)
            assert re.fullmatch(pattern, sample.text), (pattern, sample.text)
    greedy = llm.generate(prompts[:1], SamplingParams(max_tokens=48, temperature=0.0,
                                                      structured_outputs={"regex": pattern}))
    assert re.fullmatch(pattern, greedy[0].outputs[0].text)


def test_regex_guides_are_kept_per_pattern_and_refused_where_unsupported(llm):
    engine = llm.llm_engine
    first = engine._regex_guide(r"\d+")
    assert engine._regex_guide(r"\d+") is first and engine._regex_guide(r"[ab]") is not first
    for i in range(80):  # a bounded number of patterns is kept, the most recent
        engine._regex_guide(f"x{{{i}}}")
    assert len(engine._regex_guides) <= 64 and r"\d+" not in engine._regex_guides
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs={"regex": r"\d+"})
    with pytest.raises(ValueError, match="one of choice, regex and json"):
        SamplingParams(structured_outputs={"regex": r"\d+", "choice": ["a"]})
    with pytest.raises(ValueError, match="grammar"):
        SamplingParams(structured_outputs={"grammar": "root ::= x"})
