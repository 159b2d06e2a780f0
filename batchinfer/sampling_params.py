"""Sampling parameters with vLLM's names and meanings."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace


@dataclass
class StructuredOutputsParams:
    """Constraints on what a completion may be, with vLLM's names; give one. `choice`: the
    completion is exactly one of these strings (each as the tokenizer encodes it), then
    the end-of-sequence token. `regex`: the whole completion matches this pattern
    (llguidance's syntax: Rust's regex crate, no lookarounds or backreferences). `json`: a
    JSON Schema (draft 2020-12, an object or its JSON text); the completion is an
    instance, written as json.dumps writes it. `json_object`: any JSON object. `grammar`:
    a Lark grammar (or GBNF/EBNF, with `::=`), as llguidance takes it. A constraint
    llguidance refuses, or one past its bounds (batchinfer/structured/grammar.py), is a
    ValueError giving the reason."""

    choice: list[str] | None = None
    json: object = None
    regex: str | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("choice", "regex", "json", "grammar")
                 if getattr(self, name) is not None] + (["json_object"] if self.json_object else [])
        if len(given) > 1:
            raise ValueError(f"StructuredOutputsParams: give one of choice, regex, json, "
                             f"grammar and json_object, not {' and '.join(given)}")
        if not given:
            raise ValueError("StructuredOutputsParams: give one of choice, regex, json, "
                             "grammar and json_object")
        if self.choice is None:
            self.grammar_text()  # refuses what llguidance does not take, saying why
            return
        choice = self.choice
        if isinstance(choice, (str, bytes, dict)) or not hasattr(choice, "__iter__"):
            raise ValueError(f"StructuredOutputsParams.choice must be a list of strings, "
                             f"got {choice!r}")
        self.choice = list(choice)
        if not self.choice or any(not isinstance(c, str) or not c for c in self.choice):
            raise ValueError(f"StructuredOutputsParams.choice must be non-empty strings, got "
                             f"{self.choice!r}")

    def grammar_text(self) -> str:
        """The llguidance grammar a regex, json, json_object or grammar constraint is
        (checked, and cached per constraint)."""
        from batchinfer.structured.grammar import grammar_text
        if self.json_object:
            return grammar_text("json", {"type": "object"})
        for kind in ("regex", "json", "grammar"):
            if getattr(self, kind) is not None:
                return grammar_text(kind, getattr(self, kind))
        raise ValueError("a choice constraint has no grammar")


@dataclass
class SamplingParams:
    """How to sample completions for one prompt.

    temperature 0 means greedy. top_k <= 0 (or -1) and top_p == 1 and min_p == 0
    disable those filters. Penalties follow vLLM: repetition_penalty divides positive
    (multiplies negative) logits of tokens seen in prompt or output; presence and
    frequency penalties subtract from logits of tokens seen in the output.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    # per prompt token: its logprob given the tokens before it, and the top k there
    prompt_logprobs: int | None = None
    # keep only the last k prompt tokens (left truncation); -1: as many as leave room for
    # max_tokens within max_model_len
    truncate_prompt_tokens: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # added to the logits of these token ids (OpenAI's logit_bias, in [-100, 100])
    logit_bias: dict[int, float] | None = None
    # only these token ids may be sampled
    allowed_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # the choices as token ids, or the grammar's matcher at its start (llguidance's), set
    # by the engine (the tokenizer lives there)
    choice_token_ids: list[list[int]] | None = field(default=None, repr=False)
    compiled_grammar: object = field(default=None, repr=False, compare=False)
    # set by the engine for structured outputs after reasoning: the token that ends the
    # reasoning, after which the structure starts (before it, sampling is unconstrained)
    reasoning_end_token_id: int | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name, what in (("stop", "a string or a list of strings"),
                           ("stop_token_ids", "a list of integers")):
            value = getattr(self, name)  # any collection: a list, tuple, set, range, array
            if value is not None and (isinstance(value, (str, bytes, dict))
                                      or not hasattr(value, "__iter__")):
                raise ValueError(f"SamplingParams.{name} must be {what}, got {value!r}")
        self.stop = list(self.stop) if self.stop is not None else []
        self.stop_token_ids = list(self.stop_token_ids) if self.stop_token_ids is not None else []
        self._validate()
        if self.top_k < 0:
            self.top_k = 0

    def _validate(self) -> None:
        """Every value checked for type, finiteness and range here, so a bad one is a
        ValueError naming its field when the params are made, not a failure inside a
        step of a batch. Integer fields take any integer type (numpy's too) and floats
        that are whole numbers (3.0, as JSON writers may give)."""
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

        def integer(name: str, low: int | None = None, high: int | None = None,
                    optional: bool = False) -> None:
            value = getattr(self, name)
            if value is None and optional:
                return
            if isinstance(value, float) and value.is_integer():
                value = int(value)  # 3.0, as JSON writers sometimes give integers
            ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
            if ok:
                value = int(value)
                setattr(self, name, value)
                ok = (low is None or value >= low) and (high is None or value <= high)
            if not ok:
                bounds = (f"in [{low}, {high}]" if low is not None and high is not None
                          else f">= {low}" if low is not None else "")
                raise bad(name, f"must be an integer {bounds}".rstrip())

        def real(name: str, ok, why: str) -> None:
            value = getattr(self, name)
            if not (isinstance(value, numbers.Real) and not isinstance(value, bool)
                    and math.isfinite(value) and ok(value)):
                raise bad(name, f"must be a number {why}")

        integer("n", 1)
        real("temperature", lambda v: v >= 0, ">= 0")
        real("top_p", lambda v: 0 < v <= 1, "in (0, 1]")
        if self.top_k is None:
            self.top_k = 0
        integer("top_k")  # <= 0 (or -1): no top-k filter
        real("min_p", lambda v: 0 <= v <= 1, "in [0, 1]")
        # seeds are int64, and the n samples of a prompt take seed, seed + 1, ...
        integer("seed", -2 ** 63, 2 ** 63 - self.n, optional=True)
        integer("max_tokens", 1, optional=True)
        integer("min_tokens", 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        real("repetition_penalty", lambda v: v > 0, "> 0")
        real("presence_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]")
        real("frequency_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]")
        integer("logprobs", 0, optional=True)
        integer("prompt_logprobs", 0, optional=True)
        integer("truncate_prompt_tokens", -1, optional=True)
        if self.truncate_prompt_tokens == 0:
            raise bad("truncate_prompt_tokens", "must be >= 1, or -1 (as many as fit)")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"SamplingParams.stop must be non-empty strings, got {self.stop!r}")
        ids = [int(t) if isinstance(t, float) and t.is_integer() else t
               for t in self.stop_token_ids]
        if any(not isinstance(t, numbers.Integral) or isinstance(t, bool) or t < 0 for t in ids):
            raise bad("stop_token_ids", "must be integers >= 0")
        self.stop_token_ids = [int(t) for t in ids]
        self._validate_constraints()

    def _validate_constraints(self) -> None:
        def token_id(t) -> int:
            if isinstance(t, str) and t.strip().isdigit():  # JSON object keys are strings
                t = int(t)
            if isinstance(t, float) and t.is_integer():
                t = int(t)
            if not isinstance(t, numbers.Integral) or isinstance(t, bool) or t < 0:
                raise ValueError(f"token ids must be integers >= 0, got {t!r}")
            return int(t)

        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError("SamplingParams.logit_bias must map token ids to numbers, "
                                 f"got {self.logit_bias!r}")
            bias = {}
            for t, v in self.logit_bias.items():
                try:
                    t = token_id(t)
                except ValueError as e:
                    raise ValueError(f"SamplingParams.logit_bias: {e}") from None
                if not (isinstance(v, numbers.Real) and not isinstance(v, bool)
                        and math.isfinite(v) and -100 <= v <= 100):
                    raise ValueError(f"SamplingParams.logit_bias values must be numbers in "
                                     f"[-100, 100], got {v!r} for token {t}")
                bias[t] = float(v)
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if isinstance(ids, (str, bytes, dict)) or not hasattr(ids, "__iter__"):
                raise ValueError("SamplingParams.allowed_token_ids must be a list of token ids, "
                                 f"got {ids!r}")
            try:
                self.allowed_token_ids = sorted({token_id(t) for t in ids})
            except ValueError as e:
                raise ValueError(f"SamplingParams.allowed_token_ids: {e}") from None
            if not self.allowed_token_ids:
                raise ValueError("SamplingParams.allowed_token_ids must not be empty")
        if self.structured_outputs is not None:
            if isinstance(self.structured_outputs, dict):
                try:
                    self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
                except TypeError as e:
                    raise ValueError(f"SamplingParams.structured_outputs: {e}") from None
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError("SamplingParams.structured_outputs must be a "
                                 "StructuredOutputsParams")
            if self.ignore_eos or self.min_tokens:
                raise ValueError("SamplingParams.structured_outputs ends each completion "
                                 "with the end-of-sequence token: ignore_eos and "
                                 "min_tokens cannot be set with it")
            if self.allowed_token_ids is not None:
                raise ValueError("SamplingParams.structured_outputs and allowed_token_ids "
                                 "cannot be combined; give one of them")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def constrained(self) -> bool:
        """Whether the sampler masks or biases this request's logits."""
        return (self.logit_bias is not None or self.allowed_token_ids is not None
                or self.structured_outputs is not None)

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def clone(self, **changes) -> "SamplingParams":
        return replace(self, **changes)
