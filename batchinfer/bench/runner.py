"""One `batchinfer bench` invocation: build the workload, run our engine (and optionally
the same with prefix caching off, and transformers), print and return the summary."""
from __future__ import annotations

import dataclasses
import gc
import os
import platform
import statistics

import click
import torch

from batchinfer.bench import hf_baseline, report
from batchinfer.bench.engine_run import run_workload, warm_up
from batchinfer.bench.models import ModelSource, resolve_model
from batchinfer.bench.overhead import measure_overhead
from batchinfer.bench.roofline import ModelShape, device_peak, weight_bytes_read_per_step
from batchinfer.bench.workloads import (WORKLOADS, BenchRequest, Sampling, file_requests,
                                        prefix_repetition_requests, random_requests,
                                        workload_stats)
from batchinfer import flags
from batchinfer.engine.host_memory import release_freed_memory


def _engine_kwargs(opts: dict, enable_prefix_caching: bool) -> dict:
    """EngineConfig keywords from the engine flags; the weights' format is the model
    source's (models.resolve_model)."""
    kwargs = flags.engine_values(opts)
    del kwargs["load_format"]
    return {**kwargs, "seed": opts["seed"], "enable_prefix_caching": enable_prefix_caching}


def build_requests(opts: dict, vocab_size: int, tokenize) -> tuple[str, list[BenchRequest]]:
    """(workload name, requests) from the dataset flags or a --workload preset."""
    if opts["workload"] is not None:
        w = WORKLOADS[opts["workload"]]
        return opts["workload"], random_requests(
            opts["num_prompts"], w.input_len, w.output_len, vocab_size, prefix_len=w.prefix_len,
            random_range_ratio=w.random_range_ratio, output_range_ratio=0.0, seed=opts["seed"])
    name = opts["dataset_name"]
    if name == "file":
        if opts["dataset_path"] is None:
            raise ValueError("--dataset-name file needs --dataset-path")
        return name, file_requests(opts["dataset_path"], opts["num_prompts"], opts["output_len"],
                                   tokenize)
    if opts["dataset_path"] is not None:
        raise ValueError(f"--dataset-path is only read with --dataset-name file, not {name}")
    if name == "prefix_repetition":
        return name, prefix_repetition_requests(
            opts["num_prompts"], opts["prefix_repetition_prefix_len"],
            opts["prefix_repetition_suffix_len"], opts["prefix_repetition_num_prefixes"],
            opts["prefix_repetition_output_len"], vocab_size, seed=opts["seed"])
    return name, random_requests(opts["num_prompts"], opts["input_len"], opts["output_len"],
                                 vocab_size, prefix_len=opts["prefix_len"],
                                 random_range_ratio=opts["random_range_ratio"], seed=opts["seed"])


def _sampling(opts: dict) -> Sampling:
    return Sampling(opts["temperature"], opts["top_p"], max(opts["top_k"], 0), opts["min_p"],
                    opts["logprobs"], opts["prompt_logprobs"])


def _check_fits(requests: list[BenchRequest], max_model_len: int, kv_tokens: int) -> None:
    """kv_tokens: what the KV cache holds; the engine caps max_model_len at it."""
    longest = max(len(r.prompt_token_ids) + r.output_len for r in requests)
    if longest > max_model_len:
        fix = ("give the KV cache more room (--num-kv-blocks, --kv-cache-memory, "
               "--gpu-memory-utilization)" if max_model_len >= kv_tokens
               else "raise --max-model-len")
        raise ValueError(f"the longest request needs {longest} tokens (prompt + output) but "
                         f"max_model_len is {max_model_len}; lower --input-len/--output-len "
                         f"or {fix}")


def _run_ours(source: ModelSource, opts: dict, enable_prefix_caching: bool,
              requests: list[BenchRequest] | None = None) -> tuple[dict, dict]:
    """(summary, facts about the engine and workload) for one engine run, on the given
    requests or on those the flags describe; the engine is freed after."""
    from batchinfer.engine.engine import LLMEngine
    engine = LLMEngine.from_kwargs(model=source.path, load_format=source.load_format,
                                   **_engine_kwargs(opts, enable_prefix_caching))
    try:
        workload_name = None
        if requests is None:
            # text prompts are tokenised as the engine tokenises a text prompt
            workload_name, requests = build_requests(opts, engine.model_config.vocab_size,
                                                     engine.tokenizer.encode)
        runner = engine.model_runner
        _check_fits(requests, engine.max_model_len, runner.num_blocks * runner.block_size)
        model = engine.model_runner.model
        param = next(model.parameters())
        shape = ModelShape.from_config(engine.model_config)
        tied = engine.model_config.tie_word_embeddings
        facts = {"requests": requests, "workload": workload_name, "dtype": param.dtype,
                 "device": param.device, "shape": shape,
                 "max_model_len": engine.max_model_len}
        warm_up(engine, shape.vocab_size, opts["seed"])
        run = run_workload(engine, requests, _sampling(opts))
        num_blocks = engine.stats().get("num_total_blocks")
        # bandwidth and MFU of the whole group: the shape's KV bytes and FLOPs are the
        # whole model's, this rank's weights about one slice of them (pipeline stages
        # hold about equal shares of the layers)
        ranks = engine.config.tensor_parallel_size * engine.config.pipeline_parallel_size
        summary = report.engine_summary(
            run, block_size=opts["block_size"], num_kv_blocks=num_blocks, shape=shape,
            weight_bytes=weight_bytes_read_per_step(model, shape, tied).across(ranks),
            dtype=param.dtype, peak=device_peak(param.device, param.dtype, ranks),
            kv_cache_dtype=runner.kv_dtype)
        summary["prefix_caching"] = enable_prefix_caching
        summary["weight_bytes"] = engine.stats()["weight_bytes"]  # one rank's
    finally:
        engine.shutdown()
        runner = model = param = None  # nothing may hold the engine's memory past here
        del engine
        _release_memory()
    return summary, facts


def _release_memory() -> None:
    """Free what a finished run held, down to the OS: engines keep freed host memory in
    the heap (page faults cost as much as the copies), so without this whichever system
    ran second would reuse the pages the first one paid to fault in."""
    gc.collect()
    release_freed_memory()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return (f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores, "
                            f"{_cpu_isa()})")
    except OSError:
        pass
    return platform.processor() or "cpu"


def _cpu_isa() -> str:
    """The CPU's vector ISA, and the kernels' -march where it is not the CPU's own."""
    from batchinfer.kernels.cpu.build import target_arch, vector_isa
    arch = target_arch()
    return vector_isa() + ("" if arch == "native" else f"; kernels built for {arch}")


def run_bench(opts: dict) -> dict:
    """The throughput benchmark; prints the human-readable lines, returns the summary."""
    if opts["compare_prefix_caching"] and not opts["enable_prefix_caching"]:
        raise ValueError("--compare-prefix-caching runs caching on and off; "
                         "drop --no-enable-prefix-caching")
    if opts["baseline"] == "hf" and (opts["logprobs"] is not None
                                     or opts["prompt_logprobs"] is not None):
        raise ValueError("the transformers baseline keeps no logprobs; drop --logprobs / "
                         "--prompt-logprobs or --baseline hf")
    source = resolve_model(opts["model"], need_weights=opts["baseline"] == "hf",
                           cache_dir=opts["cache_dir"], load_format=opts["load_format"])
    summary, facts = _run_ours(source, opts, opts["enable_prefix_caching"])
    requests = facts["requests"]
    if opts["compare_prefix_caching"]:
        off, _ = _run_ours(source, opts, False, requests)
        summary["prefix_caching_off"] = off
        summary["prefix_caching_speedup"] = off["elapsed_time"] / summary["elapsed_time"]
        summary["prefill_tokens_saved_fraction"] = (
            1 - summary["prefill_tokens_computed"] / off["prefill_tokens_computed"])

    model = None
    if opts["baseline"] == "hf":
        model = hf_baseline.load_hf_model(source, facts["dtype"], facts["device"], opts["seed"],
                                          trust_remote_code=opts["trust_remote_code"])
        runs = [hf_baseline.run_static(model, requests, opts["hf_batch_sizes"],
                                       _sampling(opts))]
        _release_memory()
        cb_error = None
        if hf_baseline.continuous_batching_available(model):
            try:
                runs.append(hf_baseline.run_continuous_batching(
                    model, requests, opts["max_num_seqs"], opts["max_num_batched_tokens"],
                    _sampling(opts)))
            except Exception as e:  # transformers' CB API moves between versions
                cb_error = f"{type(e).__name__}: {e}"
                click.echo(f"transformers continuous batching failed, left out: {cb_error}",
                           err=True)
            _release_memory()
        summary["baselines"] = {r.name: report.baseline_summary(r, len(requests)) for r in runs}
        if cb_error is not None:
            summary["baselines"]["hf_cb"] = {"error": cb_error}
        summary["baseline_weights"] = "identical" if source.has_weights else "seeded random"
        summary["ratios"] = {r.name: r.elapsed_s / summary["elapsed_time"] for r in runs}
        if "prefix_caching_off" in summary:
            off = summary["prefix_caching_off"]
            off["ratios"] = {r.name: r.elapsed_s / off["elapsed_time"] for r in runs}
    if opts.get("num_runs", 1) > 1:
        summary = _repeat_runs(summary, source, opts, requests, model)
    if model is not None:
        del model
        _release_memory()

    summary.update({
        "model": opts["model"], "model_path": source.path, "load_format": source.load_format,
        "dtype": str(facts["dtype"]).removeprefix("torch."), "device": str(facts["device"]),
        "device_name": _device_name(facts["device"]),
        "torch_threads": torch.get_num_threads(),
        "workload": {"name": facts["workload"], **workload_stats(requests)},
        "sampling": dataclasses.asdict(_sampling(opts)),
        "engine": {**_engine_kwargs(opts, opts["enable_prefix_caching"]),
                   "max_model_len": facts["max_model_len"]},
    })
    for line in report.summary_lines(summary):
        click.echo(line)
    return summary


def _repeat_runs(first: dict, source: ModelSource, opts: dict, requests: list[BenchRequest],
                 model) -> dict:
    """--num-runs: more runs of our engine on the same requests, each followed by
    transformers' static batching at the batch size the first run found fastest (the model
    stays loaded), so drift on the machine reaches both alike. The summary becomes our
    median run's (by elapsed time) and the static baseline's median; runs lists every
    run's output tokens/s, and the static ratio is the median of the per-run ratios."""
    ours = [first]
    static = first.get("baselines", {}).get("hf_static")
    static_s = [static["elapsed_time"]] if static else []
    for _ in range(opts["num_runs"] - 1):
        ours.append(_run_ours(source, opts, opts["enable_prefix_caching"], requests)[0])
        if static:
            again = hf_baseline.run_static(model, requests, [static["batch_size"]],
                                           _sampling(opts))
            _release_memory()
            static_s.append(again.elapsed_s)
    median = sorted(ours, key=lambda s: s["elapsed_time"])[len(ours) // 2]
    summary = {**first, **{k: v for k, v in median.items() if k in first}}
    summary["runs"] = {"ours_output_tokens_per_second": [s["output_tokens_per_second"]
                                                         for s in ours]}
    if static:
        per_run = [b / s["elapsed_time"] for s, b in zip(ours, static_s)]
        summary["runs"]["hf_static_output_tokens_per_second"] = [
            static["output_tokens"] / b for b in static_s]
        summary["runs"]["hf_static_ratios"] = per_run
        summary["baselines"]["hf_static"] = {
            **static, **report.throughput_fields(static["num_requests"], static["prompt_tokens"],
                                                 static["output_tokens"],
                                                 statistics.median(static_s))}
        summary["ratios"] = {**summary["ratios"], "hf_static": statistics.median(per_run)}
        if "hf_cb" in summary["ratios"]:  # one CB run: against the median run of ours
            cb = summary["baselines"]["hf_cb"]["elapsed_time"]
            summary["ratios"]["hf_cb"] = cb / summary["elapsed_time"]
    if "prefix_caching_speedup" in summary:  # caching off ran once: against our median run
        summary["prefix_caching_speedup"] = (summary["prefix_caching_off"]["elapsed_time"]
                                             / summary["elapsed_time"])
    return summary


def run_overhead(opts: dict) -> dict:
    """--model-stub: per-step engine time at each --num-seqs."""
    if opts["tensor_parallel_size"] > 1 or opts["pipeline_parallel_size"] > 1:
        raise ValueError("--model-stub measures the engine in one process; "
                         "drop --tensor-parallel-size / --pipeline-parallel-size")
    if opts["baseline"] != "none" or opts["compare_prefix_caching"] or opts["num_runs"] > 1:
        raise ValueError("--model-stub measures the engine's own overhead, with no model to "
                         "compare; drop --baseline / --compare-prefix-caching / --num-runs")
    # The stub never reads the KV cache, so one layer is enough; hidden size and vocabulary
    # (logits and sampler work) stay those of the shape.
    if os.path.isdir(opts["model"]):
        source = resolve_model(opts["model"])
    else:
        source = resolve_model(opts["model"], cache_dir=opts["cache_dir"], num_hidden_layers=1)
    results = []
    for n in opts["num_seqs"]:
        result = measure_overhead(
            source.path, n, opts["context_len"], opts["stub_steps"],
            block_size=opts["block_size"], dtype=opts["dtype"], seed=opts["seed"],
            attention_backend=opts["attention_backend"],
            enable_prefix_caching=opts["enable_prefix_caching"], device=opts["device"],
            sampling=_sampling(opts), async_scheduling=opts["async_scheduling"])
        click.echo(result.line())
        results.append(vars(result))
    return {"mode": "model-stub", "model": opts["model"], "model_path": source.path,
            "torch_threads": torch.get_num_threads(),
            "sampling": dataclasses.asdict(_sampling(opts)), "overhead": results}

