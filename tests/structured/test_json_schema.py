"""JSON schemas through llguidance: instances written as completions are (json.dumps)
match and others do not, what llguidance refuses is refused with its reason, and the
engine's completions are instances (checked with the jsonschema package)."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import jsonschema
import pytest

from batchinfer import LLM, SamplingParams, StructuredOutputsParams
from batchinfer.structured.grammar import MAX_JSON_DEPTH, listed_properties_only

LABEL = {"type": "object", "properties": {
    "label": {"enum": ["positive", "negative"]}, "confidence": {"type": "number"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    "ok": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 5}},
    "required": ["label", "confidence", "tags", "ok", "note"]}
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
     [[{"x": 1}, {"x": -20}], [{"x": 0}] * 3, [{}, {}]],
     [[{"x": 1}], [{"x": 1}] * 4, [{"x": 1.5}] * 2, [{"y": 1}] * 2]),
    ({"anyOf": [{"type": "string", "minLength": 2}, {"const": 3}]}, ["hello", 3], ["a", 4, None]),
    ({"type": "array", "items": {"type": "integer"}}, [[], [1, 2, 3]], [[1.5], {}]),
    ({"type": "string", "minLength": 2}, ["ab", "\U0001F600\U0001F600"], ["\U0001F600"]),
    # what the compiler built in before could not express
    ({"type": "integer", "minimum": 0, "maximum": 120}, [0, 7, 120], [-1, 121, 1.5]),
    ({"type": "number", "exclusiveMinimum": 0, "maximum": 1}, [0.5, 1], [0, 1.5, -2]),
    ({"type": "string", "pattern": "^[A-Z]{2}-[0-9]+$"}, ["AB-12"], ["ab-12", "AB-"]),
    ({"type": "string", "format": "date"}, ["2024-02-29"], ["2024-13-01", "yesterday"]),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, [3, "x"], [None, [1]]),
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"properties": {"a": {"maximum": 5}}}]}, [{"a": 5}], [{"a": 6}, {}]),
    ({"enum": [1, "two", None, [3], {"four": 4}]}, [1, "two", None, [3], {"four": 4}],
     [2, "three", [4]]),
    ({"type": "object", "properties": {"a": {"type": "integer"}},
      "additionalProperties": {"type": "string"}}, [{"a": 1, "b": "x"}], [{"a": 1, "b": 2}]),
    ({"type": "object"}, [{}, {"any": [1, {"x": None}]}], [[], 3]),
]


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(model=str(llama_dir), dtype="float32", seed=0)


@pytest.mark.parametrize("schema, good, bad", CASES)
def test_instances_as_completions_write_them_match(llm, schema, good, bad):
    compiler = llm.llm_engine.grammars
    encode = compiler.hf_tokenizer.encode
    text = StructuredOutputsParams(json=schema).grammar_text()
    assert StructuredOutputsParams(json=json.dumps(schema)).grammar_text() == text  # JSON text
    start = compiler.compile(text)
    for values, expected in ((good, True), (bad, False)):
        for value in values:
            matcher = start.deep_copy()
            ids = encode(json.dumps(value, ensure_ascii=False), add_special_tokens=False)
            assert (matcher.consume_tokens(ids) and matcher.is_accepting()) == expected, value


def test_listed_properties_only_unless_the_schema_says_otherwise():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {}}},
              "$defs": {"properties": {"properties": {"x": {}}}},
              "const": {"properties": {}}}
    strict = listed_properties_only(schema)
    assert strict["additionalProperties"] is False
    assert strict["properties"]["a"]["additionalProperties"] is False
    assert strict["$defs"]["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in strict["$defs"]  # a map of names, not a schema
    assert strict["const"] == {"properties": {}}  # data
    loose = listed_properties_only({"properties": {}, "additionalProperties": True})
    assert loose["additionalProperties"] is True


@pytest.mark.parametrize("schema, what", [
    ({"$ref": "#/nowhere"}, "nowhere"), ({"type": "strin"}, "strin"),
    ({"type": "string", "maxLength": 2, "minLength": 3}, "minLength"),
    ("{not json", "not valid JSON"), (3, "must be an object or a boolean"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum"),
    ({"type": "array", "uniqueItems": True, "items": {"type": "integer"}}, "uniqueItems"),
    # nested deeper than Python's json module goes: refused as any other depth, never a
    # RecursionError (which a job would not take as a failed row)
    ("[" * 100_000 + "]" * 100_000, f"nesting deeper than {MAX_JSON_DEPTH}"),
    (functools.reduce(lambda inner, _: {"anyOf": [inner]}, range(100_000), {"type": "null"}),
     f"nesting deeper than {MAX_JSON_DEPTH}")])
def test_what_llguidance_refuses_is_refused_with_its_reason(schema, what):
    with pytest.raises(ValueError, match=what):
        SamplingParams(structured_outputs={"json": schema})


def test_completions_are_instances(llm):
    # (a number's digits are not bounded: a random model's could run to max_tokens)
    schema = {**LABEL, "properties": {**LABEL["properties"], "confidence": {
        "type": "integer", "minimum": 0, "maximum": 100}}}
    outs = llm.generate(["The river runs", "Once upon a time", "A short note on"],
                        SamplingParams(max_tokens=150, temperature=0.8, seed=1, n=2,
                                       structured_outputs={"json": schema}))
    for out in outs:
        for sample in out.outputs:
            assert sample.finish_reason == "stop", sample.text
            value = json.loads(sample.text)
            jsonschema.validate(value, schema)
            assert list(value) == list(schema["properties"])  # in the schema's order
    with pytest.raises(ValueError, match="one of choice, regex, json, grammar and json_object"):
        SamplingParams(structured_outputs={"json": LABEL, "regex": "a"})


def test_json_object_completions_are_objects(llm):
    outs = llm.generate(["The river runs", "Hello"], SamplingParams(
        max_tokens=60, temperature=1.0, seed=2, n=2, structured_outputs={"json_object": True}))
    for out in outs:
        for sample in out.outputs:
            assert sample.text.startswith("{"), sample.text
            if sample.finish_reason == "stop":  # else cut by max_tokens
                assert isinstance(json.loads(sample.text), dict)


def test_a_surrogate_pair_cannot_count_as_two_characters(llm):
    """Characters are counted as JSON reads them: an escaped surrogate pair is one (and
    \\u escapes are not written at all: characters go out as themselves)."""
    compiler = llm.llm_engine.grammars
    start = compiler.compile(StructuredOutputsParams(
        json={"type": "string", "minLength": 2}).grammar_text())

    def accepts(text: bytes) -> bool:
        matcher = start.deep_copy()
        return matcher.consume_tokens(compiler.tokenizer.tokenize_bytes(text)) \
            and matcher.is_accepting()
    assert not accepts(b'"\\ud83d\\ude00"') and not accepts('"😀"'.encode())
    assert accepts('"😀😀"'.encode()) and accepts('"éé"'.encode())
