"""The official JSON-Schema-Test-Suite (draft 2020-12, the copy in the jsonschema sdist,
fetched from PyPI into pytest's cache): every schema compiles or is refused with
llguidance's reason, no instance the suite calls invalid is accepted by a compiled schema,
and on a CI-sized subset the completions the real SmolLM2-135M model generates are valid
(checked with the jsonschema package)."""
from __future__ import annotations

import json
import tarfile
from pathlib import Path

import jsonschema
import pytest

from batchinfer import LLM, SamplingParams, StructuredOutputsParams
from pypi_files import pypi_download

# (file, how many of its first schemas) for the generation subset
SUBSET = {"type": 4, "enum": 3, "const": 3, "minimum": 2, "maximum": 2, "exclusiveMinimum": 1,
          "pattern": 1, "anyOf": 2, "oneOf": 2, "allOf": 2, "defs": 1, "ref": 2,
          "additionalProperties": 2, "items": 2, "minItems": 1, "maxItems": 1, "minLength": 1,
          "maxLength": 1, "required": 1, "properties": 2, "format": 1, "boolean_schema": 2}


@pytest.fixture(scope="session")
def suite(pytestconfig) -> dict[str, list[dict]]:
    """file stem -> its groups ({"description", "schema", "tests"}), the top-level
    draft2020-12 files (not optional/)."""
    sdist = pypi_download(pytestconfig, "jsonschema-sdist", "jsonschema", sdist=True,
                          pattern="jsonschema-*.tar.gz")
    out = {}
    with tarfile.open(sdist) as archive:
        for member in archive.getmembers():
            parts = Path(member.name).parts
            if member.isfile() and parts[-3:-1] == ("tests", "draft2020-12") \
                    and member.name.endswith(".json"):
                out[Path(parts[-1]).stem] = json.loads(archive.extractfile(member).read())
    if not out:
        pytest.skip(f"{sdist.name} holds no draft2020-12 test files")
    return out


def _compile(schema):
    """(params, None) or (None, the reason it is refused)."""
    try:
        return StructuredOutputsParams(json=schema), None
    except ValueError as e:
        return None, str(e)


def test_every_schema_compiles_or_is_refused_with_a_reason(suite, llama_dir):
    from transformers import AutoTokenizer

    from batchinfer.structured.grammar import GrammarCompiler
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    compiled = accepted_invalid = 0
    for stem, groups in suite.items():
        for group in groups:
            params, reason = _compile(group["schema"])
            if params is None:
                assert reason and "\n" not in reason, (stem, group["description"])
                continue
            compiled += 1
            start = compiler.compile(params.grammar_text())
            for test in group["tests"]:
                if test["valid"]:
                    continue  # (a valid instance's keys may be in another order than listed)
                text = json.dumps(test["data"], ensure_ascii=False)
                matcher = start.deep_copy()
                if matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) \
                        and matcher.is_accepting():
                    accepted_invalid += 1
                    print("accepted an invalid instance:", stem, group["description"], text)
    assert compiled > 0 and accepted_invalid == 0


@pytest.mark.slow  # loads a real model and generates under about 40 schemas
def test_completions_under_suite_schemas_are_valid(suite, smollm2_dir):
    cases = [(stem, group) for stem, count in SUBSET.items()
             for group in suite.get(stem, [])[:count]]
    assert len(cases) > 30
    compiled = [(stem, group, params) for stem, group in cases
                for params, _ in [_compile(group["schema"])] if params is not None]
    llm = LLM(model=str(smollm2_dir), dtype="float32", device="cpu", seed=0)
    prompts = [[{"role": "system", "content": "You answer with one JSON value."},
                {"role": "user", "content": "A JSON value valid under this JSON Schema: "
                                            + json.dumps(group["schema"])}]
               for _, group, _ in compiled]
    outs = llm.chat(prompts, [SamplingParams(max_tokens=48, temperature=0.0,
                                             structured_outputs=params)
                              for _, _, params in compiled])
    stopped = 0
    for (stem, group, _), out in zip(compiled, outs):
        sample = out.outputs[0]
        assert out.error is None, (stem, group["description"], out.error)
        if sample.finish_reason != "stop":  # cut by max_tokens: a prefix, not checked
            continue
        stopped += 1
        jsonschema.validate(json.loads(sample.text), group["schema"],
                            cls=jsonschema.Draft202012Validator)
    assert stopped >= len(compiled) // 2, (stopped, len(compiled))
