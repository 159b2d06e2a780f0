"""llguidance against xgrammar, the measurements behind batchinfer's choice of library
(docs/structured-outputs.md). Not part of the package: xgrammar is not a dependency
(`pip install xgrammar` to run this).

    python scripts/compare_structured_libraries.py --suite DIR --tokenizer smollm2-135m
    python scripts/compare_structured_libraries.py --suite DIR --tokenizer qwen3-30b-a3b

--suite: the JSON-Schema-Test-Suite's draft2020-12 folder (scripts/structured_suite.py
fetches it). --tokenizer: a tokenizer directory or a named shape
(batchinfer.bench.models). For each library: the share of the suite's schemas it
compiles, of the suite's valid instances it accepts and of its invalid ones it rejects
(the instance written compactly, as its tokens), the compile time, the mask time per token
over the bench's realistic schemas, and what each hostile constraint costs (run in a child
process with a 300 s limit).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import statistics
import time
from pathlib import Path

import sys

import torch

from batchinfer.bench.models import resolve_model
from batchinfer.bench.structured import HOSTILE, REALISTIC

sys.path.insert(0, str(Path(__file__).parent))
from structured_suite import load_suite  # noqa: E402


class Guidance:
    name = "llguidance"

    def __init__(self, hf_tokenizer, vocab_size: int):
        import llguidance
        import llguidance.hf
        self.ll = llguidance
        self.tok = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
        self.vocab_size = vocab_size

    def compile(self, schema, regex: bool = False):
        m = self.ll.LLMatcher
        grammar = (m.grammar_from_regex(schema) if regex else m.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False, "item_separator": ",",
                              "key_separator": ":"}))
        matcher = m(self.tok, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matcher(self, compiled):
        return compiled.deep_copy()

    def accepts(self, compiled, ids: list[int]) -> bool:
        matcher = compiled.deep_copy()
        return matcher.consume_tokens(ids) and matcher.is_accepting()

    def walk(self, compiled, ids: list[int]) -> float:
        """Seconds of mask computation over the tokens (each mask, then the token)."""
        import llguidance.torch as lt
        matcher = compiled.deep_copy()
        mask = lt.allocate_token_bitmask(1, self.vocab_size)
        spent = 0.0
        for t in ids + [None]:
            start = time.perf_counter()
            lt.fill_next_token_bitmask(matcher, mask, 0)
            spent += time.perf_counter() - start
            if t is not None and not matcher.consume_token(t):
                raise RuntimeError(matcher.get_error())
        return spent


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf_tokenizer, vocab_size: int):
        import xgrammar
        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.eos = info.stop_token_ids[0]
        self.vocab_size = vocab_size

    def compile(self, schema, regex: bool = False):
        if regex:
            return self.compiler.compile_regex(schema)
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                 separators=(",", ":"))

    def accepts(self, compiled, ids: list[int]) -> bool:
        matcher = self.xgr.GrammarMatcher(compiled)
        return all(matcher.accept_token(t) for t in ids) and matcher.accept_token(self.eos)

    def walk(self, compiled, ids: list[int]) -> float:
        matcher = self.xgr.GrammarMatcher(compiled)
        mask = self.xgr.allocate_token_bitmask(1, self.vocab_size)
        spent = 0.0
        for t in ids + [None]:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(mask, 0)
            spent += time.perf_counter() - start
            if t is not None and not matcher.accept_token(t):
                raise RuntimeError("token refused")
        return spent


LIBRARIES = {"llguidance": Guidance, "xgrammar": XGrammar}


def _hostile_child(lib_name: str, tokenizer_path: str, constraint, queue) -> None:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    lib = LIBRARIES[lib_name](tok, len(tok))
    # a first compile and mask, untimed: imports and one-time set-up are not the constraint's
    lib.walk(lib.compile("[ab]+", regex=True), tok.encode("ab", add_special_tokens=False)[:1])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    try:
        compiled = lib.compile(constraint, regex=isinstance(constraint, str))
        # the first masks too: a library may defer its work to them
        ids = tok.encode("a" * 20 if isinstance(constraint, str) else "[[[", add_special_tokens=False)
        try:
            lib.walk(compiled, ids[:3])
        except RuntimeError:
            pass
        outcome = "compiled"
    except Exception as e:  # noqa: BLE001 - any refusal is an outcome to report
        outcome = f"refused: {str(e).splitlines()[0][:100]}"
    seconds = time.perf_counter() - start
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    queue.put((outcome, seconds, grown / 1024))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", required=True, type=Path)
    ap.add_argument("--tokenizer", default="smollm2-135m")
    ap.add_argument("--libraries", default="llguidance,xgrammar")
    args = ap.parse_args()
    from transformers import AutoTokenizer
    path = resolve_model(args.tokenizer, load_format="dummy").path
    tok = AutoTokenizer.from_pretrained(path)
    vocab = len(tok)
    schemas = load_suite(args.suite)
    print(f"tokenizer {args.tokenizer}: {vocab} tokens; {len(schemas)} schemas in the suite")
    for name in args.libraries.split(","):
        start = time.perf_counter()
        lib = LIBRARIES[name](tok, vocab)
        setup = time.perf_counter() - start
        compiled = 0
        compile_times = []
        accepted = valid = rejected = invalid = 0
        for case in schemas:
            start = time.perf_counter()
            try:
                grammar = lib.compile(case.schema)
            except Exception:  # noqa: BLE001
                continue
            finally:
                compile_times.append(time.perf_counter() - start)
            compiled += 1
            for data, ok in case.instances:
                text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
                ids = tok.encode(text, add_special_tokens=False)
                try:
                    got = lib.accepts(grammar, ids)
                except Exception:  # noqa: BLE001
                    got = False
                if ok:
                    valid += 1
                    accepted += got
                else:
                    invalid += 1
                    rejected += not got
        print(f"\n{name}: tokenizer setup {setup:.2f} s; compiled {compiled}/{len(schemas)} "
              f"({compiled / len(schemas):.1%}); of compiled schemas' instances, accepts "
              f"{accepted}/{valid} valid, rejects {rejected}/{invalid} invalid; compile "
              f"median {statistics.median(compile_times) * 1e3:.2f} ms, max "
              f"{max(compile_times) * 1e3:.1f} ms")
        for key, (schema, instance) in REALISTIC.items():
            text = json.dumps(instance, ensure_ascii=False, separators=(",", ":"))
            ids = tok.encode(text, add_special_tokens=False)
            start = time.perf_counter()
            try:
                grammar = lib.compile(schema)
            except Exception as e:  # noqa: BLE001
                print(f"  {key:<20} refused: {str(e)[:80]}")
                continue
            built = time.perf_counter() - start
            try:
                seconds = lib.walk(grammar, ids)
            except RuntimeError as e:
                print(f"  {key:<20} compile {built * 1e3:8.1f} ms; its instance refused ({e})")
                continue
            print(f"  {key:<20} compile {built * 1e3:8.1f} ms, mask {seconds * 1e6 / (len(ids) + 1):8.1f} "
                  f"us/token over {len(ids) + 1} tokens")
        ctx = multiprocessing.get_context("spawn")
        for key, constraint in HOSTILE.items():
            queue = ctx.Queue()
            child = ctx.Process(target=_hostile_child, args=(name, path, constraint, queue))
            child.start()
            child.join(300)
            if child.is_alive():
                child.kill()
                print(f"  hostile {key}: still running after 300 s")
                continue
            outcome, seconds, mb = queue.get() if not queue.empty() else ("crashed", 0, 0)
            print(f"  hostile {key}: {outcome} in {seconds * 1e3:.0f} ms, +{mb:.0f} MB peak RSS")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
