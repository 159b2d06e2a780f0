"""Regexes and grammars through llguidance: a regex's matcher against Python's re over the
test tokenizer's tokens, the packed masks against what each token does to the matcher,
what llguidance refuses named, and the engine's completions matching their pattern or
grammar."""
from __future__ import annotations

import random
import re
from pathlib import Path

import numpy as np
import pytest

from batchinfer import LLM, SamplingParams, StructuredOutputsParams
from batchinfer.structured.grammar import (MAX_COMPILED, GrammarCompiler, GrammarMatcher,
                                           MaskExecutor, set_tokens)

PATTERNS = [r"\d+", r"(yes|no)", r"[A-Z][a-z]{2,4}", r"\d{3}-\d{4}", r"(ab|a)*c?", r"[^abc]+",
            r".{1,3}x", r"\w+@\w+\.com", r"(?:foo|bar)+\s?", r"[-+]?\d*\.?\d+", r"é[a-cà]*",
            r"[\d\s]+", r"a{2}b{0,2}", r"[.]\.", r"(a|b)*?c", r"\{x\}", r"[\]a]+",
            r"\u00e9|\x41", r"(?P<word>ab)+", r"a*a{2,4}", r"(a{0,3}){0,3}b",
            r"(x[0-9]{1,3}){2,4}", r"(ab|a){2,5}", r"(a?){3}b", r"[a-c]{2,}c", r"(.{1,2}b){1,3}"]


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(model=str(llama_dir), dtype="float32", seed=0)


@pytest.fixture(scope="module")
def compiler(llm) -> GrammarCompiler:
    return llm.llm_engine.grammars


def _matches(compiler: GrammarCompiler, pattern: str, ids: list[int]) -> bool:
    start = compiler.compile(StructuredOutputsParams(regex=pattern).grammar_text())
    matcher = start.deep_copy()
    return matcher.consume_tokens(ids) and matcher.is_accepting()


def test_regex_matcher_agrees_with_python_re(compiler):
    """Texts of the pattern's alphabet as the tokenizer encodes them: the matcher accepts
    exactly those Python's re matches whole (Unicode classes, as re's default)."""
    alphabet = list("abcxyzABC019 -+.@é\n]{}àÿ日") + ["foo", "bar", ".com", "ab", "{x}"]
    encode = compiler.hf_tokenizer.encode
    rng = random.Random(0)
    for pattern in PATTERNS:
        python = re.compile(pattern)
        texts = {"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 8)))
                 for _ in range(150)}
        texts |= {"123", "yes", "Abcd", "555-1234", "abaab", "xyé", "éàx", "a@b.com",
                  "foobar ", "-1.5", "éàa", "xz", "日本", "A", "abab"}
        for text in texts:
            expected = python.fullmatch(text) is not None
            assert _matches(compiler, pattern, encode(text, add_special_tokens=False)) \
                == expected, (pattern, text)


def test_masks_are_the_tokens_the_matcher_takes(compiler):
    """The packed bitmask row of each state a random walk reaches holds exactly the
    tokens that the matcher would take next (each tried on a copy)."""
    vocab = compiler.vocab_size
    eos = frozenset(compiler.eos_token_ids)
    rng = random.Random(1)
    row = np.empty(-(-vocab // 32), dtype=np.int32)
    for pattern in [r"(yes|no)", r"[A-Z][a-z]{2,4}", r'"([^"\\]|\\.){0,6}"', r"\d{1,3}-x"]:
        start = compiler.compile(StructuredOutputsParams(regex=pattern).grammar_text())
        matcher = GrammarMatcher(start)
        generated: list[int] = []
        for _ in range(6):
            matcher.fill(generated, eos, row)
            allowed = set(np.flatnonzero(np.unpackbits(row.view(np.uint8),
                                                       bitorder="little")).tolist())
            probe = matcher.matcher
            taken = {t for t in range(vocab)
                     if t not in eos and probe.validate_tokens([t]) == 1}
            assert allowed - eos == taken, pattern
            if not taken:
                break
            generated.append(rng.choice(sorted(taken)))


def test_a_batch_of_masks_computed_together_is_each_computed_alone(compiler):
    """MaskExecutor (llguidance's threads) writes each matcher's row as fill does, rows of
    matchers past a bound included."""
    vocab = compiler.vocab_size
    eos = frozenset(compiler.eos_token_ids)
    encode = compiler.hf_tokenizer.encode
    cases = [(r"[0-9]{1,4}-x", "12"), (r"(yes|no)", ""), (r'"[a-z ]{0,20}"', '"ab c'),
             (r"[A-Z][a-z]{2,4}", "Abc"), (r"(yes|no)", "yes")]
    together = np.empty((len(cases), -(-vocab // 32)), dtype=np.int32)
    alone = np.empty_like(together)
    pending = []
    for i, (pattern, text) in enumerate(cases):
        start = compiler.compile(StructuredOutputsParams(regex=pattern).grammar_text())
        ids = encode(text, add_special_tokens=False)
        GrammarMatcher(start).fill(ids, eos, alone[i])
        matcher = GrammarMatcher(start)
        assert matcher.deferred(ids, eos, together[i]) is matcher
        pending.append((matcher, i))
    MaskExecutor().fill_masks(pending, together, eos)
    assert (together == alone).all()
    off = GrammarMatcher(compiler.compile(StructuredOutputsParams(regex="ab").grammar_text()))
    assert off.deferred(encode("zz", add_special_tokens=False), eos, together[0]) is True
    assert off.error and np.flatnonzero(np.unpackbits(
        together[0].view(np.uint8), bitorder="little")).tolist() == sorted(eos)


def test_set_tokens_packs_bits_as_llguidance_does():
    row = np.full(3, -1, dtype=np.int32)
    set_tokens(row, [0, 31, 32, 95])
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    assert np.flatnonzero(bits).tolist() == [0, 31, 32, 95]


@pytest.mark.parametrize("pattern, what", [
    (r"(?=a)", "look-around"), (r"a\1", "backreferences"), (r"\bx", "lookarounds"),
    ("[", "unclosed character class"), ("a{2,1}", "invalid repetition"),
    ("*a", "repetition operator missing expression"), ("", "non-empty")])
def test_unsupported_patterns_are_refused_by_name(pattern, what):
    with pytest.raises(ValueError, match=re.escape(what)):
        SamplingParams(structured_outputs={"regex": pattern})


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


LARK = r'''
start: item ("," item){0,2}
item: "red" | "green" | NUMBER
NUMBER: /[1-9][0-9]?/
'''
GBNF = r'''
root ::= "(" digit ("+" digit)* ")"
digit ::= [0-9]
'''


@pytest.mark.parametrize("grammar, pattern", [
    (LARK, r"(red|green|[1-9][0-9]?)(,(red|green|[1-9][0-9]?)){0,2}"),
    (GBNF, r"\([0-9](\+[0-9])*\)")], ids=["lark", "gbnf"])
def test_completions_are_sentences_of_their_grammar(llm, grammar, pattern):
    outs = llm.generate(["The river runs", "Hello"], SamplingParams(
        max_tokens=24, temperature=1.0, seed=3, n=2, structured_outputs={"grammar": grammar}))
    for out in outs:
        for sample in out.outputs:
            if sample.finish_reason == "stop":
                assert re.fullmatch(pattern, sample.text), sample.text
            else:  # cut by max_tokens: a prefix of a sentence
                assert sample.finish_reason == "length" and sample.text[:1] in "(rg123456789"


def test_grammars_are_kept_per_text_and_refused_where_unsupported(llm):
    compiler = llm.llm_engine.grammars
    text = StructuredOutputsParams(regex=r"\d+").grammar_text()
    first = compiler.compile(text)
    assert compiler.compile(text) is first
    for i in range(MAX_COMPILED + 16):  # a bounded number of grammars is kept, the most recent
        compiler.compile(StructuredOutputsParams(regex=f"x{{{i}}}").grammar_text())
    assert len(compiler._compiled) <= MAX_COMPILED and text not in compiler._compiled
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs={"regex": r"\d+"})
    with pytest.raises(ValueError, match="one of choice, regex, json, grammar and json_object"):
        SamplingParams(structured_outputs={"regex": r"\d+", "choice": ["a"]})
    with pytest.raises(ValueError, match="unknown name"):
        SamplingParams(structured_outputs={"grammar": "start: nowhere"})
    with pytest.raises(ValueError, match="grammar"):
        SamplingParams(structured_outputs={"grammar": "root ::= (x"})
