"""Validate and retry (`--max-attempts K`): a completion that is not valid for its row's
constraint is generated again with a new seed, up to K attempts, before its row is
committed.

    reason = invalid_reason(text, finish_reason, constraint)   # None when valid
    params = retry_params(params, row_id, sample_index, attempt)

A completion is invalid when it was cut off by max_tokens (finish_reason "length"), or
when its text is not one of the choices, does not match the regex whole (re.fullmatch),
or is not JSON that validates against the schema (jsonschema) or, for --json-object, not
a JSON object. A grammar's completion that was not cut off is one of its sentences. The seed of attempt a > 1
is derived from the row's seed (else its id), the sample and a, so a rerun repeats it.
"""
from __future__ import annotations

import functools
import hashlib
import json
import re
from typing import Any

from batchinfer.sampling_params import SamplingParams, StructuredOutputsParams

_SEED_BITS = 62  # derived seeds stay well inside SamplingParams' int64 range


def invalid_reason(text: str | None, finish_reason: str | None,
                   constraint: StructuredOutputsParams) -> str | None:
    """Why a completion does not satisfy its constraint, or None when it does."""
    if finish_reason == "length":
        return "invalid output: cut off by max_tokens before the constraint was complete"
    text = text or ""
    if constraint.choice is not None:
        if text not in constraint.choice:
            return f"invalid output: {_shown(text)} is not one of the choices"
        return None
    if constraint.regex is not None:
        pattern = _compiled(constraint.regex)
        if pattern is not None and pattern.fullmatch(text) is None:
            return f"invalid output: {_shown(text)} does not match the regex"
        return None
    if constraint.json is not None:
        return _json_reason(text, constraint.json)
    if constraint.json_object:
        return _json_reason(text, {"type": "object"})
    # a grammar: a completion not cut off ends only where the grammar accepts (the
    # decoding lets the end-of-sequence token through there alone)
    return None


def _json_reason(text: str, schema: Any) -> str | None:
    import jsonschema
    try:
        instance = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        return f"invalid output: not JSON ({getattr(e, 'msg', 'nested too deeply')})"
    if isinstance(schema, str):
        schema = json.loads(schema)
    try:
        cls = jsonschema.validators.validator_for(schema)
        error = jsonschema.exceptions.best_match(cls(schema).iter_errors(instance))
    except jsonschema.exceptions.SchemaError:
        return None  # a schema jsonschema does not take is checked by the decoding alone
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path)
    return f"invalid output: does not match the JSON schema at /{where}: {error.message}"


@functools.lru_cache(maxsize=64)
def _compiled(regex: str) -> re.Pattern | None:
    try:
        return re.compile(regex)
    except re.error:
        return None


def _shown(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def retry_seed(seed: int | None, row_id: Any, sample_index: int, attempt: int) -> int:
    """The seed of a sample's attempt > 1: from the row's seed (its sample's, seed + index,
    as the engine seeds the samples of a request), else from the row's id."""
    base = ["seed", seed + sample_index] if seed is not None else ["id", str(row_id),
                                                                    sample_index]
    digest = hashlib.sha256(json.dumps([*base, attempt]).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> (64 - _SEED_BITS)


def retry_params(params: SamplingParams, row_id: Any, sample_index: int,
                 attempt: int) -> SamplingParams:
    """The params of one sample's attempt > 1: one completion, a derived seed."""
    return params.clone(n=1, seed=retry_seed(params.seed, row_id, sample_index, attempt))


def can_retry(params: SamplingParams) -> bool:
    """Whether another attempt can differ: not under greedy sampling."""
    return params.structured_outputs is not None and params.temperature > 0
