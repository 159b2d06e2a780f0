"""Benchmark prompts: token-id lists with a fixed output length each.

Three sources, named as in `vllm bench throughput --dataset-name`:
  random             random ids; input length uniform in input_len * [1 - r, 1 + r],
                     with an optional shared prefix of prefix_len ids in front of every prompt.
  prefix_repetition  num_prefixes random prefixes, each shared by an equal share of the
                     prompts, followed by a unique random suffix.
  file               a JSONL file with one object per line: "prompt" (text, tokenised here) or
                     "prompt_token_ids", and an optional "output_len".
All random draws come from one numpy generator seeded with --seed, so a workload is the same
on every run and for every system it is fed to.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

DATASET_NAMES = ("random", "prefix_repetition", "file")


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


@dataclass(frozen=True)
class Sampling:
    """How every request of a run picks its tokens: greedy (temperature 0) unless set;
    top_k 0, top_p 1 and min_p 0 are off. logprobs / prompt_logprobs: our engine also
    keeps the top k of each output / prompt token (None: not asked)."""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def engine_params(self, output_len: int):
        """Our engine's SamplingParams: exactly output_len tokens."""
        from batchinfer.sampling_params import SamplingParams
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              min_p=self.min_p, max_tokens=output_len, ignore_eos=True,
                              logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs)

    def hf_generation_kwargs(self) -> dict:
        """The same settings as transformers' GenerationConfig fields (its top_k is 50
        unless set, so 0 is passed to turn it off)."""
        if self.temperature == 0:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "min_p": self.min_p or None}


@dataclass(frozen=True)
class WorkloadPreset:
    """A named workload: the values it gives to the dataset flags."""

    description: str
    dataset_name: str
    prefix_len: int
    input_len: int
    random_range_ratio: float  # applies to the unique part of the prompt only
    output_len: int


# input_len 96 with ratio 2/3 gives unique parts of 32..160 ids.
WORKLOADS = {
    "shared-prefix": WorkloadPreset(
        "a 256-token shared system prompt + 32-160-token unique suffixes, 64 output tokens",
        "random", prefix_len=256, input_len=96, random_range_ratio=2 / 3, output_len=64),
    "no-shared-prefix": WorkloadPreset(
        "the shared-prefix lengths (288-416 tokens) with no prefix in common, 64 output tokens",
        "random", prefix_len=0, input_len=352, random_range_ratio=64 / 352, output_len=64),
}


def _length_range(length: int, ratio: float) -> tuple[int, int]:
    low = max(1, math.ceil(length * (1 - ratio) - 1e-9))
    high = max(low, math.floor(length * (1 + ratio) + 1e-9))
    return low, high


def _random_ids(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    return rng.integers(0, vocab_size, size=n).tolist()


def random_requests(num_prompts: int, input_len: int, output_len: int, vocab_size: int, *,
                    prefix_len: int = 0, random_range_ratio: float = 0.0,
                    output_range_ratio: float | None = None,
                    seed: int = 0) -> list[BenchRequest]:
    """vLLM's "random" dataset: [shared prefix] + random ids of varied length. Output
    lengths vary by output_range_ratio, which defaults to random_range_ratio as in vLLM."""
    rng = np.random.default_rng(seed)
    prefix = _random_ids(rng, prefix_len, vocab_size)
    in_low, in_high = _length_range(input_len, random_range_ratio)
    out_ratio = random_range_ratio if output_range_ratio is None else output_range_ratio
    out_low, out_high = _length_range(output_len, out_ratio)
    input_lens = rng.integers(in_low, in_high + 1, size=num_prompts)
    output_lens = rng.integers(out_low, out_high + 1, size=num_prompts)
    return [BenchRequest(prefix + _random_ids(rng, int(n), vocab_size), int(m))
            for n, m in zip(input_lens, output_lens)]


def prefix_repetition_requests(num_prompts: int, prefix_len: int, suffix_len: int,
                               num_prefixes: int, output_len: int, vocab_size: int, *,
                               seed: int = 0) -> list[BenchRequest]:
    """vLLM's "prefix_repetition" dataset; prompts sharing a prefix are spread over the run."""
    rng = np.random.default_rng(seed)
    prefixes = [_random_ids(rng, prefix_len, vocab_size) for _ in range(num_prefixes)]
    requests = [BenchRequest(prefixes[i % num_prefixes] + _random_ids(rng, suffix_len, vocab_size),
                             output_len) for i in range(num_prompts)]
    order = rng.permutation(num_prompts)
    return [requests[i] for i in order]


def file_requests(path: str | Path, num_prompts: int | None, output_len: int,
                  tokenize: Callable[[str], list[int]]) -> list[BenchRequest]:
    """Prompts from a JSONL file; the first num_prompts lines (all when None)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--dataset-path {path} is not a file")
    requests: list[BenchRequest] = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if num_prompts is not None and len(requests) >= num_prompts:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"--dataset-path {path}:{line_no}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"--dataset-path {path}:{line_no}: expected a JSON object")
            if "prompt_token_ids" in row:
                ids = row["prompt_token_ids"]
                if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                    raise ValueError(f"--dataset-path {path}:{line_no}: prompt_token_ids must be "
                                     "a list of integers")
            elif isinstance(row.get("prompt"), str):
                ids = tokenize(row["prompt"])
            else:
                raise ValueError(f"--dataset-path {path}:{line_no}: needs a \"prompt\" string or "
                                 "\"prompt_token_ids\"")
            n_out = row.get("output_len", output_len)
            if not isinstance(n_out, int) or n_out < 1:
                raise ValueError(f"--dataset-path {path}:{line_no}: output_len must be an "
                                 f"integer >= 1, got {n_out!r}")
            requests.append(BenchRequest(list(ids), n_out))
    if not requests:
        raise ValueError(f"--dataset-path {path} holds no prompts")
    return requests


def workload_stats(requests: list[BenchRequest]) -> dict:
    """Shape of a workload, for the report."""
    in_lens = [len(r.prompt_token_ids) for r in requests]
    out_lens = [r.output_len for r in requests]
    return {"num_prompts": len(requests), "prompt_tokens": sum(in_lens),
            "output_tokens": sum(out_lens), "min_prompt_len": min(in_lens),
            "max_prompt_len": max(in_lens), "min_output_len": min(out_lens),
            "max_output_len": max(out_lens)}
