"""Which linear layers hold FP8 (E4M3) weights, and how their scales are stored.

Read once from config.json's `quantization_config` (pre-quantized checkpoints) or from
`quantization="fp8"` (online: a bfloat16/float16 checkpoint quantized while it loads). Three
on-disk forms are recognised, as the hub ships them:

- `compressed-tensors` (llm-compressor's FP8 and FP8_DYNAMIC schemes, float-quantized):
  `weight` in float8_e4m3fn and `weight_scale` per tensor ([1] or []), per output channel
  ([out, 1]) or per block ([ceil(out / b0), ceil(in / b1)], strategy "block"); `input_scale`
  for static activations; modules in `ignore` stay in the model's dtype.
- `fbgemm_fp8` (Meta's FP8 Llama 3.1): `weight_scale` per output row ([out, 1]), dynamic
  per-token activations bounded by `activation_scale_ub`; `modules_to_not_convert` stay.
- `fp8` with `weight_block_size` (DeepSeek, Qwen3 FP8): `weight_scale_inv` per block
  (a multiplier despite its name), or without a block size `weight_scale` per tensor;
  `ignored_layers` / `modules_to_not_convert` stay.

gpt-oss's `mxfp4` experts are dequantized at load to the model's dtype (batchinfer.model.mxfp4)
and the model runs unquantized. Any other method (AWQ, GPTQ, bitsandbytes, int8
compressed-tensors, ...) is refused by name.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from batchinfer.flags import QUANTIZATION_METHODS

FP8_METHODS = ("compressed-tensors", "fbgemm_fp8", "fp8")  # pre-quantized checkpoints read


@dataclass(frozen=True)
class LinearQuant:
    """How one linear layer's FP8 weight is stored and run."""
    block: tuple[int, int] | None  # (rows, columns) one block scale covers; None: per row
    scale_name: str                # the checkpoint's scale tensor: weight_scale(_inv)
    static_activations: bool       # the checkpoint has an input_scale per layer
    activation_scale_ub: float | None  # fbgemm: upper bound of a dynamic activation scale
    online: bool                   # the checkpoint holds full-precision weights to quantize


@dataclass(frozen=True)
class Fp8Scheme:
    """A model's FP8 linear layers: all but the ignored ones (their checkpoint names)."""
    method: str                    # a FP8_METHODS entry, or "fp8-online"
    linear: LinearQuant
    ignore: tuple[str, ...] = ()   # module names, "re:" patterns, or name suffixes
    targets: tuple[str, ...] = ("Linear",)

    def quantizes(self, module: str) -> bool:
        """Whether the checkpoint's linear `module` (e.g. model.layers.0.mlp.down_proj) is
        FP8 here; lm_head and the embeddings never are."""
        if module.endswith("lm_head") or "embed_tokens" in module:
            return False
        if any(_matches(entry, module) for entry in self.ignore):
            return False
        return any(t == "Linear" or _matches(t, module) for t in self.targets)

    def linear_quant(self, modules: list[str]) -> LinearQuant | None:
        """The LinearQuant of a layer that fuses these checkpoint modules (q, k and v; gate
        and up), or None when it stays in the model's dtype. ValueError when only some of
        them are quantized: they share one weight here."""
        flags = [self.quantizes(m) for m in modules]
        if all(flags):
            return self.linear
        if any(flags):
            raise ValueError(f"the checkpoint quantizes {', '.join(m for m, f in zip(modules, flags) if f)} "
                             f"but not {', '.join(m for m, f in zip(modules, flags) if not f)}, "
                             "which batchinfer runs as one fused layer")
        return None


def _matches(entry: str, module: str) -> bool:
    if entry.startswith("re:"):
        return re.match(entry[3:], module) is not None
    return module == entry or module.endswith("." + entry)


def quantization_scheme(hf_config: Any, text_config: Any, quantization: str | None
                        ) -> Fp8Scheme | None:
    """The FP8 scheme of a checkpoint (its quantization_config) or of quantization="fp8";
    None for a full-precision model run as it is. ValueError, naming what to change, for
    a method or a setting not implemented here."""
    quant = None
    for config in (hf_config, text_config):
        quant = quant or getattr(config, "quantization_config", None)
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}; "
                         f"got {quantization!r}")
    if quant is None:
        if quantization is None:
            return None
        return Fp8Scheme("fp8-online", LinearQuant(None, "weight_scale", False, None, True))
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    method = quant.get("quant_method")
    if method == "mxfp4" and getattr(text_config, "model_type", None) == "gpt_oss":
        if quantization is not None:
            raise ValueError("the checkpoint's experts are MXFP4, dequantized at load; "
                             "drop --quantization / quantization=")
        return None  # the experts are dequantized at load (batchinfer.model.mxfp4)
    if method not in FP8_METHODS:
        raise ValueError(f"the checkpoint is quantized with quantization_config.quant_method "
                         f"{str(method)!r}, which is not supported; supported: FP8 checkpoints "
                         f"({', '.join(FP8_METHODS)}), or use the unquantized (bfloat16 or "
                         "float16) checkpoint")
    if quantization is not None:
        raise ValueError(f"the checkpoint is already quantized (quant_method {method!r}); "
                         "drop --quantization / quantization=")
    if method == "compressed-tensors":
        return _compressed_tensors(quant)
    if method == "fbgemm_fp8":
        ub = quant.get("activation_scale_ub")
        return Fp8Scheme(method, LinearQuant(None, "weight_scale", False,
                                             float(ub) if ub is not None else None, False),
                         ignore=tuple(quant.get("modules_to_not_convert") or ()))
    block = quant.get("weight_block_size")
    if block is not None:
        block = _block(block, "quantization_config.weight_block_size")
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"quantization_config.activation_scheme {scheme!r} is not supported; "
                         "supported: dynamic, static")
    ignore = tuple(quant.get("ignored_layers") or ()) + tuple(quant.get("modules_to_not_convert") or ())
    return Fp8Scheme(method, LinearQuant(block, "weight_scale_inv" if block else "weight_scale",
                                         scheme == "static", None, False), ignore=ignore)


def _block(value: Any, what: str) -> tuple[int, int]:
    if not (isinstance(value, (list, tuple)) and len(value) == 2
            and all(isinstance(v, int) and v > 0 for v in value)):
        raise ValueError(f"{what} must be two positive integers, got {value!r}")
    return int(value[0]), int(value[1])


def _compressed_tensors(quant: dict) -> Fp8Scheme:
    fmt = quant.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported; supported: "
                         "float-quantized (FP8 weights)")
    groups = list((quant.get("config_groups") or {}).values())
    if not groups:
        raise ValueError("the compressed-tensors quantization_config has no config_groups")
    linears, targets = set(), []
    for group in groups:
        weights = group.get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise ValueError(f"compressed-tensors weights of type {weights.get('type')!r} with "
                             f"{weights.get('num_bits')} bits are not supported; supported: "
                             "8-bit float (FP8)")
        strategy = weights.get("strategy")
        if strategy == "block":
            block = _block(weights.get("block_structure"), "weights.block_structure")
        elif strategy in ("tensor", "channel"):
            block = None
        else:
            raise ValueError(f"compressed-tensors weight strategy {strategy!r} is not supported; "
                             "supported: tensor, channel, block")
        acts = group.get("input_activations")
        static = False
        if acts:
            if acts.get("type") != "float" or acts.get("num_bits") != 8:
                raise ValueError("compressed-tensors input activations must be 8-bit float "
                                 f"(FP8), got {acts.get('type')!r} with {acts.get('num_bits')} bits")
            static = not acts.get("dynamic", False)
            if static and acts.get("strategy") != "tensor":
                raise ValueError(f"static input activations by {acts.get('strategy')!r} are not "
                                 "supported; supported: tensor")
        linears.add(LinearQuant(block, "weight_scale", static, None, False))
        targets += [t for t in group.get("targets") or ["Linear"]]
    if len(linears) > 1:
        raise ValueError("compressed-tensors config_groups with different FP8 schemes are not "
                         "supported; all quantized layers must share one")
    return Fp8Scheme("compressed-tensors", linears.pop(), ignore=tuple(quant.get("ignore") or ()),
                     targets=tuple(targets))
