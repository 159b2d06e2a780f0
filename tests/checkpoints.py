"""Shared test helpers: the random-weight checkpoints the tests run on, prompts for them,
and greedy reference outputs from transformers.

conftest.py puts this directory on sys.path, so test files use `import checkpoints`.
"""
from __future__ import annotations

import functools
import math
import random
import time
from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from batchinfer.random_checkpoint import SHAPES, build_random_checkpoint, default_corpus


def _one_kv_head(shape: str) -> dict[str, Any]:
    """A test shape with a single KV head (more ranks than KV heads replicate it)."""
    return {**SHAPES[shape], "num_key_value_heads": 1}


# Fixture name -> build_random_checkpoint arguments. The llama variants share shape and
# seed, so they hold identical weights and must give identical outputs (not the kv1 ones).
CHECKPOINTS: dict[str, dict[str, Any]] = {
    "llama": dict(shape="test-llama"),
    "mistral": dict(shape="test-mistral"),
    "qwen2": dict(shape="test-qwen2"),
    "qwen2_yarn": dict(shape="test-qwen2-yarn"),
    "qwen3": dict(shape="test-qwen3"),
    "phi3": dict(shape="test-phi3"),
    "phi4_mini": dict(shape="test-phi4-mini"),
    "gemma2": dict(shape="test-gemma2"),
    "gemma3": dict(shape="test-gemma3"),
    "mixtral": dict(shape="test-mixtral"),
    "qwen3_moe": dict(shape="test-qwen3-moe"),
    "glm4_moe": dict(shape="test-glm4-moe"),
    "deepseek_v3": dict(shape="test-deepseek-v3"),
    "deepseek_v3_no_q_lora": dict(shape={**SHAPES["test-deepseek-v3"], "q_lora_rank": None}),
    "gpt_oss": dict(shape="test-gpt-oss"),
    "llama_legacy_rope": dict(shape="test-llama", rope_style="legacy"),
    "llama_sharded": dict(shape="test-llama", max_shard_size="200KB"),
    "llama_kv1": dict(shape=_one_kv_head("test-llama")),
    "qwen2_kv1": dict(shape=_one_kv_head("test-qwen2")),
    "phi4_mini_kv1": dict(shape=_one_kv_head("test-phi4-mini")),
}

# Seconds each checkpoint took to build in this session, for the terminal summary.
BUILD_SECONDS: dict[str, float] = {}


def build_checkpoint(name: str, root: Path) -> Path:
    """Build the checkpoint CHECKPOINTS[name] under `root` and record its build time."""
    start = time.perf_counter()
    path = build_random_checkpoint(root / name, **CHECKPOINTS[name])
    BUILD_SECONDS[name] = time.perf_counter() - start
    return path


def mixed_prompts(tokenizer: Any, n: int, min_len: int = 1, max_len: int = 320,
                  seed: int = 0) -> list[list[int]]:
    """`n` prompts of token ids, bos first, with lengths spread log-uniformly over
    [min_len, max_len] (both ends included once n >= 2), cut from the tokenized corpus at
    random offsets. Same arguments, same prompts."""
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got {min_len} and {max_len}")
    text_ids = _corpus_ids(tokenizer)
    while len(text_ids) < max_len:
        text_ids = text_ids + text_ids
    rng = random.Random(seed)
    lengths = [min_len, max_len][:n]
    lengths += [round(math.exp(rng.uniform(math.log(min_len), math.log(max_len))))
                for _ in range(n - len(lengths))]
    rng.shuffle(lengths)
    prompts = []
    for length in lengths:
        start = rng.randrange(len(text_ids) - length + 1)
        prompts.append([tokenizer.bos_token_id] + text_ids[start:start + length - 1])
    return prompts


def shared_prefix_prompts(tokenizer: Any, n: int, prefix_len: int, max_suffix_len: int,
                          seed: int = 0) -> list[list[int]]:
    """`n` prompts that all start with the same `prefix_len` tokens (bos included) and
    then differ, each with 1..max_suffix_len further tokens: the prefix-cache workload."""
    prefix = mixed_prompts(tokenizer, 1, prefix_len, prefix_len, seed)[0]
    suffixes = mixed_prompts(tokenizer, n, 2, max_suffix_len + 1, seed + 1)
    return [prefix + suffix[1:] for suffix in suffixes]


def _corpus_ids(tokenizer: Any) -> list[int]:
    return tokenizer("\n\n".join(default_corpus()), add_special_tokens=False)["input_ids"]


@dataclass
class GreedyOutput:
    """Greedy continuations (prompt excluded, stop token included) and, for each
    generated position, the ids of the 5 largest logits, best first."""
    token_ids: list[list[int]]
    top5: list[list[list[int]]]


@functools.lru_cache(maxsize=4)
def _load_hf_model(model_dir: str, gguf_file: str | None = None) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager",
                                                 gguf_file=gguf_file)
    return model.eval()


@torch.inference_mode()
def hf_greedy(model_dir: str | Path, prompt_ids: Sequence[Sequence[int]],
              max_new_tokens: int, ignore_eos: bool = False,
              gguf_file: str | None = None) -> GreedyOutput:
    """transformers' own greedy `generate`, float32, one prompt at a time (no padding):
    the reference our engine is compared with. Stops at the checkpoint's eos ids unless
    `ignore_eos`. `gguf_file`: the model is that GGUF file in model_dir, dequantized."""
    model = _load_hf_model(str(model_dir), gguf_file)
    stop = {"eos_token_id": []} if ignore_eos else {}
    tokens, top5 = [], []
    for ids in prompt_ids:
        input_ids = torch.tensor([list(ids)], dtype=torch.long)
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                             max_new_tokens=max_new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, **stop)
        tokens.append(out.sequences[0, input_ids.shape[1]:].tolist())
        top5.append([step[0].topk(5).indices.tolist() for step in out.logits])
    return GreedyOutput(tokens, top5)


@dataclass
class GreedyComparison:
    """Outcome of compare_greedy: sequences equal throughout (`exact`), equal up to a
    divergence where each side's token is in the other's top 5 (`tolerated`), and the rest
    (`mismatched`, explained in `failures`)."""
    exact: int = 0
    tolerated: int = 0
    mismatched: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.mismatched == 0


def compare_greedy(ours: Sequence[Sequence[int]], theirs: Sequence[Sequence[int]],
                   ours_top5: Sequence[Sequence[Container[int]]],
                   theirs_top5: Sequence[Sequence[Container[int]]]) -> GreedyComparison:
    """vLLM's rule for comparing greedy outputs of two implementations: tokens must be equal
    up to the first divergence; there, each side's token must be among the other side's
    top 5 (a near-tie that rounding may flip); after it nothing is compared. Sequences that
    agree but differ in length count as mismatched. A top-5 entry may be any container of
    ids, such as a list or a {token_id: logprob} dict."""
    if not len(ours) == len(theirs) == len(ours_top5) == len(theirs_top5):
        raise ValueError("ours, theirs, ours_top5 and theirs_top5 must have one entry per "
                         f"prompt, got {len(ours)}, {len(theirs)}, {len(ours_top5)} and "
                         f"{len(theirs_top5)}")
    result = GreedyComparison()
    for i, (a, b) in enumerate(zip(ours, theirs)):
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first is None:
            if len(a) == len(b):
                result.exact += 1
            else:
                result.mismatched += 1
                result.failures.append(f"prompt {i}: equal tokens but lengths {len(a)} "
                                       f"(ours) and {len(b)} (theirs)")
        elif a[first] in theirs_top5[i][first] and b[first] in ours_top5[i][first]:
            result.tolerated += 1
        else:
            result.mismatched += 1
            result.failures.append(
                f"prompt {i}: step {first}: ours {a[first]} (top5 "
                f"{list(ours_top5[i][first])}), theirs {b[first]} (top5 "
                f"{list(theirs_top5[i][first])})")
    return result
