"""A checkpoint's FP8 KV-cache scales, under the names the quantizers write them:

    model.layers.N.self_attn.k_scale, .v_scale        compressed-tensors (kv_cache_scheme)
    model.layers.N.self_attn.attn.k_scale, .v_scale   vLLM's own
    model.layers.N.self_attn.k_proj.k_scale,          ModelOpt
    model.layers.N.self_attn.v_proj.v_scale
    model.layers.N.self_attn.k_proj.output_scale,     older AutoFP8
    model.layers.N.self_attn.v_proj.output_scale
    model.layers.N.self_attn.kv_scale                 one scale for both

Each is a float32 scalar per layer; the cache stores k / k_scale and v / v_scale
(kernels/fp8.py). With an FP8 cache they go to the layers' attention; otherwise they are
passed over, as is a query scale (q_scale) written beside them, which only FP8 attention
products would use. Every tensor-parallel rank loads the same scalars.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

SCALE_NAME = re.compile(r"(?P<attention>.+\.self_attn)\."
                        r"(?P<which>k_scale|v_scale|kv_scale|q_scale|k_proj\.output_scale"
                        r"|v_proj\.output_scale|attn\.k_scale|attn\.v_scale|attn\.q_scale"
                        r"|k_proj\.k_scale|v_proj\.v_scale|q_proj\.q_scale)")
# which of the layer's scales each name sets
_SETS = {"k_scale": ("k_scale",), "k_proj.output_scale": ("k_scale",),
         "attn.k_scale": ("k_scale",), "k_proj.k_scale": ("k_scale",),
         "v_scale": ("v_scale",), "v_proj.output_scale": ("v_scale",),
         "attn.v_scale": ("v_scale",), "v_proj.v_scale": ("v_scale",),
         "kv_scale": ("k_scale", "v_scale"), "q_scale": (), "attn.q_scale": (),
         "q_proj.q_scale": ()}


def take_kv_scales(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                   fp8_cache: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors but its KV-cache scales, which are set on their attention
    layers (k_scale, v_scale) when fp8_cache, else dropped. ValueError naming the tensor
    for a scale that is not one finite number > 0, or whose layer the model lacks."""
    for name, tensor in weights:
        match = SCALE_NAME.fullmatch(name)
        if match is None:
            yield name, tensor
            continue
        stage_name = getattr(model, "stage_name", None)  # (CausalLM's, by pipeline stage)
        if not fp8_cache or (stage_name is not None and stage_name(name) is None):
            continue
        value = _scalar(name, tensor)
        try:
            attention = model.get_submodule(match["attention"])
        except AttributeError:
            raise ValueError(f"checkpoint tensor {name!r} has no place in the model") from None
        for field in _SETS[match["which"]]:
            setattr(attention, field, value)


def _scalar(name: str, tensor) -> float:
    """tensor: a torch.Tensor or a checkpoint's CheckpointTensor (read here)."""
    if not isinstance(tensor, torch.Tensor):
        tensor = tensor.read()
    if tensor.numel() != 1:
        raise ValueError(f"checkpoint tensor {name!r}: a KV-cache scale must be one number, "
                         f"got shape {list(tensor.shape)}")
    value = float(tensor.float().reshape(()))
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"checkpoint tensor {name!r}: a KV-cache scale must be a finite "
                         f"number > 0, got {value}")
    return value
