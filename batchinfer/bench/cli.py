"""`batchinfer bench`: offline throughput (flags as in `vllm bench throughput`), with a
transformers baseline (--baseline hf), prefix caching on vs off (--compare-prefix-caching),
engine overhead with the model stubbed out (--model-stub), `bench kernels` and
`bench structured`."""
from __future__ import annotations

import json
from pathlib import Path

import click

from batchinfer import flags
from batchinfer.bench.workloads import DATASET_NAMES, WORKLOADS

def _parse_int_list(ctx, param, value: str) -> list[int]:
    try:
        items = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        items = []
    if not items or any(i < 1 for i in items):
        raise click.BadParameter(f"expected comma-separated positive integers, got {value!r}")
    return items


def _positive(ctx, param, value):
    if value is not None and value < 1:
        raise click.BadParameter(f"must be >= 1, got {value}")
    return value


class _BenchGroup(click.Group):
    """`bench` runs the throughput benchmark itself; `bench kernels` is the attention-kernel
    benchmark (batchinfer.bench.kernels) and `bench structured` the cost of structured-output
    constraints (batchinfer.bench.structured), each imported only when asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return ["kernels", "structured"]

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name == "structured":
            from batchinfer.bench.structured import main as structured_main
            return structured_main
        if name != "kernels":
            return None
        try:
            from batchinfer.bench.kernels import main as kernels_main
        except ImportError as e:
            error = str(e)

            @click.command("kernels", help="GPU attention-kernel benchmarks (unavailable).")
            def unavailable() -> None:
                raise click.ClickException(f"the kernel benchmarks are not available: {error}")
            return unavailable
        return kernels_main


# the engine as `vllm bench throughput` runs it: greedy, prefix caching on
ENGINE_DEFAULTS = {"dtype": "auto", "block_size": 16, "max_num_seqs": 256,
                   "max_num_batched_tokens": 8192, "enable_prefix_caching": True,
                   "gpu_memory_utilization": 0.9, "tensor_parallel_size": 1,
                   "pipeline_parallel_size": 1,
                   "attention_backend": "auto", "enforce_eager": False, "async_scheduling": False,
                   "load_format": "auto",
                   "quantization": None,
                   "kv_cache_dtype": "auto", "generation_config": "auto",
                   "trust_remote_code": False, "allow_pickle_weights": False}
BENCH_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "logprobs", "prompt_logprobs")
SAMPLING_DEFAULTS = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}

# what a --workload preset sets (the prefix-repetition dataset's own flags included)
DATASET_FLAGS = ("dataset_name", "dataset_path", "input_len", "output_len", "random_range_ratio",
                 "prefix_len", "prefix_repetition_prefix_len", "prefix_repetition_suffix_len",
                 "prefix_repetition_num_prefixes", "prefix_repetition_output_len")


@click.group(cls=_BenchGroup, invoke_without_command=True,
             context_settings={"show_default": True, "help_option_names": ["-h", "--help"]})
@click.option("--model", default="tiny",
              help="Checkpoint directory, or a named random-weight shape (tiny, smollm2-135m, "
                   "llama3-8b, llama3-70b, ...).")
@click.option("--workload", type=click.Choice(sorted(WORKLOADS)), default=None,
              help="A preset that sets the dataset flags: shared-prefix = 256-token shared "
                   "prefix + 32-160 unique tokens, 64 output tokens; no-shared-prefix = the "
                   "same lengths without a shared prefix.")
@click.option("--dataset-name", type=click.Choice(DATASET_NAMES), default="random")
@click.option("--dataset-path", type=click.Path(dir_okay=False), default=None,
              help="JSONL for --dataset-name file: \"prompt\" or \"prompt_token_ids\", "
                   "optional \"output_len\" per line.")
@click.option("--num-prompts", type=int, default=1000, callback=_positive)
@click.option("--input-len", type=int, default=1024, callback=_positive)
@click.option("--output-len", type=int, default=128, callback=_positive)
@click.option("--random-range-ratio", type=click.FloatRange(0, 1, max_open=True), default=0.0,
              help="Input and output lengths are uniform in len * [1 - r, 1 + r].")
@click.option("--prefix-len", type=click.IntRange(min=0), default=0,
              help="Random dataset: ids shared by every prompt, before its random part.")
@click.option("--prefix-repetition-prefix-len", type=int, default=256, callback=_positive)
@click.option("--prefix-repetition-suffix-len", type=int, default=256, callback=_positive)
@click.option("--prefix-repetition-num-prefixes", type=int, default=10, callback=_positive)
@click.option("--prefix-repetition-output-len", type=int, default=128, callback=_positive)
@flags.options(flags.ENGINE_NAMES, ENGINE_DEFAULTS)
@click.option("--compare-prefix-caching", is_flag=True,
              help="Also run with prefix caching off and report the speedup.")
@click.option("--seed", type=int, default=0,
              help="Seed of the prompts drawn and of the engine's sampling.")
@flags.options(BENCH_SAMPLING, SAMPLING_DEFAULTS)
@click.option("--baseline", type=click.Choice(["none", "hf"]), default="none",
              help="hf: the same prompts through transformers (static batching and, where "
                   "the installed version has it, continuous batching).")
@click.option("--hf-batch-sizes", default="8,32,64,128,256", callback=_parse_int_list,
              help="Static-batching batch sizes to try (capped at the prompt count); the "
                   "fastest is reported.")
@click.option("--num-runs", type=int, default=1, callback=_positive,
              help="Run our engine (and transformers' static batching at its best batch "
                   "size) this many times, alternating, and report the median run and the "
                   "median of the per-run ratios: single runs on shared machines move.")
@click.option("--model-stub", is_flag=True,
              help="Engine-overhead mode: the model's forward is a no-op; reports ms per "
                   "decode step at each of --num-seqs, split into host time and the device "
                   "stand-in (the stub's forward and the sampler, a GPU's work).")
@click.option("--num-seqs", default="64,256,1024", callback=_parse_int_list,
              help="--model-stub: running sequences to measure at.")
@click.option("--context-len", type=int, default=1024, callback=_positive,
              help="--model-stub: context length of every sequence.")
@click.option("--stub-steps", type=int, default=64, callback=_positive,
              help="--model-stub: decode steps measured per size.")
@click.option("--num-threads", type=int, default=None, callback=_positive,
              help="torch intra-op threads for every system measured [default: torch's; "
                   "1 with --model-stub, where CPU time is then the engine's own work].")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where named shapes are built [default: $BATCHINFER_CACHE_DIR/bench or "
                   "~/.cache/batchinfer/bench].")
@click.option("--output-json", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.pass_context
def bench(ctx: click.Context, **opts) -> None:
    """Offline throughput benchmark: random token-id prompts, greedy (or --temperature),
    ignore_eos, fixed output lengths; prints vLLM's Throughput line and a JSON summary."""
    if ctx.invoked_subcommand is not None:
        return
    from batchinfer.bench.runner import run_bench, run_overhead
    if opts["workload"] is not None:
        given = [f"--{name.replace('_', '-')}" for name in DATASET_FLAGS
                 if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE]
        if given:
            raise click.UsageError(f"--workload {opts['workload']} sets the dataset flags "
                                   f"itself; drop {', '.join(given)} (or --workload)")
    if opts["num_threads"] is None and opts["model_stub"]:
        # The engine's bookkeeping runs on one thread. With more, an OpenMP worker left
        # spinning after the sampler's parallel argmax adds its waiting to the CPU time.
        opts["num_threads"] = 1
    import torch
    threads = torch.get_num_threads()
    if opts["num_threads"] is not None:
        torch.set_num_threads(opts["num_threads"])
    try:
        summary = run_overhead(opts) if opts["model_stub"] else run_bench(opts)
    except (ValueError, FileNotFoundError) as e:
        raise click.UsageError(flags.engine_flags_in(str(e))) from None
    finally:  # a caller's process (or a test's) keeps its own setting
        torch.set_num_threads(threads)
    click.echo(json.dumps(summary, indent=2))
    if opts["output_json"] is not None:
        opts["output_json"].parent.mkdir(parents=True, exist_ok=True)
        opts["output_json"].write_text(json.dumps(summary, indent=2) + "\n")
