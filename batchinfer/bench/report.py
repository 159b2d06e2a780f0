"""Numbers from a run: the summary dict (JSON) and the lines printed for people."""
from __future__ import annotations

import numpy as np
import torch

from batchinfer.bench.engine_run import EngineRun
from batchinfer.bench.hf_baseline import BaselineRun
from batchinfer.bench.roofline import DevicePeak, ModelShape, WeightBytes


def throughput_line(num_requests: int, total_tokens: int, output_tokens: int,
                    elapsed_s: float, label: str = "Throughput") -> str:
    """vLLM's `bench throughput` line."""
    return (f"{label}: {num_requests / elapsed_s:.2f} requests/s, "
            f"{total_tokens / elapsed_s:.2f} total tokens/s, "
            f"{output_tokens / elapsed_s:.2f} output tokens/s")


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def throughput_fields(num_requests: int, prompt_tokens: int, output_tokens: int,
                      elapsed_s: float) -> dict:
    total = prompt_tokens + output_tokens
    return {"num_requests": num_requests, "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens, "total_num_tokens": total,
            "elapsed_time": elapsed_s, "requests_per_second": num_requests / elapsed_s,
            "tokens_per_second": total / elapsed_s,
            "output_tokens_per_second": output_tokens / elapsed_s}


def _peak_slot_utilization(run: EngineRun, block_size: int) -> tuple[float | None, int]:
    """Utilisation at the step holding the most blocks (ties: the later step)."""
    peak = None
    for s in run.steps:
        if s.blocks_in_use and (peak is None or s.blocks_in_use >= peak.blocks_in_use):
            peak = s
    if peak is None:
        return None, 0
    return peak.tokens_held / (peak.blocks_in_use * block_size), peak.blocks_in_use


def _decode_bandwidth(run: EngineRun, shape: ModelShape, weight_bytes: WeightBytes,
                      kv_dtype_bytes: int) -> float | None:
    """Bytes read by pure-decode steps / their time. A step reads the state left by the
    step before it: every running sequence's context plus its new token."""
    total_bytes = total_s = 0.0
    per_token = shape.kv_bytes_per_token(kv_dtype_bytes)
    for prev, step in zip(run.steps, run.steps[1:]):
        if step.prefill_tokens or not prev.num_running:
            continue
        total_bytes += (weight_bytes.read_by(prev.num_running)
                        + per_token * (prev.context_tokens + prev.num_running))
        total_s += step.duration_s
    return total_bytes / total_s if total_s else None


def _prefill_flops_per_s(run: EngineRun, shape: ModelShape) -> float | None:
    """FLOPs of every request's uncached prompt part over the time of steps that ran
    prefill tokens (those steps' decodes count as time, not work: a lower bound)."""
    time_s = sum(s.duration_s for s in run.steps if s.prefill_tokens)
    if not time_s:
        return None
    flops = sum(shape.prefill_flops(n, c) for n, c in zip(run.prompt_lens, run.num_cached_tokens))
    return flops / time_s


def engine_summary(run: EngineRun, *, block_size: int, num_kv_blocks: int | None,
                   shape: ModelShape, weight_bytes: WeightBytes, dtype: torch.dtype,
                   peak: DevicePeak | None, kv_cache_dtype: torch.dtype | None = None) -> dict:
    """kv_cache_dtype: what the KV cache stores (None: dtype)."""
    kv_cache_dtype = kv_cache_dtype or dtype
    summary = throughput_fields(len(run.prompt_lens), run.prompt_tokens, run.output_tokens,
                                run.elapsed_s)
    queried = run.stats_delta.get("prefix_cache_queried_tokens", 0)
    hits = run.stats_delta.get("prefix_cache_hit_tokens", 0)
    computed = run.stats_delta.get("num_prompt_tokens_computed")
    if computed is None:
        computed = sum(n - c for n, c in zip(run.prompt_lens, run.num_cached_tokens))
    utilization, peak_blocks = _peak_slot_utilization(run, block_size)
    summary.update({
        "prefix_cache_hit_rate": hits / queried if queried else 0.0,
        "prefix_cache_hit_tokens": int(hits),
        "cached_prompt_tokens": int(sum(run.num_cached_tokens)),
        "prefill_tokens_computed": int(computed),
        "num_preemptions": int(run.stats_delta.get("num_preemptions", 0)),
        "ttft_p50_s": _percentile(run.ttft_s, 50), "ttft_p99_s": _percentile(run.ttft_s, 99),
        "tpot_p50_s": _percentile(run.tpot_s, 50), "tpot_p99_s": _percentile(run.tpot_s, 99),
        "num_steps": len(run.steps),
        "peak_kv_blocks_in_use": peak_blocks,
        "num_kv_blocks": num_kv_blocks,
        "kv_cache_dtype": str(kv_cache_dtype).removeprefix("torch."),
        "peak_kv_slot_utilization": utilization,
        "decode_bandwidth_gb_per_s": None, "decode_bandwidth_fraction_of_peak": None,
        "prefill_tflops_per_s": None, "prefill_mfu": None,
    })
    if peak is not None:
        bandwidth = _decode_bandwidth(run, shape, weight_bytes,
                                      torch.tensor([], dtype=kv_cache_dtype).element_size())
        flops = _prefill_flops_per_s(run, shape)
        if bandwidth is not None:
            summary["decode_bandwidth_gb_per_s"] = bandwidth / 1e9
            summary["decode_bandwidth_fraction_of_peak"] = bandwidth / peak.bytes_per_s
        if flops is not None:
            summary["prefill_tflops_per_s"] = flops / 1e12
            summary["prefill_mfu"] = flops / peak.flops_per_s
    return summary


def baseline_summary(run: BaselineRun, num_requests: int) -> dict:
    summary = throughput_fields(num_requests, run.prompt_tokens, run.output_tokens, run.elapsed_s)
    summary.update(run.detail)
    return summary


BASELINE_LABELS = {"hf_static": "transformers static batching",
                   "hf_cb": "transformers continuous batching"}


def summary_lines(summary: dict) -> list[str]:
    """The human-readable part of a throughput run's output."""
    lines = [throughput_line(summary["num_requests"], summary["total_num_tokens"],
                             summary["output_tokens"], summary["elapsed_time"]),
             f"Total num prompt tokens:  {summary['prompt_tokens']}",
             f"Total num output tokens:  {summary['output_tokens']}",
             f"Prefix cache hit rate: {summary['prefix_cache_hit_rate']:.1%}, "
             f"prefill tokens computed: {summary['prefill_tokens_computed']}, "
             f"preemptions: {summary['num_preemptions']}"]
    off = summary.get("prefix_caching_off")
    if off is not None:
        lines.append(throughput_line(off["num_requests"], off["total_num_tokens"],
                                     off["output_tokens"], off["elapsed_time"],
                                     "Throughput (prefix caching off)"))
        lines.append(f"Prefix caching on vs off: {summary['prefix_caching_speedup']:.2f}x "
                     f"throughput, {summary['prefill_tokens_saved_fraction']:.1%} fewer prefill "
                     "tokens computed")
    if summary.get("decode_bandwidth_gb_per_s") is not None:
        lines.append(f"Decode bandwidth: {summary['decode_bandwidth_gb_per_s']:.0f} GB/s "
                     f"({summary['decode_bandwidth_fraction_of_peak']:.0%} of peak)")
    if summary.get("prefill_mfu") is not None:
        lines.append(f"Prefill: {summary['prefill_tflops_per_s']:.1f} TFLOP/s "
                     f"(MFU {summary['prefill_mfu']:.1%})")
    for name, base in summary.get("baselines", {}).items():
        label = BASELINE_LABELS.get(name, name)
        if "error" in base:
            lines.append(f"{label}: failed, left out ({base['error']})")
            continue
        if "batch_size" in base:
            label += f", batch {base['batch_size']}"
        lines.append(throughput_line(base["num_requests"], base["total_num_tokens"],
                                     base["output_tokens"], base["elapsed_time"],
                                     f"Throughput ({label})"))
        lines.append(f"Ours vs {BASELINE_LABELS.get(name, name)}: "
                     f"{summary['ratios'][name]:.2f}x")
    runs = summary.get("runs")
    if runs is not None:
        ours = runs["ours_output_tokens_per_second"]
        line = f"Runs ({len(ours)}), output tokens/s: ours {', '.join(f'{x:.1f}' for x in ours)}"
        if "hf_static_ratios" in runs:
            static = ", ".join(f"{x:.1f}" for x in runs["hf_static_output_tokens_per_second"])
            ratios = ", ".join(f"{x:.2f}x" for x in runs["hf_static_ratios"])
            line += (f"; transformers static {static}; ours vs static per run {ratios} "
                     f"(median {summary['ratios']['hf_static']:.2f}x)")
        lines.append(line + "; the throughput lines above are each system's median run")
    return lines
