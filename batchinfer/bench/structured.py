"""`batchinfer bench structured`: what structured-output constraints cost before and while
they generate. For each schema of a realistic set: the time to convert and size-check it
(what a job does for every row, with no tokenizer), to build its automaton, and to walk
an instance through it (which builds the DFA states generation reaches), and the peak
memory of all three (tracemalloc, in a second pass: tracing slows Python down). With
--tokenizer, also the allowed tokens of every state the instance's tokens pass through,
as generation asks for them. The hostile set must be refused, and how fast is reported.
"""
from __future__ import annotations

import json
import time
import tracemalloc
from dataclasses import dataclass
from typing import Any

import click

from batchinfer.sampling_params import StructuredOutputsParams
from batchinfer.structured.json_schema import json_schema_regex
from batchinfer.structured.regex_automaton import RegexAutomaton
from batchinfer.structured.regex_syntax import check_pattern


def _string(max_length: int) -> dict:
    return {"type": "string", "maxLength": max_length}


_PERSON = {"type": "object", "properties": {
    "name": _string(100), "email": _string(254), "age": {"type": "integer"},
    "role": {"enum": ["admin", "editor", "viewer", "guest"]},
    "address": {"type": "object", "properties": {
        "street": _string(200), "city": _string(100), "postcode": _string(12),
        "country": {"type": "string", "minLength": 2, "maxLength": 2}}},
    "tags": {"type": "array", "items": _string(32), "maxItems": 10}}}
_COUNTRIES = [f"Country {chr(65 + i // 26)}{chr(65 + i % 26)}" for i in range(500)]
_EVENT = {"anyOf": [
    {"type": "object", "properties": {"kind": {"const": "click"}, "x": {"type": "integer"},
                                      "y": {"type": "integer"}}},
    {"type": "object", "properties": {"kind": {"const": "key"}, "key": _string(16)}},
    {"type": "object", "properties": {"kind": {"const": "scroll"},
                                      "delta": {"type": "number"}}}]}

# name -> (JSON schema, an instance of it written compactly, as completions are)
REALISTIC: dict[str, tuple[dict, Any]] = {
    "label": ({"type": "object", "properties": {
        "label": {"enum": ["positive", "negative", "neutral"]},
        "confidence": {"type": "number"},
        "tags": {"type": "array", "items": _string(8), "maxItems": 3}}},
        {"label": "neutral", "confidence": 0.75, "tags": ["a", "bb"]}),
    "strings-1000x1000": ({"type": "array", "items": _string(1000), "maxItems": 1000},
                          ["x" * 1000, "é\"\\n" * 50, ""]),
    "enum-500": ({"enum": _COUNTRIES}, _COUNTRIES[-1]),
    "record-100": ({"type": "object", "properties": {
        f"field_{i}": [_string(50), {"type": "integer"}, {"type": "boolean"},
                       {"type": ["number", "null"]}][i % 4] for i in range(100)}},
        {f"field_{i}": ["text", 42, True, None][i % 4] for i in range(100)}),
    "people-100": ({"type": "array", "items": _PERSON, "maxItems": 100},
                   [{"name": "Ada", "email": "ada@example.com", "age": 36, "role": "admin",
                     "address": {"street": "1 Main St", "city": "London",
                                 "postcode": "N1 9GU", "country": "GB"},
                     "tags": ["math", "engines"]}] * 3),
    "events-1000": ({"type": "array", "items": _EVENT, "maxItems": 1000},
                    [{"kind": "click", "x": 3, "y": 4}, {"kind": "key", "key": "Enter"},
                     {"kind": "scroll", "delta": -2.5}] * 20),
    "matrix-1000x1000": ({"type": "array", "maxItems": 1000, "items": {
        "type": "array", "maxItems": 1000, "items": {"type": "integer"}}},
        [[i * j for j in range(100)] for i in range(5)]),
}

def _nested_arrays(depth: int) -> dict:
    schema = _string(5)
    for _ in range(depth):
        schema = {"type": "array", "items": schema, "maxItems": 3}
    return schema


# name -> a regex or a JSON schema whose automaton is over the limits
HOSTILE: dict[str, str | dict] = {
    "maxItems-30-deep": _nested_arrays(30),  # its regex doubles a level
    "nested-counted-regex": "((a{0,1000}){0,1000}){0,1000}",
    "nested-maxItems-anyOf": {"type": "array", "maxItems": 1000, "items": {"anyOf": [
        {"type": "array", "items": _string(1000), "maxItems": 1000},
        {"type": "array", "items": {"type": "integer"}, "maxItems": 1000}]}},
}


@dataclass
class Cost:
    check_s: float   # JSON schema to regex, parsed and size-checked
    build_s: float   # the automaton: its NFA and start state
    walk_s: float    # the instance's bytes through the DFA
    tokens_s: float | None  # the allowed tokens at each of the instance's tokens
    peak_bytes: int  # of all of the above, traced
    dfa_states: int  # built by the walk
    num_tokens: int | None  # the instance's, with the tokenizer

    @property
    def total_s(self) -> float:
        return self.check_s + self.build_s + self.walk_s + (self.tokens_s or 0.0)


def _run_once(schema: Any, instance: Any, tokenizer=None,
              vocab=None) -> tuple[list[float], int, int | None]:
    """The seconds of each stage of Cost, the DFA states the walk built, and the number of
    the instance's tokens."""
    ids = None
    times = [time.perf_counter()]
    pattern = json_schema_regex(schema)
    check_pattern.__wrapped__(pattern)  # not its cache: every run does the work
    times.append(time.perf_counter())
    automaton = RegexAutomaton(pattern)
    times.append(time.perf_counter())
    text = json.dumps(instance, ensure_ascii=False)
    if not automaton.matches(text.encode()):
        raise RuntimeError(f"the instance does not match its schema's regex: {text[:80]}")
    times.append(time.perf_counter())
    if tokenizer is not None:
        import torch

        from batchinfer.structured.regex_guide import RegexGuide, RegexMatcher
        guide = RegexGuide(pattern, vocab)
        matcher = RegexMatcher(guide)
        ids = tokenizer.encode(text, add_special_tokens=False)
        for i in range(len(ids) + 1):
            matcher.next_tokens(ids[:i], frozenset(), torch.device("cpu"))
        if matcher.error is not None:
            raise RuntimeError(matcher.error)
        times.append(time.perf_counter())
    return ([b - a for a, b in zip(times, times[1:])], len(automaton.sets),
            None if ids is None else len(ids))


def measure(schema: Any, instance: Any, tokenizer=None, vocab=None) -> Cost:
    """The cost of one schema: timed untraced, then traced for the peak memory."""
    times, states, num_tokens = _run_once(schema, instance, tokenizer, vocab)
    tracemalloc.start()
    try:
        _run_once(schema, instance, tokenizer, vocab)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return Cost(*times[:3], times[3] if len(times) > 3 else None, peak, states, num_tokens)


def refusal(constraint: str | dict) -> tuple[float, str]:
    """(seconds, message) of refusing a hostile regex or schema, as a job's row is."""
    kind = "regex" if isinstance(constraint, str) else "json"
    start = time.perf_counter()
    try:
        StructuredOutputsParams(**{kind: constraint})
    except ValueError as e:
        return time.perf_counter() - start, str(e)
    raise RuntimeError(f"not refused: {constraint!r}")


@click.command("structured")
@click.option("--tokenizer", default=None,
              help="A tokenizer directory, or a named shape's (smollm2-135m, llama3-8b, ...): "
                   "also time the allowed tokens at each of the instance's tokens.")
def main(tokenizer: str | None) -> None:
    """Time and peak memory of compiling realistic JSON schemas, and of refusing
    hostile ones."""
    tok = vocab = None
    if tokenizer is not None:
        from transformers import AutoTokenizer

        from batchinfer.bench.models import resolve_model
        from batchinfer.structured.regex_guide import VocabBytes, token_bytes
        try:
            path = resolve_model(tokenizer, load_format="dummy").path
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--tokenizer") from None
        tok = AutoTokenizer.from_pretrained(path)
        vocab = VocabBytes(token_bytes(tok))
    click.echo(f"{'schema':<20} {'check':>7} {'build':>7} {'walk':>7} {'peak MB':>8} "
               f"{'DFA states':>10} {'tokens':>7} {'per token':>9}")
    for name, (schema, instance) in REALISTIC.items():
        cost = measure(schema, instance, tok, vocab)
        tokens = "-" if cost.num_tokens is None else str(cost.num_tokens)
        per_token = "-" if cost.tokens_s is None else \
            f"{cost.tokens_s * 1e3 / (cost.num_tokens + 1):.2f}"
        click.echo(f"{name:<20} {cost.check_s * 1e3:>7.1f} {cost.build_s * 1e3:>7.1f} "
                   f"{cost.walk_s * 1e3:>7.1f} {cost.peak_bytes / 2**20:>8.1f} "
                   f"{cost.dfa_states:>10} {tokens:>7} {per_token:>9}")
    click.echo("(times in ms: the check and build of the constraint, the walk of an instance's "
               "bytes, and with --tokenizer the allowed tokens before each of its tokens)")
    for name, constraint in HOSTILE.items():
        seconds, message = refusal(constraint)
        click.echo(f"{name}: refused in {seconds * 1e3:.1f} ms: {message}")
