"""Drive our engine through a workload and measure it.

Only engine calls are timed (add_request and step); the per-step sampling of KV occupancy
is instrumentation and sits outside the timed spans. One small warm-up request runs first,
and engine counters are reported as differences from just after it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from batchinfer.bench.workloads import BenchRequest, Sampling
from batchinfer.engine.gc_freeze import startup_heap_frozen


@dataclass
class StepSample:
    duration_s: float
    prefill_tokens: int    # prompt tokens computed in this step
    num_running: int       # requests holding KV after the step
    context_tokens: int    # sum of their context lengths (what a decode step reads)
    tokens_held: int       # distinct KV slots holding a token (shared blocks counted once)
    blocks_in_use: int     # distinct blocks held by running requests


@dataclass
class EngineRun:
    elapsed_s: float
    prompt_tokens: int
    output_tokens: int
    ttft_s: list[float]
    tpot_s: list[float]
    num_cached_tokens: list[int]
    prompt_lens: list[int]
    stats_delta: dict[str, float]
    steps: list[StepSample] = field(default_factory=list)


def kv_occupancy(engine) -> tuple[int, int, int, int]:
    """(running requests, sum of their context lengths, distinct slots holding tokens,
    distinct blocks held) right now, read from the scheduler and KV cache manager."""
    scheduler = engine.scheduler
    kv = scheduler.kv
    block_size = kv.block_size
    seen: set[int] = set()
    held = context = 0
    for req in scheduler.running:
        computed = req.num_computed_tokens
        context += computed
        for j, block in enumerate(kv.req_blocks.get(req.request_id, ())):
            if block.block_id in seen:
                continue
            seen.add(block.block_id)
            held += min(block_size, max(computed - j * block_size, 0))
    return len(scheduler.running), context, held, len(seen)


def warm_up(engine, vocab_size: int, seed: int) -> None:
    """One short request through prefill and a few decodes; ids drawn apart from the
    workload's so the prefix cache gains nothing from it."""
    rng = np.random.default_rng(seed + 7919)
    engine.add_request("bench-warmup", rng.integers(0, vocab_size, size=24).tolist(),
                       Sampling().engine_params(4))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.error:
                raise RuntimeError(f"warm-up request failed: {out.error}")


_COUNTERS = ("prefix_cache_queried_tokens", "prefix_cache_hit_tokens", "num_preemptions",
             "num_prompt_tokens_computed")


def run_workload(engine, requests: list[BenchRequest],
                 sampling: Sampling = Sampling()) -> EngineRun:
    """Run every request to completion (greedy unless sampling says otherwise); raise
    ValueError naming the first failed one."""
    before = engine.stats()
    arrival = time.monotonic()
    t0 = time.perf_counter()
    for i, r in enumerate(requests):
        engine.add_request(f"bench-{i}", r.prompt_token_ids, sampling.engine_params(r.output_len),
                           arrival_time=arrival)
    elapsed = time.perf_counter() - t0
    finished = {}
    steps: list[StepSample] = []
    computed = before.get("num_prompt_tokens_computed", 0)
    with startup_heap_frozen():  # as `batchinfer run` and LLM.generate run
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t0
            elapsed += dt
            for out in outs:
                if out.error:
                    raise ValueError(f"request {out.request_id} failed: {out.error}")
                finished[out.request_id] = out
            now = engine.stats().get("num_prompt_tokens_computed", 0)
            steps.append(StepSample(dt, now - computed, *kv_occupancy(engine)))
            computed = now
    after = engine.stats()
    delta = {k: after[k] - before[k] for k in _COUNTERS if k in after and k in before}

    ttft, tpot, cached, prompt_lens = [], [], [], []
    output_tokens = 0
    for i in range(len(requests)):
        out = finished[f"bench-{i}"]
        n_out = len(out.outputs[0].token_ids)
        output_tokens += n_out
        cached.append(out.num_cached_tokens)
        prompt_lens.append(len(out.prompt_token_ids))
        if out.metrics is not None:
            if out.metrics.ttft_s is not None:
                ttft.append(out.metrics.ttft_s)
            t = out.metrics.tpot_s(n_out)
            if t is not None:
                tpot.append(t)
    return EngineRun(elapsed, sum(prompt_lens), output_tokens, ttft, tpot, cached,
                     prompt_lens, delta, steps)
