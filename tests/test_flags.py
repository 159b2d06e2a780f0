"""One definition of each engine and sampling flag, shared by `run` and `bench`."""
from __future__ import annotations

import dataclasses

import click
import pytest

from batchinfer import flags
from batchinfer.bench.cli import bench
from batchinfer.config import EngineConfig
from batchinfer.job.cli import run
from batchinfer.sampling_params import SamplingParams

# LLM(...) keywords with no flag of this name: the model is the command's own option; the
# engine seed is bench's --seed (run's --seed is each request's, SamplingParams.seed)
NOT_ENGINE_FLAGS = {"model", "seed"}
# SamplingParams fields a row sets (OpenAI lines) or the engine fills, not a flag
NOT_SAMPLING_FLAGS = {"logit_bias", "allowed_token_ids", "structured_outputs",
                      "choice_token_ids", "compiled_grammar", "reasoning_end_token_id"}


def params(command: click.Command) -> dict[str, click.Parameter]:
    return {p.name: p for p in command.params}


@pytest.mark.parametrize("command", [run, bench], ids=["run", "bench"])
def test_every_engine_keyword_has_its_flag(command):
    fields = {f.name for f in dataclasses.fields(EngineConfig)} - NOT_ENGINE_FLAGS
    node_flags = {f.name for f in flags.NODE_FLAGS}  # run's alone: one engine over nodes
    by_field = {f.field or f.name: f for f in flags.ENGINE_FLAGS}
    assert set(by_field) == fields - node_flags
    if command is run:
        by_field.update((f.name, f) for f in flags.NODE_FLAGS)
    given = params(command)
    for field, flag in by_field.items():
        assert flag.name in given, (command.name, field)
        assert flag.decls[0].split("/")[0] in given[flag.name].opts, (command.name, field)


def test_run_has_every_sampling_flag():
    fields = {f.name for f in dataclasses.fields(SamplingParams)} - NOT_SAMPLING_FLAGS
    assert set(flags.SAMPLING_NAMES) == fields
    assert fields <= set(params(run))


@pytest.mark.parametrize("command", [run, bench], ids=["run", "bench"])
def test_flags_parse_the_same_in_both_commands(command):
    def parsed(*args: str) -> dict:
        ctx = command.make_context(command.name, list(args), resilient_parsing=True)
        return ctx.params

    assert parsed("--kv-cache-memory", "4GB")["kv_cache_memory"] == 4 * 10**9
    assert parsed("--kv-cache-memory-bytes", "4GiB")["kv_cache_memory"] == 4 * 2**30
    assert parsed("--no-enable-prefix-caching")["enable_prefix_caching"] is False
    assert parsed("--no-prefix-caching")["enable_prefix_caching"] is False  # the old spelling
    assert parsed("--enable-prefix-caching")["enable_prefix_caching"] is True
    assert parsed("--max-num-seqs", "7")["max_num_seqs"] == 7
    assert parsed("--temperature", "0.5")["temperature"] == 0.5
    with pytest.raises(click.BadParameter, match="4GiB"):
        flags.Size().convert("4XB", None, None)


def test_engine_values_name_their_fields():
    values = {"kv_cache_memory": 5, "enable_prefix_caching": False, "dtype": None}
    assert flags.engine_kwargs(values) == {"kv_cache_memory_bytes": 5,
                                           "enable_prefix_caching": False}
    assert flags.engine_flags_in("kv_cache_memory_bytes must be > 0") == \
        "--kv-cache-memory must be > 0"


def test_choices_are_the_engines():
    from batchinfer.config import DTYPES
    assert flags.DTYPE_NAMES == ("auto", *DTYPES)
    for flag in flags.ENGINE_FLAGS:
        if isinstance(flag.type, click.Choice):
            assert tuple(flag.type.choices) in (flags.DTYPE_NAMES, flags.ATTENTION_BACKENDS,
                                                flags.LOAD_FORMATS, flags.QUANTIZATION_METHODS,
                                                flags.KV_CACHE_DTYPES)


def test_a_flag_already_named_is_not_renamed():
    assert flags.engine_flags_in("--tokenizer /x: not found") == "--tokenizer /x: not found"
    assert flags.engine_flags_in("tokenizer /x: not found") == "--tokenizer /x: not found"
