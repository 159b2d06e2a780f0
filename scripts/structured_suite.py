"""Structured outputs over the official JSON-Schema-Test-Suite (draft 2020-12): the share of
its schemas a checkout compiles, and the share of completions generated under them that
the `jsonschema` package finds valid. It uses the public API only (StructuredOutputsParams,
LLM), so it measures any checkout the same way:

    python scripts/structured_suite.py --model GGUF_DIR              # this checkout
    PYTHONPATH=/path/to/older/checkout python scripts/structured_suite.py --model GGUF_DIR

--suite: the suite's tests/draft2020-12 folder; without it the jsonschema sdist is fetched
with pip into --cache and its copy of the suite is read. --model: a model directory (the
tests use SmolLM2-135M-Instruct's GGUF); without it only the compiled share is reported.
Needs `pip install jsonschema` for the valid share.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class SuiteSchema:
    name: str         # file: description
    schema: object
    instances: list   # (data, valid) pairs from the suite


def fetch_suite(cache: Path) -> Path:
    """The draft2020-12 folder of the jsonschema sdist's copy of the suite, fetched once."""
    cache.mkdir(parents=True, exist_ok=True)
    folder = cache / "draft2020-12"
    if folder.is_dir():
        return folder
    if not list(cache.glob("jsonschema-*.tar.gz")):
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:",
                        "--no-deps", "-q", "jsonschema", "-d", str(cache)], check=True)
    sdist = sorted(cache.glob("jsonschema-*.tar.gz"))[-1]
    extract_suite(sdist, folder)
    return folder


def extract_suite(sdist: Path, folder: Path) -> None:
    """The top-level draft2020-12 test files of the sdist into folder (not optional/)."""
    partial = folder.with_suffix(".partial")
    partial.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as archive:
        for member in archive.getmembers():
            parts = Path(member.name).parts
            if parts[-3:-1] == ("tests", "draft2020-12") and member.name.endswith(".json") \
                    and member.isfile():
                (partial / parts[-1]).write_bytes(archive.extractfile(member).read())
    partial.rename(folder)


def load_suite(folder: Path) -> list[SuiteSchema]:
    out = []
    for path in sorted(folder.glob("*.json")):
        for group in json.loads(path.read_text(encoding="utf-8")):
            out.append(SuiteSchema(f"{path.stem}: {group['description']}", group["schema"],
                                   [(t["data"], t["valid"]) for t in group["tests"]]))
    return out


def compile_all(cases: list[SuiteSchema]) -> tuple[list, dict[str, str]]:
    """(the params of the schemas that compile, name -> reason for those refused)."""
    from batchinfer import StructuredOutputsParams
    compiled, refused = [], {}
    for case in cases:
        try:
            compiled.append((case, StructuredOutputsParams(json=case.schema)))
        except (ValueError, TypeError, RecursionError) as e:
            refused[case.name] = str(e).splitlines()[0] if str(e) else type(e).__name__
    return compiled, refused


def prompt_for(case: SuiteSchema) -> list[dict]:
    return [{"role": "system", "content": "You answer with one JSON value and nothing else."},
            {"role": "user", "content": "Write a JSON value that is valid under this JSON "
                                        f"Schema:\n{json.dumps(case.schema)}"}]


def check_output(schema, text: str, finish_reason: str) -> str:
    """"valid", "invalid: ..." or "cut" (max_tokens reached first)."""
    import jsonschema
    if finish_reason != "stop":
        return "cut" if finish_reason == "length" else f"invalid: finish_reason {finish_reason}"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return f"invalid: not JSON ({e})"
    try:
        error = jsonschema.exceptions.best_match(
            jsonschema.Draft202012Validator(schema).iter_errors(value))
    except jsonschema.exceptions.SchemaError:
        return "invalid: the schema itself is invalid"
    except Exception as e:  # a remote $ref the validator cannot resolve  # noqa: BLE001
        return f"unchecked: {type(e).__name__}"
    return "valid" if error is None else f"invalid: {error.message[:80]}"


def generate_all(model: str, compiled: list, max_tokens: int) -> list[tuple[str, str, str]]:
    """(name, completion, outcome) for each compiled schema, one greedy completion each."""
    from batchinfer import LLM, SamplingParams
    llm = LLM(model=model, dtype="float32", device="cpu", seed=0)
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=so)
              for _, so in compiled]
    outs = llm.chat([prompt_for(case) for case, _ in compiled], params)
    results = []
    for (case, _), out in zip(compiled, outs):
        sample = out.outputs[0]
        outcome = (f"invalid: error row ({out.error})" if out.error
                   else check_output(case.schema, sample.text, sample.finish_reason))
        results.append((case.name, sample.text, outcome))
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", type=Path, default=None)
    ap.add_argument("--cache", type=Path, default=Path(".pytest_cache/d/jsonschema-sdist"))
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--limit", type=int, default=None, help="the first N schemas only")
    ap.add_argument("--show", action="store_true", help="print each schema's outcome")
    args = ap.parse_args()
    cases = load_suite(args.suite or fetch_suite(args.cache))[:args.limit]
    start = time.perf_counter()
    compiled, refused = compile_all(cases)
    print(f"compiled {len(compiled)}/{len(cases)} ({len(compiled) / len(cases):.1%}) in "
          f"{time.perf_counter() - start:.1f} s; refused {len(refused)}")
    if args.show:
        for name, reason in refused.items():
            print(f"  refused  {name}: {reason}")
    if args.model is None:
        return
    results = generate_all(args.model, compiled, args.max_tokens)
    counts: dict[str, int] = {}
    for name, text, outcome in results:
        kind = outcome.split(":")[0]
        counts[kind] = counts.get(kind, 0) + 1
        if args.show or kind == "invalid":
            print(f"  {outcome:<40.40} {name[:60]}: {text[:60]!r}")
    valid = counts.get("valid", 0)
    print(f"valid {valid}/{len(cases)} of all schemas ({valid / len(cases):.1%}), "
          f"{valid}/{len(compiled)} of those compiled; outcomes: "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))


if __name__ == "__main__":
    main()
