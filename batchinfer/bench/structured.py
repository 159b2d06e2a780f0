"""`batchinfer bench structured`: what structured-output constraints cost before and while
they generate. For each schema of a realistic set: the time to check it (what a job does
for every row, with no tokenizer) and the peak Python memory of the check; with
--tokenizer, also the time to compile it for that vocabulary and the mask time per token
while an instance's tokens are generated (llguidance fills a packed bitmask per token).
The hostile set must compile or be refused fast, and generating under it stay bounded:
how fast, and how it ends, is reported.
"""
from __future__ import annotations

import json
import time
import tracemalloc
from dataclasses import dataclass
from typing import Any

import click

from batchinfer.sampling_params import StructuredOutputsParams


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

# name -> (JSON schema, an instance of it written as completions are)
REALISTIC: dict[str, tuple[dict, Any]] = {
    "label": ({"type": "object", "properties": {
        "label": {"enum": ["positive", "negative", "neutral"]},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
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


# name -> a regex or a JSON schema that blows up a compiler building automata eagerly:
# each compiles (or is refused) at once, and generating under it is bounded per token
HOSTILE: dict[str, str | dict] = {
    "maxItems-30-deep": _nested_arrays(30),
    "nested-counted-regex": "((a{0,1000}){0,1000}){0,1000}",
    "nested-maxItems-anyOf": {"type": "array", "maxItems": 1000, "items": {"anyOf": [
        {"type": "array", "items": _string(1000), "maxItems": 1000},
        {"type": "array", "items": {"type": "integer"}, "maxItems": 1000}]}},
    "enum-2000x45": {"enum": [f"value {i:04d} " + "x" * 34 for i in range(2000)]},
}


def constraint_params(constraint: str | dict) -> StructuredOutputsParams:
    kind = "regex" if isinstance(constraint, str) else "json"
    return StructuredOutputsParams(**{kind: constraint})


@dataclass
class Cost:
    check_s: float            # the constraint checked by llguidance, with no tokenizer
    peak_bytes: int           # Python's peak memory of the check (traced)
    compile_s: float | None   # compiled for the tokenizer's vocabulary
    mask_s: float | None      # the masks at each of the instance's tokens, all together
    num_tokens: int | None    # the instance's, with the tokenizer

    @property
    def mask_per_token_s(self) -> float | None:
        return None if self.mask_s is None else self.mask_s / (self.num_tokens + 1)


def check_cost(constraint: str | dict) -> tuple[float, int]:
    """(seconds, peak traced bytes) of checking a constraint as a job checks each row's
    (not the cache: every call does the work)."""
    from batchinfer.structured import grammar
    kind = "regex" if isinstance(constraint, str) else "json"
    text = constraint if kind == "regex" else json.dumps(constraint)
    start = time.perf_counter()
    grammar._checked.__wrapped__(kind, text)
    seconds = time.perf_counter() - start
    tracemalloc.start()
    try:
        grammar._checked.__wrapped__(kind, text)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return seconds, peak


def mask_walk(compiler, constraint: str | dict, text: str,
              max_tokens: int | None = None) -> tuple[float, float, int, str | None]:
    """(compile seconds, mask seconds in all, masks computed, the matcher's error) of
    generating text's tokens under the constraint, a mask before each token and after
    the last: what the engine does per token."""
    import numpy as np

    from batchinfer.structured.grammar import GrammarMatcher
    grammar_text = constraint_params(constraint).grammar_text()
    start = time.perf_counter()
    compiled = compiler.compile(grammar_text)
    compile_s = time.perf_counter() - start
    ids = compiler.hf_tokenizer.encode(text, add_special_tokens=False)[:max_tokens]
    row = np.empty(-(-compiler.vocab_size // 32), dtype=np.int32)
    matcher = GrammarMatcher(compiled)
    eos = frozenset(compiler.eos_token_ids)
    spent = 0.0
    steps = 0
    for i in range(len(ids) + 1):
        start = time.perf_counter()
        matcher.fill(ids[:i], eos, row)
        spent += time.perf_counter() - start
        steps += 1
        if matcher.error is not None:
            break
    return compile_s, spent, steps, matcher.error


def random_walk(compiler, constraint: str | dict, steps: int,
                seed: int = 0) -> tuple[float, int, str | None]:
    """grammar.random_walk under a regex (a str) or a JSON schema."""
    from batchinfer.structured import grammar
    return grammar.random_walk(compiler, constraint_params(constraint).grammar_text(), steps,
                               seed)


CHOICES = {"choice-3": ["positive", "negative", "neutral"],
           "choice-200": [f"category {i}: {'abcdefghij'[i % 10]}" for i in range(200)]}


def choice_costs(compiler, labels: list[str], repeat: int = 20) -> tuple[float, float]:
    """(trie, llguidance) seconds a mask of generating the last label, as the engine does
    each: the trie over the labels' token ids, and llguidance over the labels as a Lark
    alternation."""
    import numpy as np

    from batchinfer.structured.choice import ChoiceTrie
    from batchinfer.structured.grammar import GrammarMatcher
    encode = compiler.hf_tokenizer.encode
    ids = [encode(label, add_special_tokens=False) for label in labels]
    lark = "start: " + " | ".join(json.dumps(label) for label in labels)
    start = compiler.compile(StructuredOutputsParams(grammar=lark).grammar_text())
    row = np.empty(-(-compiler.vocab_size // 32), dtype=np.int32)
    eos = frozenset(compiler.eos_token_ids)
    times = []
    for make in (lambda: ChoiceTrie(ids), lambda: GrammarMatcher(start)):
        spent = 0.0
        for i in range(len(ids[-1]) + 1):  # once untimed: llguidance's lexer states made
            make().fill(ids[-1][:i], eos, row)
        for _ in range(repeat):
            structure = make()
            for i in range(len(ids[-1]) + 1):
                begin = time.perf_counter()
                structure.fill(ids[-1][:i], eos, row)
                spent += time.perf_counter() - begin
        times.append(spent / (repeat * (len(ids[-1]) + 1)))
    return times[0], times[1]


def measure(schema: Any, instance: Any, compiler=None) -> Cost:
    check_s, peak = check_cost(schema)
    if compiler is None:
        return Cost(check_s, peak, None, None, None)
    text = json.dumps(instance, ensure_ascii=False)
    compile_s, mask_s, steps, error = mask_walk(compiler, schema, text)
    if error is not None:
        raise RuntimeError(f"the instance does not match its schema: {error}")
    return Cost(check_s, peak, compile_s, mask_s, steps - 1)


def refusal(constraint: str | dict) -> tuple[float, str | None]:
    """(seconds, llguidance's reason or None where it compiles) of checking a hostile
    constraint, as a job checks a row's."""
    start = time.perf_counter()
    try:
        constraint_params(constraint)
    except ValueError as e:
        return time.perf_counter() - start, str(e)
    return time.perf_counter() - start, None


def compiler_for(tokenizer: str):
    """A GrammarCompiler over a tokenizer directory or a named shape's tokenizer."""
    from transformers import AutoTokenizer

    from batchinfer.bench.models import resolve_model
    from batchinfer.structured.grammar import GrammarCompiler
    path = resolve_model(tokenizer, load_format="dummy").path
    tok = AutoTokenizer.from_pretrained(path)
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    return GrammarCompiler(tok, len(tok), eos)


@click.command("structured")
@click.option("--tokenizer", default=None,
              help="A tokenizer directory, or a named shape's (smollm2-135m: 49k tokens, "
                   "qwen3-30b-a3b: 152k, ...): also compile each schema for it and time "
                   "the masks at each of the instance's tokens.")
def main(tokenizer: str | None) -> None:
    """Time of checking, compiling and masking realistic JSON schemas, and what hostile
    constraints cost."""
    compiler = None
    if tokenizer is not None:
        try:
            compiler = compiler_for(tokenizer)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--tokenizer") from None
        start = time.perf_counter()
        compiler.tokenizer  # noqa: B018 - made once per engine: timed apart
        click.echo(f"{tokenizer}: {compiler.vocab_size} tokens; llguidance's tokenizer made "
                   f"in {(time.perf_counter() - start) * 1e3:.0f} ms")
    click.echo(f"{'schema':<20} {'check':>7} {'peak MB':>8} {'compile':>8} {'tokens':>7} "
               f"{'mask us/token':>14}")
    for name, (schema, instance) in REALISTIC.items():
        cost = measure(schema, instance, compiler)
        compiled = "-" if cost.compile_s is None else f"{cost.compile_s * 1e3:.1f}"
        tokens = "-" if cost.num_tokens is None else str(cost.num_tokens)
        per_token = "-" if cost.mask_s is None else f"{cost.mask_per_token_s * 1e6:.1f}"
        click.echo(f"{name:<20} {cost.check_s * 1e3:>7.1f} {cost.peak_bytes / 2**20:>8.1f} "
                   f"{compiled:>8} {tokens:>7} {per_token:>14}")
    click.echo("(check and compile in ms; with --tokenizer, the mask before each of the "
               "instance's tokens)")
    if compiler is not None:
        for name, labels in CHOICES.items():
            trie, guidance = choice_costs(compiler, labels)
            click.echo(f"{name}: a mask {trie * 1e6:.1f} us with the trie, "
                       f"{guidance * 1e6:.1f} us with llguidance")
    for name, constraint in HOSTILE.items():
        seconds, reason = refusal(constraint)
        line = f"{name}: {'refused' if reason else 'checked'} in {seconds * 1e3:.1f} ms"
        if reason:
            line += f": {reason}"
        elif compiler is not None:
            mask_s, steps, error = random_walk(compiler, constraint, 200)
            line += (f"; {steps} tokens drawn at random from its masks, "
                     f"{mask_s / steps * 1e6:.0f} us a mask; "
                     f"{'ended by: ' + error if error else 'no bound reached'}")
        click.echo(line)
