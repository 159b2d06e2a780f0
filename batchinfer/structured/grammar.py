"""Regexes, JSON schemas and grammars as llguidance grammars: checked without a tokenizer
when the params are made (grammar_text), compiled once per engine and grammar
(GrammarCompiler), and matched per completion (GrammarMatcher), which writes the tokens
that may come next into a row of a packed bitmask (one bit a token, 32 tokens an int32)."""
from __future__ import annotations

import json
from collections import OrderedDict
from functools import lru_cache

import numpy as np

# JSON is written as Python's json.dumps writes it: {"a": 1, "b": [true, null]}
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# llguidance's bounds on one grammar (llguidance.LLParserLimits): its size, the work to
# build its lexer, and per token the lexer's and the parser's work (about 14 and 20 units
# a microsecond: a mask costs at most a few tens of milliseconds) and the lexer states kept
# (1-2 kB each: at most about 40 MB a grammar)
LIMITS = dict(max_grammar_size=500_000, initial_lexer_fuel=1_000_000,
              step_lexer_fuel=200_000, step_max_items=50_000, max_lexer_states=20_000)
MAX_SPEC_CHARS = 1_000_000  # a regex, schema (as JSON text) or grammar
MAX_JSON_DEPTH = 64  # a schema's JSON nesting
MAX_COMPILED = 16  # distinct grammars an engine keeps compiled (with their lexers)
# a grammar probed before a job's model loads: random completions of up to PROBE_STEPS
# tokens, PROBE_WALKS of them or PROBE_SECONDS of masks, whichever ends first
PROBE_WALKS, PROBE_STEPS, PROBE_SECONDS = 4, 64, 10.0


def _limits():
    import llguidance
    return llguidance.LLParserLimits(**LIMITS)


def _one_line(message: str) -> str:
    """llguidance's message on one line: its first, and the regex parser's `error:` line
    where it has one."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return "refused"
    detail = next((line for line in lines[1:] if line.startswith("error:")), None)
    return lines[0] + (" " + detail if detail else "")


def check_json_depth(value, limit: int = MAX_JSON_DEPTH) -> None:
    """ValueError when value nests deeper than limit (walked without recursion, so a
    value too deep for Python's own recursion is refused like any other)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                raise ValueError(f"json schema: nesting deeper than {limit}")
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)


def schema_value(schema):
    """A JSON schema given as a dict or a bool, or as its JSON text, as a value; ValueError
    naming what is wrong."""
    if isinstance(schema, (str, bytes)):
        if len(schema) > MAX_SPEC_CHARS:
            raise ValueError(f"json schema too large: {len(schema)} characters "
                             f"(limit {MAX_SPEC_CHARS})")
        depth = open_depth = 0
        for ch in schema if isinstance(schema, str) else schema.decode("utf-8", "replace"):
            if ch in "[{":
                open_depth += 1
                depth = max(depth, open_depth)
                if depth > MAX_JSON_DEPTH:
                    raise ValueError(f"json schema: nesting deeper than {MAX_JSON_DEPTH}")
            elif ch in "]}":
                open_depth -= 1
        try:
            schema = json.loads(schema)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"json schema: not valid JSON ({e})") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"json schema: must be an object or a boolean, got "
                         f"{type(schema).__name__}")
    check_json_depth(schema)
    return schema


# keywords whose values are data, not schemas, and those whose values map names to schemas
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples", "example", "required"})
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                          "dependentSchemas"})


def listed_properties_only(schema):
    """A copy of schema in which an object schema that lists `properties` and says nothing
    of `additionalProperties` takes no others (as OpenAI's strict mode does): a model
    otherwise may add keys of its own until max_tokens. Data (const, enum, default, ...)
    is left as it is."""
    if isinstance(schema, list):
        return [listed_properties_only(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: listed_properties_only(v) for name, v in value.items()}
        else:
            out[key] = value if key in _DATA_KEYWORDS else listed_properties_only(value)
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema \
            and "patternProperties" not in schema and "unevaluatedProperties" not in schema:
        out["additionalProperties"] = False
    return out


def grammar_text(kind: str, spec) -> str:
    """The llguidance grammar of a regex, a JSON schema (a dict, a bool or its JSON text)
    or a grammar (Lark, or GBNF/EBNF with `::=`), checked by llguidance within LIMITS;
    ValueError with llguidance's reason otherwise."""
    if kind == "json":
        value = schema_value(spec)
        if value is False:
            raise ValueError("json schema false: no value is an instance of it")
        value = listed_properties_only({} if value is True else value)
        return _checked("json", json.dumps(value))
    if not isinstance(spec, str):
        raise ValueError(f"{kind} must be a string, got {type(spec).__name__}")
    if len(spec) > MAX_SPEC_CHARS:
        raise ValueError(f"{kind} too large: {len(spec)} characters (limit {MAX_SPEC_CHARS})")
    if not spec:
        raise ValueError(f"{kind} must be non-empty")
    return _checked(kind, spec)


@lru_cache(maxsize=16)
def _checked(kind: str, text: str) -> str:
    """(A job's rows share their constraint: each is checked once; at most 16 kept, 1 MB
    of text or so each.)"""
    from llguidance import LLMatcher
    if kind == "regex":
        grammar = LLMatcher.grammar_from_regex(text)
    elif kind == "json":
        try:
            grammar = LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
        except ValueError as e:
            raise ValueError(f"json schema: {_one_line(str(e))}") from None
    else:
        from llguidance.gbnf_to_lark import any_to_lark
        try:
            grammar = LLMatcher.grammar_from_lark(any_to_lark(text))
        except Exception as e:  # the GBNF converter's own errors  # noqa: BLE001
            raise ValueError(f"grammar: {_one_line(str(e))}") from None
    error = LLMatcher.validate_grammar(grammar, None, limits=_limits())
    if error:
        what = "json schema" if kind == "json" else kind
        raise ValueError(f"{what} refused: {_one_line(error)}")
    return grammar


class GrammarCompiler:
    """An engine's grammars compiled for its tokenizer: a matcher at the start of each
    grammar, kept for the next requests with it (the most recent MAX_COMPILED), which
    each completion copies. The llguidance tokenizer is made on first use (about a
    second for a 150k vocabulary)."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids):
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer = None
        self._compiled: OrderedDict[str, object] = OrderedDict()

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            import llguidance.hf
            try:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
            except Exception as e:  # noqa: BLE001 - a tokenizer llguidance cannot read
                raise ValueError(f"structured outputs need a tokenizer llguidance reads: "
                                 f"{_one_line(str(e))}") from None
        return self._tokenizer

    def compile(self, grammar: str):
        """The grammar's matcher at its start (ValueError with llguidance's reason)."""
        matcher = self._compiled.pop(grammar, None)
        if matcher is None:
            from llguidance import LLMatcher
            matcher = LLMatcher(self.tokenizer, grammar, log_level=0, limits=_limits())
            if len(self._compiled) >= MAX_COMPILED:
                self._compiled.popitem(last=False)
        self._compiled[grammar] = matcher
        if matcher.is_error():
            raise ValueError(f"structured output refused: {_one_line(matcher.get_error())}")
        return matcher


class GrammarMatcher:
    """One completion's place in its grammar: takes the tokens generated since it last
    looked and writes the tokens that may come next into a bitmask row. Past one of the
    grammar's bounds (or off it) only the end-of-sequence tokens may follow, and `error`
    says why."""

    def __init__(self, start):
        self.matcher = start.deep_copy()
        self.consumed = 0
        self.error: str | None = None

    def fill(self, generated: list[int], eos_token_ids: frozenset[int],
             row: np.ndarray) -> bool:
        if self.deferred(generated, eos_token_ids, row) is self:
            self.compute(eos_token_ids, row)
        return True

    def deferred(self, generated: list[int], eos_token_ids: frozenset[int], row: np.ndarray):
        """fill in two parts, so that a batch's masks are computed together (fill_masks):
        the new tokens taken, then self where its mask is still to be computed into row,
        or True where row is filled (the end-of-sequence tokens, past a bound)."""
        if self.error is None:
            new = generated[self.consumed:]
            self.consumed = len(generated)
            if not new or self.matcher.consume_tokens(new):
                return self
            self.error = _one_line(self.matcher.get_error())
        set_tokens(row, sorted(eos_token_ids))
        return True

    def compute(self, eos_token_ids: frozenset[int], row: np.ndarray) -> None:
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        self.masked(eos_token_ids, row)

    def masked(self, eos_token_ids: frozenset[int], row: np.ndarray) -> None:
        """After the mask is computed into row: past a bound, the end-of-sequence tokens."""
        if self.matcher.is_error():
            self.error = _one_line(self.matcher.get_error())
            set_tokens(row, sorted(eos_token_ids))


class MaskExecutor:
    """Computes the masks of a batch's grammar matchers together, on llguidance's threads
    (LLExecutor: by default 80% of the CPUs, at most 32)."""

    def __init__(self):
        self._executor = None

    def fill_masks(self, matchers: list[tuple[GrammarMatcher, int]], mask: np.ndarray,
                   eos_token_ids: frozenset[int]) -> None:
        """Each (matcher, row): its mask into that row of mask ([N, words] int32, C order)."""
        if len(matchers) == 1:  # (no threads to hand it to)
            matcher, i = matchers[0]
            matcher.compute(eos_token_ids, mask[i])
            return
        if self._executor is None:
            import llguidance
            self._executor = llguidance.LLExecutor()
        self._executor.unsafe_compute_mask_ptr([(m.matcher, i) for m, i in matchers],
                                               mask.ctypes.data, mask.shape[1] * 4,
                                               mask.shape[0])
        for matcher, i in matchers:
            matcher.masked(eos_token_ids, mask[i])


def random_walk(compiler: GrammarCompiler, grammar: str, steps: int,
                seed: int = 0) -> tuple[float, int, str | None]:
    """(mask seconds in all, masks computed, the matcher's error) of generating up to
    `steps` tokens under a grammar (a grammar_text), each drawn uniformly from the tokens
    its mask allows (the end-of-sequence tokens only where nothing else is)."""
    import random
    import time
    rng = random.Random(seed)
    row = np.empty(-(-compiler.vocab_size // 32), dtype=np.int32)
    matcher = GrammarMatcher(compiler.compile(grammar))
    eos = frozenset(compiler.eos_token_ids)
    generated: list[int] = []
    spent = 0.0
    for step in range(steps):
        start = time.perf_counter()
        matcher.fill(generated, eos, row)
        spent += time.perf_counter() - start
        allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
        allowed = [t for t in allowed.tolist() if t not in eos]
        if matcher.error is not None or not allowed:
            return spent, step + 1, matcher.error
        generated.append(rng.choice(allowed))
    return spent, steps, None


def probe(compiler: GrammarCompiler, grammar: str) -> str | None:
    """The bound a few random completions under a grammar reach (llguidance's reason), or
    None. A grammar's lexer is shared by all its completions, so a bound one reaches is
    soon the bound of every one: a job with such a constraint for all its rows would fail
    each of them (a nested counted repeat such as ((a{0,1000}){0,1000}){0,1000} does)."""
    spent = 0.0
    for seed in range(PROBE_WALKS):
        seconds, _, error = random_walk(compiler, grammar, PROBE_STEPS, seed)
        if error is not None:
            return error
        spent += seconds
        if spent > PROBE_SECONDS:
            break
    return None


def set_tokens(row: np.ndarray, token_ids) -> None:
    """A bitmask row allowing exactly token_ids."""
    row[:] = 0
    ids = np.asarray(token_ids, dtype=np.int64)
    np.bitwise_or.at(row.view(np.uint32), ids >> 5, (np.uint32(1) << (ids & 31).astype(np.uint32)))
