"""JSON schemas as regexes: instances written compactly match, others do not, what cannot
be expressed is refused by name, and the engine's completions parse as instances."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from batchinfer import LLM, SamplingParams
from batchinfer.structured.json_schema import json_schema_regex
from batchinfer.structured.regex_automaton import RegexAutomaton

LABEL = {"type": "object", "properties": {
    "label": {"enum": ["positive", "negative"]}, "confidence": {"type": "number"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    "ok": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 5}},
    "required": ["label"]}
CASES = [
    (LABEL, [{"label": "positive", "confidence": 0.5, "tags": [], "ok": True, "note": None},
             {"label": "negative", "confidence": -1e-3, "tags": ["a", "é\"\n"], "ok": False,
              "note": "hi"}],
     [{"label": "neutral", "confidence": 1, "tags": [], "ok": True, "note": None},
      {"label": "positive", "confidence": 1, "tags": ["x"] * 4, "ok": True, "note": None},
      {"label": "positive", "confidence": 1, "tags": ["toolongtag"], "ok": True, "note": None},
      {"label": "positive", "confidence": 1, "tags": [], "ok": True}]),
    ({"$defs": {"p": {"type": "object", "properties": {"x": {"type": "integer"}}}},
      "type": "array", "items": {"$ref": "#/$defs/p"}, "minItems": 2, "maxItems": 3},
     [[{"x": 1}, {"x": -20}], [{"x": 0}] * 3], [[{"x": 1}], [{"x": 1}] * 4, [{"x": 1.5}] * 2]),
    ({"anyOf": [{"type": "string", "minLength": 2}, {"const": 3}]}, ["hello", 3], ["a", 4, None]),
    ({"type": "array", "items": {"type": "integer"}}, [[], [1, 2, 3]], [[1.0], {}]),
    ({"type": "string", "enum": ["a", 1, "b"]}, ["a", "b"], [1]),  # the type filters enum
    ({"type": "string", "minLength": 2}, ["ab", "\U0001F600\U0001F600"], ["\U0001F600"]),
    ({"type": "number"}, [1e99, -0.0, 12.5], [1e100]),
]


@pytest.mark.parametrize("schema, good, bad", CASES)
def test_instances_written_compactly_match(schema, good, bad):
    automaton = RegexAutomaton(json_schema_regex(schema))
    for value in good:
        assert automaton.matches(json.dumps(value, ensure_ascii=False).encode()), value
    for value in bad:
        assert not automaton.matches(json.dumps(value, ensure_ascii=False).encode()), value
    assert json_schema_regex(json.dumps(schema)) == json_schema_regex(schema)  # JSON text too


@pytest.mark.parametrize("schema, what", [
    ({"type": "string", "format": "date"}, "format"), ({"type": "integer", "minimum": 0}, "minimum"),
    ({}, "unconstrained"), ({"$ref": "#/nowhere"}, "points nowhere"), ({"allOf": []}, "allOf"),
    ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "recursive"),
    ({"type": "object"}, None), ({"type": "array"}, "items"), ("{not json", "not valid JSON"),
    ({"type": "string", "maxLength": 2, "minLength": 3}, "below"),
    ({"type": "integer", "anyOf": [{"type": "string"}]}, "anyOf beside type"),
    ({"enum": ["x"], "minLength": 3}, "enum beside minLength"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]},
     "required properties without a schema"),
    # nested deeper than Python's json module goes: refused as any other depth, never a
    # RecursionError (which a job would not take as a failed row)
    ("[" * 100_000 + "]" * 100_000, "nesting deeper than 32"),
    (functools.reduce(lambda inner, _: {"anyOf": [inner]}, range(100_000), {"type": "null"}),
     "nesting deeper than 32")])
def test_what_cannot_be_expressed_is_refused(schema, what):
    if what is None:  # an object without properties: {} only
        assert RegexAutomaton(json_schema_regex(schema)).matches(b"{}")
        return
    with pytest.raises(ValueError, match=what):
        json_schema_regex(schema)
    with pytest.raises(ValueError):
        SamplingParams(structured_outputs={"json": schema})


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(model=str(llama_dir), dtype="float32", seed=0)


def test_completions_are_instances(llm):
    outs = llm.generate(["The river runs", "Once upon a time", "A short note on"],
                        SamplingParams(max_tokens=150, temperature=0.8, seed=1, n=2,
                                       structured_outputs={"json": LABEL}))
    for out in outs:
        for sample in out.outputs:
            assert sample.finish_reason == "stop", sample.text
            value = json.loads(sample.text)
            assert list(value) == list(LABEL["properties"])
            assert value["label"] in ("positive", "negative")
            assert isinstance(value["confidence"], (int, float))
            assert isinstance(value["ok"], bool) and len(value["tags"]) <= 3
            assert all(isinstance(t, str) and len(t) <= 8 for t in value["tags"])
            assert value["note"] is None or len(value["note"]) <= 5
    with pytest.raises(ValueError, match="one of choice, regex and json"):
        SamplingParams(structured_outputs={"json": LABEL, "regex": "a"})
    with pytest.raises(ValueError, match="grammar"):
        SamplingParams(structured_outputs={"grammar": "root ::= x"})


def test_a_surrogate_pair_cannot_count_as_two_characters():
    automaton = RegexAutomaton(json_schema_regex({"type": "string", "minLength": 2}))
    assert not automaton.matches(b'"\\ud83d\\ude00"')  # one character, as JSON reads it
    assert automaton.matches(b'"\\u00e9\\u00e9"') and automaton.matches('"😀😀"'.encode())
