"""The job's stats, computed from its Parquet parts (so resumed runs count too).

Aggregates stream through an Acero plan (sums, counts and t-digest quantiles), so memory
stays flat whatever the number of rows.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TextIO

import pyarrow as pa
import pyarrow.acero as acero
import pyarrow.compute as pc
import pyarrow.dataset as ds

LATENCIES = ("queue_s", "ttft_s", "tpot_s", "e2e_s")
QUANTILES = (0.5, 0.9, 0.99)


def _aggregate(paths: list[Path]) -> dict[str, Any]:
    dataset = ds.dataset([str(p) for p in paths], format="parquet")
    first = pc.field("sample_index") == 0
    failed = pc.field("finish_reason") == "error"
    zero = pa.scalar(0, pa.int64())
    exprs = {
        "first": pc.if_else(first, 1, 0).cast(pa.int64()),
        "failed": pc.if_else(failed, 1, 0).cast(pa.int64()),
        "length": pc.if_else(pc.field("finish_reason") == "length", 1, 0).cast(pa.int64()),
        # a failed row's prompt (its length is reported) was never computed
        "prompt_tokens": pc.if_else(first & ~failed, pc.field("prompt_tokens"), zero),
        "cached_tokens": pc.if_else(first, pc.field("cached_tokens"), zero),
        "output_tokens": pc.field("output_tokens"),
        "preemptions": pc.field("preemptions"),
        **{name: pc.field(name).cast(pa.float64()) for name in LATENCIES},
    }
    columns = ["sample_index", "finish_reason", "prompt_tokens", "cached_tokens",
               "output_tokens", "preemptions", *LATENCIES]
    counted = ["first", "failed", "length", "prompt_tokens", "cached_tokens", "output_tokens",
               "preemptions"]
    if "attempts" in dataset.schema.names:  # (parts written before the column have none)
        columns += ["attempts", "error"]
        exprs["retried"] = pc.if_else(pc.field("attempts") > 1, 1, 0).cast(pa.int64())
        # a completion kept with an error: still invalid after its last attempt
        exprs["invalid"] = pc.if_else(~failed & pc.is_valid(pc.field("error")), 1,
                                      0).cast(pa.int64())
        counted += ["retried", "invalid"]
    aggregates = [(n, "sum", pc.ScalarAggregateOptions(min_count=0), n) for n in counted]
    aggregates.append(("output_tokens", "count", pc.CountOptions(mode="all"), "samples"))
    aggregates += [(n, "tdigest", pc.TDigestOptions(q=list(QUANTILES), delta=1000), n + "_q")
                   for n in LATENCIES]
    plan = acero.Declaration.from_sequence([
        acero.Declaration("scan", acero.ScanNodeOptions(dataset, columns=columns)),
        acero.Declaration("project", acero.ProjectNodeOptions(list(exprs.values()),
                                                               list(exprs))),
        acero.Declaration("aggregate", acero.AggregateNodeOptions(aggregates)),
    ])
    result = plan.to_table(use_threads=False).to_pydict()
    # A t-digest gives one value per quantile; the sums and counts one value each.
    return {k: (v if k.endswith("_q") else v[0]) for k, v in result.items()}


def compute_summary(paths: list[Path], wall_s: float) -> dict[str, Any]:
    """Stats over every row in `paths`; `wall_s` is the time spent across all runs."""
    agg = _aggregate(paths) if paths else {}
    rows = agg.get("first") or 0
    prompt, cached = agg.get("prompt_tokens") or 0, agg.get("cached_tokens") or 0
    output = agg.get("output_tokens") or 0
    per_s = (lambda x: round(x / wall_s, 3)) if wall_s > 0 else (lambda x: None)
    summary: dict[str, Any] = {
        "rows": rows,
        "samples": agg.get("samples") or 0,
        "errors": agg.get("failed") or 0,
        "finished_by_length": agg.get("length") or 0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "output_tokens": output,
        "wall_s": round(wall_s, 3),
        "rows_per_s": per_s(rows),
        "output_tokens_per_s": per_s(output),
        "total_tokens_per_s": per_s(prompt + output),
        "prefix_cache_hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "preemptions": agg.get("preemptions") or 0,
        "retried": agg.get("retried") or 0,
        "invalid": agg.get("invalid") or 0,
    }
    for name in LATENCIES:
        values = agg.get(name + "_q") or [None] * len(QUANTILES)
        for q, v in zip(QUANTILES, values):
            summary[f"{name}_p{round(q * 100)}"] = None if v is None else round(v, 6)
    return summary


def write_summary(path: Path, summary: dict[str, Any]) -> None:
    from batchinfer.job.durable import atomic_write_bytes
    atomic_write_bytes(path, (json.dumps(summary, indent=2) + "\n").encode())


def print_table(summary: dict[str, Any], stream: TextIO) -> None:
    """The summary as an aligned two-column table (latencies as one row per metric)."""
    def fmt(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.4g}" if abs(v) < 1000 else f"{v:,.0f}"
        if isinstance(v, int) and not isinstance(v, bool):
            return f"{v:,}"
        return str(v)

    lines = []
    for key, value in summary.items():
        if any(key.startswith(n + "_p") for n in LATENCIES) or isinstance(value, (dict, list)):
            continue  # the sampling and the warnings are the JSON's (warnings go to stderr)
        lines.append((key, fmt(value)))
    for name in LATENCIES:
        qs = " / ".join(fmt(summary.get(f"{name}_p{round(q * 100)}")) for q in QUANTILES)
        lines.append((f"{name} p50/p90/p99", qs))
    width = max(len(k) for k, _ in lines)
    for key, value in lines:
        print(f"  {key:<{width}}  {value}", file=stream)
