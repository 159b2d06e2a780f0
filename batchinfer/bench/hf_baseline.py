"""The same prompts through transformers, in the same process, for a ratio to ours.

Two ways users run transformers offline:
  static  model.generate() on fixed batches, left-padded, every sequence forced to
          exactly its batch's output length (min_new_tokens = max_new_tokens); the best of
          several batch sizes is reported.
  cb      transformers' own continuous batching (model.continuous_batching_context_manager,
          the machinery behind generate_batch) with per-request max_new_tokens and EOS off.
Both decode greedily, or sample with the run's settings (bench.workloads.Sampling). Only
generation is timed; each mode runs a small warm-up first.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from batchinfer.bench.models import ModelSource
from batchinfer.bench.workloads import BenchRequest, Sampling


@dataclass
class BaselineRun:
    name: str
    elapsed_s: float
    prompt_tokens: int
    output_tokens: int
    detail: dict = field(default_factory=dict)


def load_hf_model(source: ModelSource, dtype: torch.dtype, device: torch.device,
                  seed: int, trust_remote_code: bool = False) -> torch.nn.Module:
    """The checkpoint's weights when it has them; otherwise seeded random weights of the
    same shape (throughput does not depend on the values)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    if source.has_weights:
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype,
                                                     trust_remote_code=trust_remote_code)
    else:
        torch.manual_seed(seed)
        config = AutoConfig.from_pretrained(source.path, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                 trust_remote_code=trust_remote_code)
    return model.to(device).eval()


def _pad_id(model: torch.nn.Module) -> int:
    for value in (getattr(model.generation_config, "pad_token_id", None),
                  getattr(model.config, "pad_token_id", None)):
        if isinstance(value, int):
            return value
    return 0


@torch.inference_mode()
def _generate_batch(model: torch.nn.Module, batch: list[BenchRequest], pad_id: int,
                    sampling: Sampling) -> int:
    """One left-padded batch; returns the useful output tokens (each request's own
    length, not the batch maximum it was padded to)."""
    from transformers import GenerationConfig
    device = model.device
    width = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, r in enumerate(batch):
        n = len(r.prompt_token_ids)
        ids[row, width - n:] = torch.tensor(r.prompt_token_ids)
        mask[row, width - n:] = 1
    max_new = max(r.output_len for r in batch)
    config = GenerationConfig(**sampling.hf_generation_kwargs(), max_new_tokens=max_new,
                              min_new_tokens=max_new, pad_token_id=pad_id,
                              eos_token_id=model.generation_config.eos_token_id)
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                         generation_config=config)
    if out.shape[1] != width + max_new:
        raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens, "
                           f"expected {max_new}")
    return sum(r.output_len for r in batch)


def run_static(model: torch.nn.Module, requests: list[BenchRequest], batch_sizes: list[int],
               sampling: Sampling = Sampling()) -> BaselineRun:
    """Static batching in workload order at each batch size; the fastest one is reported."""
    pad_id = _pad_id(model)
    _generate_batch(model, [BenchRequest(requests[0].prompt_token_ids[:16], 2)] * 2, pad_id,
                    sampling)
    per_size: dict[int, float] = {}
    for bs in sorted({min(b, len(requests)) for b in batch_sizes}):
        t0 = time.perf_counter()
        for start in range(0, len(requests), bs):
            _generate_batch(model, requests[start:start + bs], pad_id, sampling)
        per_size[bs] = time.perf_counter() - t0
    best = min(per_size, key=per_size.get)
    return BaselineRun("hf_static", per_size[best],
                       sum(len(r.prompt_token_ids) for r in requests),
                       sum(r.output_len for r in requests),
                       {"batch_size": best,
                        "elapsed_s_by_batch_size": {str(k): v for k, v in per_size.items()}})


def continuous_batching_available(model: torch.nn.Module) -> bool:
    return hasattr(model, "continuous_batching_context_manager")


def _cb_config(requests: list[BenchRequest], max_num_seqs: int, max_batch_tokens: int):
    """KV room for the max_num_seqs longest requests at once, like our engine's cap."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    defaults = ContinuousBatchingConfig()
    # the KV page size: page_size in recent transformers, block_size before
    page = getattr(defaults, "page_size", None) or defaults.block_size
    longest = sorted((len(r.prompt_token_ids) + r.output_len for r in requests), reverse=True)
    num_blocks = sum(math.ceil(n / page) for n in longest[:max_num_seqs]) + 2
    return ContinuousBatchingConfig(num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                                    max_requests_per_batch=max_num_seqs)


@torch.no_grad()  # not inference_mode: transformers' CB thread updates tensors made here
def _cb_session(model: torch.nn.Module, requests: list[BenchRequest], max_num_seqs: int,
                max_batch_tokens: int, sampling: Sampling) -> float:
    from transformers import GenerationConfig
    config = GenerationConfig(**sampling.hf_generation_kwargs(),
                              max_new_tokens=max(r.output_len for r in requests),
                              eos_token_id=-1, pad_token_id=_pad_id(model))
    cb_config = _cb_config(requests, max_num_seqs, max_batch_tokens)
    with model.continuous_batching_context_manager(generation_config=config,
                                                   continuous_batching_config=cb_config,
                                                   block=True, timeout=30) as manager:
        t0 = time.perf_counter()
        for i, r in enumerate(requests):
            manager.add_request(r.prompt_token_ids, request_id=f"bench-{i}",
                                max_new_tokens=r.output_len)
        done: dict[str, int] = {}
        while len(done) < len(requests):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers continuous batching stopped with "
                                       f"{len(requests) - len(done)} requests unfinished")
                continue
            if result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"transformers continuous batching failed "
                                       f"{result.request_id}: {result.error}")
                done[result.request_id] = len(result.generated_tokens)
        elapsed = time.perf_counter() - t0
    for i, r in enumerate(requests):
        if done[f"bench-{i}"] != r.output_len:
            raise RuntimeError(f"transformers continuous batching generated "
                               f"{done[f'bench-{i}']} tokens for a request of {r.output_len}")
    return elapsed


def run_continuous_batching(model: torch.nn.Module, requests: list[BenchRequest],
                            max_num_seqs: int, max_batch_tokens: int,
                            sampling: Sampling = Sampling()) -> BaselineRun:
    _cb_session(model, [BenchRequest(requests[0].prompt_token_ids[:16], 2)] * 2,
                max_num_seqs, max_batch_tokens, sampling)
    elapsed = _cb_session(model, requests, max_num_seqs, max_batch_tokens, sampling)
    return BaselineRun("hf_cb", elapsed, sum(len(r.prompt_token_ids) for r in requests),
                       sum(r.output_len for r in requests),
                       {"max_requests_per_batch": max_num_seqs,
                        "max_batch_tokens": max_batch_tokens})
