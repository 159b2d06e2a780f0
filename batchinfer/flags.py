"""The engine and sampling flags of `batchinfer run` and `batchinfer bench`: one table of
click options, so both commands spell, parse and explain each flag the same way.

    @engine_options({"max_num_seqs": 256})   # each command passes its own defaults
    def bench(**opts): ...

A flag's option name (its key in `**opts`, and in a job file) is its EngineConfig field or
SamplingParams field, except `kv_cache_memory` (EngineConfig.kv_cache_memory_bytes, which
it takes as a size such as 4GiB).
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click

# the names EngineConfig takes (the dtypes' torch types are config.DTYPES, which a test holds
# to DTYPE_NAMES: config imports torch, which --help need not load)
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
LOAD_FORMATS = ("auto", "dummy")
QUANTIZATION_METHODS = ("fp8",)  # linears quantized at load (a checkpoint's own: read from it)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # fp8 and fp8_e4m3: torch.float8_e4m3fn
_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
               "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
               "tib": 2**40}


def parse_size(text: str | int) -> int:
    """Bytes from "4GiB" (4 x 2^30), "512MB" (512 x 10^6), "1.5g" or a plain integer."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 4GiB, 512MiB, 2GB)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


class Size(click.ParamType):
    name = "SIZE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        try:
            return parse_size(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


@dataclass(frozen=True)
class Flag:
    name: str                     # the option name: EngineConfig / SamplingParams field
    decls: tuple[str, ...]        # click's declarations; the first is the vLLM spelling
    type: Any = None
    help: str | None = None
    multiple: bool = False
    field: str | None = None      # the EngineConfig field, when not `name`

    @property
    def is_bool(self) -> bool:
        return "/" in self.decls[0]

    def option(self, default: Any) -> Callable:
        kwargs: dict[str, Any] = {"help": self.help, "default": default}
        if not self.is_bool:
            kwargs["type"] = self.type
        if self.multiple:
            kwargs["multiple"] = True
        return click.option(*self.decls, self.name, **kwargs)


ENGINE_FLAGS = (
    Flag("dtype", ("--dtype",), click.Choice(DTYPE_NAMES),
         "The checkpoint's (auto), or float32, bfloat16, float16."),
    Flag("block_size", ("--block-size",), int, "Tokens per KV cache block."),
    Flag("max_num_seqs", ("--max-num-seqs",), click.IntRange(min=1),
         "Most sequences in one step."),
    Flag("max_num_batched_tokens", ("--max-num-batched-tokens",), click.IntRange(min=1),
         "Most tokens in one step."),
    Flag("max_model_len", ("--max-model-len",), click.IntRange(min=1),
         "Longest prompt + completion (default: the model's)."),
    Flag("kv_cache_memory", ("--kv-cache-memory", "--kv-cache-memory-bytes"), Size(),
         "KV cache size, e.g. 4GiB (2^30 bytes) or 4GB (10^9).",
         field="kv_cache_memory_bytes"),
    Flag("num_kv_blocks", ("--num-kv-blocks",), click.IntRange(min=1),
         "KV cache size in blocks (overrides sizing)."),
    Flag("kv_cache_dtype", ("--kv-cache-dtype",), click.Choice(KV_CACHE_DTYPES),
         "auto (the model's dtype), or fp8 / fp8_e4m3: E4M3 with per-layer scales, "
         "twice the blocks of bfloat16 in the same memory."),
    Flag("gpu_memory_utilization", ("--gpu-memory-utilization",),
         click.FloatRange(0, 1, min_open=True),
         "CUDA: the fraction of the device's memory the engine may use."),
    Flag("enable_prefix_caching", ("--enable-prefix-caching/--no-enable-prefix-caching",
                                   "--prefix-caching/--no-prefix-caching"),
         help="Share the KV cache of common prompt prefixes."),
    Flag("tensor_parallel_size", ("--tensor-parallel-size",), click.IntRange(min=1),
         "Split each layer over this many GPUs (of one node)."),
    Flag("pipeline_parallel_size", ("--pipeline-parallel-size",), click.IntRange(min=1),
         "Split the decoder layers into this many stages (across nodes)."),
    Flag("attention_backend", ("--attention-backend",), click.Choice(ATTENTION_BACKENDS),
         "auto, torch or triton."),
    Flag("enforce_eager", ("--enforce-eager/--no-enforce-eager",),
         help="CUDA: run decode steps eagerly instead of replaying CUDA graphs."),
    Flag("async_scheduling", ("--async-scheduling/--no-async-scheduling",),
         help="Plan each step while the one before runs, so that the GPU does not wait for "
              "the host (one process: not with tensor or pipeline parallelism)."),
    Flag("device", ("--device",), str, "cpu, cuda, cuda:1 ... (default: cuda when available)."),
    Flag("load_format", ("--load-format",), click.Choice(LOAD_FORMATS),
         "auto (the checkpoint's weights) or dummy (random weights of the model's shapes)."),
    Flag("quantization", ("--quantization", "-q"), click.Choice(QUANTIZATION_METHODS),
         "fp8: quantize a full-precision checkpoint's linear layers to FP8 while loading "
         "(an FP8 checkpoint needs no flag)."),
    Flag("tokenizer", ("--tokenizer",), str, "Tokenizer directory, when not the model's."),
    Flag("generation_config", ("--generation-config",), str,
         "auto: the sampling defaults of the model's generation_config.json apply where no "
         "flag sets them; vllm: ignore it; or a directory holding a generation_config.json."),
    Flag("trust_remote_code", ("--trust-remote-code/--no-trust-remote-code",),
         help="Allow a model's own configuration code."),
    Flag("allow_pickle_weights", ("--allow-pickle-weights/--no-allow-pickle-weights",),
         help="Also load .bin (pickle) checkpoints, with weights_only=True."),
)

SAMPLING_FLAGS = (
    Flag("max_tokens", ("--max-tokens",), int, "Max tokens per completion."),
    Flag("min_tokens", ("--min-tokens",), int,
         "Min tokens before EOS/stop may end a completion."),
    Flag("temperature", ("--temperature",), click.FloatRange(min=0),
         "0 = greedy."),
    Flag("top_p", ("--top-p",), click.FloatRange(0, 1, min_open=True)),
    Flag("top_k", ("--top-k",), click.IntRange(min=-1), "0 or -1: off."),
    Flag("min_p", ("--min-p",), click.FloatRange(0, 1)),
    Flag("seed", ("--seed",), int, "Sampling seed of every request (SamplingParams.seed)."),
    Flag("n", ("--n",), int, "Completions per prompt."),
    Flag("stop", ("--stop",), str, "Stop string (repeatable).", multiple=True),
    Flag("stop_token_ids", ("--stop-token-ids",), int, "Stop token id (repeatable).",
         multiple=True),
    Flag("ignore_eos", ("--ignore-eos/--no-ignore-eos",)),
    Flag("repetition_penalty", ("--repetition-penalty",), float),
    Flag("presence_penalty", ("--presence-penalty",), float),
    Flag("frequency_penalty", ("--frequency-penalty",), float),
    Flag("logprobs", ("--logprobs",), click.IntRange(min=0),
         "Save the top-K logprobs of each token (adds columns)."),
    Flag("prompt_logprobs", ("--prompt-logprobs",), click.IntRange(min=0),
         "Save each prompt token's logprob and the top K there (adds columns)."),
    Flag("truncate_prompt_tokens", ("--truncate-prompt-tokens",), int,
         "Keep only the last K prompt tokens (-1: as many as --max-model-len allows)."),
    Flag("include_stop_str_in_output",
         ("--include-stop-str-in-output/--no-include-stop-str-in-output",)),
    Flag("skip_special_tokens", ("--skip-special-tokens/--no-skip-special-tokens",)),
)

# one engine over several nodes: `run` only (slurm/batchinfer.sbatch fills them in)
NODE_FLAGS = (
    Flag("nnodes", ("--nnodes",), click.IntRange(min=1),
         "Nodes one engine spans (each runs this command; node 0 runs the job)."),
    Flag("node_rank", ("--node-rank",), click.IntRange(min=0), "This node's place, 0..N-1."),
    Flag("master_addr", ("--master-addr",), str, "Node 0's address, where the nodes meet."),
    Flag("master_port", ("--master-port",), click.IntRange(1, 65535),
         "The port on node 0 where the nodes meet."),
    Flag("node_secret_file", ("--node-secret-file",), str,
         "A file only you can read holding the job's secret, the same on every node "
         "(default: $BATCHINFER_NODE_SECRET)."),
)

_BY_NAME = {f.name: f for f in (*ENGINE_FLAGS, *SAMPLING_FLAGS, *NODE_FLAGS)}


def options(names: list[str] | tuple[str, ...],
            defaults: dict[str, Any] | None = None) -> Callable:
    """A decorator adding the named flags, in that order, with the given defaults (None
    for those not given: the engine's or SamplingParams' own)."""
    defaults = defaults or {}
    unknown = set(defaults) - set(names)
    if unknown:
        raise ValueError(f"defaults for flags not added: {sorted(unknown)}")

    def decorate(f: Callable) -> Callable:
        for name in reversed(names):
            f = _BY_NAME[name].option(defaults.get(name))(f)
        return f
    return decorate


def engine_values(values: dict[str, Any]) -> dict[str, Any]:
    """The engine flags' values from option values, by EngineConfig field."""
    return {flag.field or flag.name: values.get(flag.name) for flag in ENGINE_FLAGS}


def engine_kwargs(values: dict[str, Any]) -> dict[str, Any]:
    """EngineConfig keyword arguments from option values (None: left to its default)."""
    return {k: v for k, v in engine_values(values).items() if v is not None}


def engine_flags_in(message: str) -> str:
    """An engine error message with EngineConfig field names replaced by their flags."""
    for f in (*ENGINE_FLAGS, *NODE_FLAGS):
        message = re.sub(rf"(?<![\w-]){f.field or f.name}\b", _long_flag(f), message)
    return message


def _long_flag(f: Flag) -> str:
    return f.decls[0].split("/")[0]


ENGINE_NAMES = tuple(f.name for f in ENGINE_FLAGS)
SAMPLING_NAMES = tuple(f.name for f in SAMPLING_FLAGS)
NODE_NAMES = tuple(f.name for f in NODE_FLAGS)
