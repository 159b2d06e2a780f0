"""`batchinfer run ... --dry-run`: the job's size and an estimate of its time, from the
rows' prompts rendered and tokenized as the job would, and a few calibration steps of the
engine on this machine. Nothing is written: OUTDIR is read (to refuse what a run would
refuse), never created.
"""
from __future__ import annotations

import heapq
import math
import sys
import time
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from batchinfer.job.errors import JobError
from batchinfer.job.manifest import OutputDir
from batchinfer.job.options import JobOptions
from batchinfer.job.ordering import ReorderWindow
from batchinfer.job.prompts import WorkItem
from batchinfer.job.rangeset import RangeSet
from batchinfer.job.reader import Source
from batchinfer.job.runner import (Engine, EngineFactory, JobResult, check_with_engine,
                                   make_builder, open_job, plan_job, start_engine)

CALIBRATION_SEQS = 16      # most requests in the calibration batch
CALIBRATION_TOKENS = 8     # tokens each of them decodes
CALIBRATION_POOL = 1024    # prompts kept to choose the calibration's from


class PrefixCache:
    """The engine's prefix cache, simulated: chained hashes of full blocks, a prompt's last
    token always computed (kv_cache_manager.get_computed_blocks), `capacity` blocks kept,
    the least recently used dropped first."""

    def __init__(self, block_size: int, capacity: int):
        self.block_size = block_size
        self.capacity = max(capacity, 1)
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def add(self, tokens: list[int]) -> int:
        """Compute a prompt: the tokens it takes from the cache."""
        bs = self.block_size
        hashes, parent = [], None
        for i in range(len(tokens) // bs):
            parent = hash((parent, tuple(tokens[i * bs:(i + 1) * bs])))
            hashes.append(parent)
        reusable = (len(tokens) - 1) // bs
        hits = 0
        while hits < reusable and hashes[hits] in self.blocks:
            hits += 1
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
        return hits * bs


def percentile(values: Sequence[int], q: float) -> int:
    """The nearest-rank percentile (q in (0, 100]); 0 of no values."""
    if not values:
        return 0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


class Figures:
    """The job's figures, counted row by row in the order the job runs them, in memory
    that does not grow with the rows but for 4 bytes each (the prompt lengths)."""

    def __init__(self, block_size: int, max_model_len: int, cache: PrefixCache | None,
                 max_num_seqs: int):
        self.block_size, self.max_model_len = block_size, max_model_len
        self.cache, self.max_num_seqs = cache, max_num_seqs
        self.rows = self.failed = self.cached_tokens = self.output_budget = 0
        self.longest_row_tokens = 0
        self.prompt_tokens = array("i")
        self.largest_rows: list[int] = []  # a heap: the KV blocks of the max_num_seqs largest
        self.budget_bounded = True  # every row has a max_tokens (else the context's room)
        self.pool: list[list[int]] = []  # prompts to calibrate with

    def add(self, item: WorkItem) -> None:
        self.rows += 1
        if item.error is not None or len(item.prompt) >= self.max_model_len:
            self.failed += 1  # a prompt filling the context fails in a run
            return
        tokens = item.prompt.tolist()
        length, params, bs = len(tokens), item.params, self.block_size
        self.prompt_tokens.append(length)
        if self.cache is not None:
            self.cached_tokens += self.cache.add(tokens)
        room = self.max_model_len - length
        if params.max_tokens is None:
            self.budget_bounded = False
        output = room if params.max_tokens is None else min(params.max_tokens, room)
        self.output_budget += output * params.n
        self.longest_row_tokens = max(self.longest_row_tokens, length + output)
        whole = math.ceil((length + output) / bs)
        blocks = whole + (params.n - 1) * (whole - length // bs)  # samples share full blocks
        if len(self.largest_rows) < self.max_num_seqs:
            heapq.heappush(self.largest_rows, blocks)
        else:
            heapq.heappushpop(self.largest_rows, blocks)
        if len(self.pool) < CALIBRATION_POOL:
            self.pool.append(tokens)


def dry_run(options: JobOptions, engine_factory: EngineFactory | None = None,
            out: TextIO | None = None) -> JobResult:
    """Check the job as a run does (JobError for the same mistakes), then print its
    figures. Returns them as the result's summary."""
    out = out or sys.stdout
    options.validate()
    if (options.nnodes or 1) > 1:
        raise JobError(f"--dry-run runs one engine on this machine; leave out --nnodes "
                       f"{options.nnodes}")
    source, engine_factory = open_job(options, engine_factory)
    outdir = OutputDir(options.output_dir())
    plan = plan_job(options, source, outdir)  # reads OUTDIR: a refused job exits 2 here
    engine = start_engine(options, engine_factory)
    try:
        check_with_engine(options, engine)
        stats = engine.stats()
        cache = None
        if options.enable_prefix_caching is not False:
            cache = PrefixCache(stats["block_size"], stats["num_total_blocks"])
        figures = Figures(stats["block_size"], stats["max_model_len"], cache,
                          engine.config.max_num_seqs)
        for item in _items_in_job_order(options, source, plan, engine):
            figures.add(item)
        timing = _calibrate(engine, options, figures.pool)
        block_bytes = getattr(getattr(engine, "model_runner", None), "block_bytes", None)
    finally:
        engine.shutdown()
    summary = _summary(figures, stats, timing, block_bytes)
    _print(summary, options, out)
    return JobResult(0, summary, outdir.path)


def _items_in_job_order(options: JobOptions, source: Source, plan: Any,
                        engine: Engine) -> Iterator[WorkItem]:
    """The WorkItems of the rows still to do, in the order the job hands them to the engine
    (the reorder window refilled as the engine takes about 2 x max_num_seqs at a time);
    failed rows as they are read."""
    builder = make_builder(options, plan, engine)
    limit = options.limit
    if options.dry_run_rows is not None:
        limit = options.dry_run_rows if limit is None else min(limit, options.dry_run_rows)
    done = RangeSet(tuple(r) for r in plan.manifest.done)
    batches = source.batches(plan.input_schema, plan.json_columns, done, limit, options.shard())
    window: ReorderWindow[WorkItem] = ReorderWindow(options.reorder_window)
    take = max(1, 2 * engine.config.max_num_seqs)
    exhausted = False
    while True:
        while not exhausted and window.has_room():
            batch = next(batches, None)
            if batch is None:
                exhausted = True
                break
            for item in builder.build_batch(batch):
                if item.error is None:
                    window.push(item.sort_key, item)
                else:
                    yield item
        if not len(window):
            return
        for _ in range(min(take, len(window))):
            yield window.pop()


@dataclass
class Timing:
    seqs: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float


def _calibrate(engine: Engine, options: JobOptions, pool: list[list[int]]) -> Timing | None:
    """Prefill and decode rates from a few steps of the loaded engine: up to
    CALIBRATION_SEQS of the job's prompts (spread over their lengths), each decoding
    CALIBRATION_TOKENS tokens, after one warm-up request."""
    room = engine.stats()["max_model_len"] - CALIBRATION_TOKENS
    good = sorted((p for p in pool if len(p) < room), key=len)
    if not good:
        return None
    seqs = min(CALIBRATION_SEQS, engine.config.max_num_seqs, len(good))
    prompts = [good[i * len(good) // seqs] for i in range(seqs)]
    params = options.sampling_params().clone(
        max_tokens=CALIBRATION_TOKENS, min_tokens=0, ignore_eos=True, n=1, stop=[],
        stop_token_ids=[], structured_outputs=None, logprobs=None, prompt_logprobs=None)
    _steps(engine, {"warm-up": prompts[0][-8:]}, params.clone(max_tokens=2))
    steps = _steps(engine, {f"calibrate-{i}": p for i, p in enumerate(prompts)}, params)
    prefill = [(dt, p) for dt, p, _ in steps if p > 0]
    decode = [(dt, g) for dt, p, g in steps if p == 0 and g > 0]
    if not prefill or not decode:
        return None
    return Timing(seqs, sum(p for _, p in prefill) / sum(dt for dt, _ in prefill),
                  sum(g for _, g in decode) / sum(dt for dt, _ in decode))


def _steps(engine: Engine, prompts: dict[str, list[int]],
           params: Any) -> list[tuple[float, int, int]]:
    """Run the requests to the end: per step, its seconds, prompt tokens computed and
    tokens generated."""
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    pending, steps = set(prompts), []
    before = engine.stats()
    while pending:
        start = time.perf_counter()
        for output in engine.step():
            pending.discard(output.request_id)
        seconds = time.perf_counter() - start
        after = engine.stats()
        steps.append((seconds,
                      after["num_prompt_tokens_computed"] - before["num_prompt_tokens_computed"],
                      after["num_generated_tokens"] - before["num_generated_tokens"]))
        before = after
    return steps


def _summary(figures: Figures, stats: dict[str, Any], timing: Timing | None,
             block_bytes: int | None) -> dict[str, Any]:
    tokens = figures.prompt_tokens
    total = sum(tokens)
    block_size = stats["block_size"]
    longest = figures.largest_rows
    summary: dict[str, Any] = {
        "rows": figures.rows,
        "failed": figures.failed,
        "prompt_tokens": {"total": total, "p50": percentile(tokens, 50),
                          "p99": percentile(tokens, 99)},
        "prefix_cache_hit_tokens": figures.cached_tokens,
        "prefix_cache_reuse": figures.cached_tokens / total if total else 0.0,
        "output_budget": figures.output_budget,
        "output_budget_bounded": figures.budget_bounded,
        "kv": {"block_size": block_size,
               "longest_row_tokens": figures.longest_row_tokens,
               "longest_row_blocks": max(longest, default=0),
               "rows_at_once": len(longest),  # max_num_seqs of them
               "rows_at_once_blocks": sum(longest),
               "cache_blocks": stats["num_total_blocks"],
               "block_bytes": block_bytes},
        "estimate": None,
    }
    if timing is not None:
        prefill_s = (total - figures.cached_tokens) / timing.prefill_tokens_per_s
        decode_s = figures.output_budget / timing.decode_tokens_per_s
        summary["estimate"] = {"wall_s": prefill_s + decode_s, "prefill_s": prefill_s,
                               "decode_s": decode_s, "calibration_seqs": timing.seqs,
                               "prefill_tokens_per_s": timing.prefill_tokens_per_s,
                               "decode_tokens_per_s": timing.decode_tokens_per_s}
    return summary


def _mib(blocks: int, block_bytes: int | None) -> str:
    return "" if block_bytes is None else f" ({blocks * block_bytes / 2 ** 20:,.1f} MiB)"


def _print(summary: dict[str, Any], options: JobOptions, out: TextIO) -> None:
    tokens, kv, estimate = summary["prompt_tokens"], summary["kv"], summary["estimate"]
    rows = summary["rows"] - summary["failed"]
    max_tokens = options.max_tokens
    budget = f"{summary['output_budget']:,} tokens"
    if options.sampling_columns is None and max_tokens is not None:
        budget += f" (max_tokens {max_tokens} x n {options.n or 1} x {rows} rows)"
    if not summary["output_budget_bounded"]:
        budget += " at most (rows with no max_tokens: the room left in the context)"
    bb = kv["block_bytes"]
    lines = [
        f"batchinfer: dry run of {summary['rows']} rows ({summary['failed']} failed) on "
        f"{options.model}; nothing written",
        f"  prompt tokens          total {tokens['total']:,}, p50 {tokens['p50']:,}, "
        f"p99 {tokens['p99']:,}",
        f"  prefix cache reuse     {100 * summary['prefix_cache_reuse']:.1f}% of prompt "
        f"tokens ({summary['prefix_cache_hit_tokens']:,}; block size {kv['block_size']}, in "
        "the job's order)",
        f"  output budget          {budget}",
        f"  KV memory              longest row {kv['longest_row_tokens']:,} tokens = "
        f"{kv['longest_row_blocks']:,} blocks{_mib(kv['longest_row_blocks'], bb)}",
        f"                         the {kv['rows_at_once']:,} longest rows at once "
        f"{kv['rows_at_once_blocks']:,} blocks{_mib(kv['rows_at_once_blocks'], bb)} of the "
        f"cache's {kv['cache_blocks']:,}{_mib(kv['cache_blocks'], bb)}",
    ]
    if estimate is None:
        lines.append("  estimated time         - (no prompt to calibrate with)")
    else:
        lines.append(
            f"  estimated time         {_seconds(estimate['wall_s'])} s (prefill "
            f"{estimate['prefill_tokens_per_s']:,.0f} tok/s, decode "
            f"{estimate['decode_tokens_per_s']:,.0f} tok/s at {estimate['calibration_seqs']} "
            "sequences, measured on this machine)")
    print("\n".join(lines), file=out)


def _seconds(s: float) -> str:
    """A time in seconds to three significant digits (a small job's is under one)."""
    return f"{s:,.0f}" if s >= 100 else f"{s:.3g}" if s >= 0.001 else f"{s:.6f}"
