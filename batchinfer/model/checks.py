"""A model's files are input too: their values are checked before any tensor is allocated.

    check_config(config, "models/x/config.json")   # sizes, divisibility, rope, quantization
    check_shapes(tensors, model_config, where)      # the weights' shapes against the config
    check_memory(model_config, ...)                 # weights + rotary tables + KV cache asked
    checked_scales(weights)                         # FP8 scales finite and > 0, as they load

Each failure is a ValueError of one line naming the file or tensor, the field, its value
and what it must be. docs/models.md lists them.
"""
from __future__ import annotations

import math
import os
import re
import resource
from collections.abc import Iterable, Iterator
from numbers import Integral, Real
from typing import Any

import torch

from batchinfer.model.weights import CheckpointTensor

# sizes every config has (transformers fills in a default where the file has none)
SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
         "num_attention_heads", "max_position_embeddings")
# sizes a config may leave out
OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "moe_intermediate_size",
                  "num_experts_per_tok", "original_max_position_embeddings")
# lists of module names that stay unquantized, by quant_method's spelling
_IGNORE_LISTS = ("ignore", "modules_to_not_convert", "ignored_layers")


def check_config(config: Any, where: str, complete: bool = True) -> None:
    """Refuse a config (a transformers config, or config.json's dict as read) whose sizes,
    norm epsilon, rope parameters or quantization_config no model could have. `complete`:
    the sizes must all be there (False for the raw file, where transformers fills in
    defaults)."""
    get = (config.get if isinstance(config, dict)
           else lambda name, default=None: getattr(config, name, default))
    for name in SIZES + OPTIONAL_SIZES:
        value = get(name)
        if value is None:
            if complete and name in SIZES:
                raise ValueError(f"{where}: {name} is missing; it must be an integer >= 1")
            continue
        _positive_int(where, name, value)
    heads, kv_heads = get("num_attention_heads"), get("num_key_value_heads")
    if heads is not None and kv_heads is not None and heads % kv_heads:
        raise ValueError(f"{where}: num_attention_heads {heads} must be a multiple of "
                         f"num_key_value_heads {kv_heads}")
    hidden, head_dim = get("hidden_size"), get("head_dim")
    if head_dim is None and heads is not None and hidden is not None and hidden % heads:
        raise ValueError(f"{where}: hidden_size {hidden} must be a multiple of "
                         f"num_attention_heads {heads} (or head_dim must be set)")
    if head_dim is not None and head_dim % 2:
        raise ValueError(f"{where}: head_dim is {head_dim}; it must be even (rotary "
                         "embeddings rotate pairs of dimensions)")
    experts = get("num_local_experts") or get("num_experts")
    top_k = get("num_experts_per_tok")
    if experts and top_k is not None and top_k > experts:
        raise ValueError(f"{where}: num_experts_per_tok is {top_k}; it must be at most the "
                         f"number of experts ({experts})")
    for name in ("rms_norm_eps", "layer_norm_eps"):
        if get(name) is not None:
            _positive(where, name, get(name))
    if get("rope_theta") is not None:
        _positive(where, "rope_theta", get("rope_theta"))
    if get("partial_rotary_factor") is not None:
        _fraction(where, "partial_rotary_factor", get("partial_rotary_factor"))
    for key in ("rope_scaling", "rope_parameters"):
        params = get(key)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise ValueError(f"{where}: {key} is {_show(params)}; it must be an object")
        nested = {k: v for k, v in params.items() if isinstance(v, dict)}
        for layer_type, inner in (nested or {"": params}).items():
            check_rope(inner, where, f"{key}.{layer_type}." if layer_type else f"{key}.")
    quant = get("quantization_config")
    if quant is not None:
        check_quantization_config(quant, where)
    text = get("text_config")
    if isinstance(text, dict):  # a vision-language checkpoint's decoder (config.json as read)
        check_config(text, f"{where} text_config", complete=False)


def check_rope(params: dict, where: str, prefix: str = "") -> None:
    """Rope parameters in range: rope_theta, factor and the frequency factors positive
    and finite, llama3's two frequency factors distinct, the original context a size."""
    for name in ("rope_theta", "factor", "low_freq_factor", "high_freq_factor", "beta_fast",
                 "beta_slow", "attention_factor"):
        if params.get(name) is not None:
            _positive(where, prefix + name, params[name])
    if params.get("original_max_position_embeddings") is not None:
        _positive_int(where, prefix + "original_max_position_embeddings",
                      params["original_max_position_embeddings"])
    if params.get("partial_rotary_factor") is not None:
        _fraction(where, prefix + "partial_rotary_factor", params["partial_rotary_factor"])
    low, high = params.get("low_freq_factor"), params.get("high_freq_factor")
    if low is not None and high is not None and low == high:
        raise ValueError(f"{where}: {prefix}high_freq_factor is {high!r}, the same as "
                         "low_freq_factor; llama3 rope scaling needs them to differ")
    for name in ("short_factor", "long_factor", "freq_factors"):
        values = params.get(name)
        if values is None:
            continue
        if not isinstance(values, (list, tuple)):
            raise ValueError(f"{where}: {prefix}{name} is {_show(values)}; it must be a "
                             "list of numbers")
        for i, value in enumerate(values):
            _positive(where, f"{prefix}{name}[{i}]", value)


def check_quantization_config(quant: Any, where: str) -> None:
    """quantization_config an object whose lists of unquantized modules are strings, their
    "re:" patterns regular expressions that compile."""
    if hasattr(quant, "to_dict"):
        quant = quant.to_dict()
    if not isinstance(quant, dict):
        raise ValueError(f"{where}: quantization_config is {_show(quant)}; it must be an "
                         "object with a quant_method")
    for key in _IGNORE_LISTS:
        entries = quant.get(key)
        if entries is None:
            continue
        if not isinstance(entries, (list, tuple)) or not all(isinstance(e, str) for e in entries):
            raise ValueError(f"{where}: quantization_config.{key} is {_show(entries)}; it must "
                             "be a list of module names")
        for entry in entries:
            if entry.startswith("re:"):
                try:
                    re.compile(entry[3:])
                except re.error as e:
                    raise ValueError(f"{where}: quantization_config.{key} entry {entry!r} is "
                                     f"not a valid regular expression ({e})") from None


def _show(value: Any) -> str:
    text = repr(value)
    kind = {str: "a string", list: "a list", dict: "an object", bool: "a boolean"}.get(type(value))
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{kind} {text}" if kind else text


def _positive_int(where: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
        raise ValueError(f"{where}: {name} is {_show(value)}; it must be an integer >= 1")


def _positive(where: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, Real) \
            or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{where}: {name} is {_show(value)}; it must be a finite number > 0")


def _fraction(where: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, Real) or not 0 < value <= 1:
        raise ValueError(f"{where}: {name} is {_show(value)}; it must be a number in (0, 1]")


# ---- the weights against the config ------------------------------------------------------

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def expected_shape(config, name: str) -> tuple[int, ...] | None:
    """The shape the config gives one of the checkpoint's unfused, unsharded tensors
    (transformers' names); None for those not checked here (fused, expert, scale tensors,
    layers beyond the config's)."""
    h, d = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    inter = config.intermediate_size
    whole = {"model.embed_tokens.weight": (config.vocab_size, h),
             "lm_head.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    if name in whole:
        return whole[name]
    match = _LAYER.fullmatch(name)
    if match is None or int(match[1]) >= config.num_hidden_layers:
        return None
    layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
             "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
             "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q)}
    if getattr(config, "mla", None) is not None:  # (the latent projections not checked)
        layer = {name: shape for name, shape in layer.items() if "self_attn" not in name}
        layer["self_attn.o_proj.weight"] = (h, config.num_attention_heads * config.mla.v_head_dim)
    if config.qk_norm:
        layer.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
    if not config.layers[int(match[1])].moe:
        layer.update({"mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
                      "mlp.down_proj.weight": (h, inter)})
    return layer.get(match[2])


def check_shapes(tensors: Iterable[tuple[str, tuple[int, ...]]], config, where: str) -> None:
    """Each named tensor's shape (read from the file's header or table, no data) equals the
    one the config implies: ValueError naming the first that does not."""
    for name, shape in tensors:
        expected = expected_shape(config, name)
        if expected is not None and tuple(shape) != expected:
            raise ValueError(f"{where}: tensor {name} has shape {list(shape)}, but the config's "
                             f"sizes (hidden_size {config.hidden_size}, vocab_size "
                             f"{config.vocab_size}, heads {config.num_attention_heads}/"
                             f"{config.num_key_value_heads} of head_dim {config.head_dim}, "
                             f"intermediate_size {config.intermediate_size}) need "
                             f"{list(expected)}")


# ---- memory ------------------------------------------------------------------------------

def weight_bytes(config, dtype_bytes: int) -> int:
    """The bytes the model's parameters take (an estimate from the config: linear layers,
    embeddings, norms, routers; FP8 layers at a byte a weight plus their float32 scales,
    one per weight row and block of columns)."""
    h, v, layers = config.hidden_size, config.vocab_size, config.num_hidden_layers
    num_moe = sum(layer.moe for layer in config.layers)
    attention, attention_float = _attention_params(config)
    linears = layers * attention + (layers - num_moe) * 3 * h * config.intermediate_size
    router = 0
    if config.moe is not None:
        experts = config.moe.num_experts + config.moe.num_shared_experts
        linears += num_moe * experts * 3 * h * config.moe.intermediate_size
        # DeepSeekMoE's router is kept in float32
        router = (num_moe * config.moe.num_experts * h
                  * (4 if config.moe.scoring == "sigmoid" else dtype_bytes))
    if config.quantization is None:
        total = linears * dtype_bytes
    else:
        block = config.quantization.linear.block
        total = linears + 4 * linears // (block[1] if block else h)
    total += router + dtype_bytes * (layers * (4 * h + attention_float)
                                     + v * h * (1 if config.tie_word_embeddings else 2))
    return total


def _attention_params(config) -> tuple[int, int]:
    """One layer's attention weights: (those of its linear layers, those kept in the model's
    dtype even in an FP8 model). The q, k, v and o projections; with multi-head latent
    attention (batchinfer.model.mla) q_a_proj and q_b_proj (or q_proj), kv_a_proj_with_mqa
    and o_proj, and in the model's dtype kv_b_proj (an FP8 checkpoint's is dequantized as
    it loads) and the latent norms."""
    h, heads = config.hidden_size, config.num_attention_heads
    mla = getattr(config, "mla", None)
    if mla is None:
        q, kv = heads * config.head_dim, config.num_key_value_heads * config.head_dim
        return 2 * h * q + 2 * h * kv, 0
    q_out = heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim)
    q_lora = mla.q_lora_rank or 0
    q = h * q_out if not q_lora else h * q_lora + q_lora * q_out
    linears = q + h * (mla.kv_lora_rank + mla.qk_rope_head_dim) + heads * mla.v_head_dim * h
    kv_b = mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
    return linears, kv_b + mla.kv_lora_rank + q_lora


def rotary_bytes(config, max_len: int, dtype_bytes: int) -> int:
    """The rotary tables for max_len positions (cos and sin, each [max_len, head_dim]) and
    the float32 intermediates they are built from."""
    return len(config.rope) * max_len * config.head_dim * (2 * dtype_bytes + 12)


def available_bytes(device: torch.device) -> tuple[int, str]:
    """(bytes the model may take on device, what they are): a GPU's memory; on CPU the
    host's RAM, or what the process's address-space limit leaves when that is less."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return total, f"{device} has {_gib(total)}"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit != resource.RLIM_INFINITY:
        with open("/proc/self/statm") as f:
            used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        if limit - used < total:
            return max(0, limit - used), (f"process's address-space limit (ulimit -v) leaves "
                                          f"{_gib(max(0, limit - used))}")
    return total, f"host has {_gib(total)} of RAM"


def check_memory(config, dtype_bytes: int, max_len: int, kv_bytes: int, ranks: int,
                 device: torch.device) -> None:
    """Refuse, before anything is allocated, a model whose weights, rotary tables and
    KV cache asked for (per rank on a GPU) exceed the device's memory."""
    weights = weight_bytes(config, dtype_bytes)
    if device.type == "cuda":
        weights //= ranks
    rotary = rotary_bytes(config, max_len, dtype_bytes)
    need = weights + rotary + kv_bytes
    available, what = available_bytes(device)
    if need > available:
        raise ValueError(
            f"the model needs about {_gib(need)} ({_gib(weights)} of weights for "
            f"{config.num_hidden_layers} layers of hidden_size {config.hidden_size} and "
            f"vocab_size {config.vocab_size}, {_gib(rotary)} of rotary tables for "
            f"{max_len} positions, {_gib(kv_bytes)} of KV cache) but the {what}; check the "
            "config's sizes, or lower max_model_len or the KV cache")


def _gib(n: int) -> str:
    return f"{n / 2**30:.3g} GiB" if n >= 2**20 else f"{n / 2**10:.3g} KiB"


# ---- scales --------------------------------------------------------------------------------

SCALE_NAMES = ("weight_scale", "weight_scale_inv", "input_scale", "input_scale_ub")


def checked_scales(weights: Iterable[tuple[str, CheckpointTensor]]
                   ) -> Iterator[tuple[str, CheckpointTensor]]:
    """The checkpoint's tensors, its FP8 scales read and checked as they pass: every value
    finite and > 0 (a NaN, infinite, zero or negative scale turns a layer's output into
    noise). ValueError naming the first bad one."""
    for name, tensor in weights:
        if name.rsplit(".", 1)[-1] in SCALE_NAMES:
            values = tensor.read()
            flat = values.float().reshape(-1)
            bad = (~torch.isfinite(flat) | (flat <= 0)).nonzero()
            if len(bad):
                i = int(bad[0])
                raise ValueError(f"checkpoint tensor {name!r}: scales must be finite numbers "
                                 f"> 0, got {float(flat[i])} at index {i} of "
                                 f"{list(values.shape)}; the checkpoint is damaged")
            tensor = CheckpointTensor.in_memory(values)
        yield name, tensor
