"""Linear layers on CPU with their weights packed once for oneDNN.

torch runs a bfloat16 or float16 product on CPU through oneDNN, which reorders the weight
into its blocked layout on every call. Packing each weight once after loading (what
torch.compile's CPU weight freezing does) skips that reorder: at decode batch sizes the
products of the bench's shapes run 1.2-2x faster on an AMX host, with the same bits.

Packing is used only for dtypes where a probe at load time gives exactly F.linear's result
on this machine; float32 keeps torch's own path (oneDNN's float32 product rounds
differently, and is no faster). BATCHINFER_CPU_PACKED_LINEAR=0 turns packing off.
"""
from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

ENV_SWITCH = "BATCHINFER_CPU_PACKED_LINEAR"


def pack(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    """weight [out, in] in oneDNN's layout for products with about batch_hint rows (an
    opaque tensor: it can only be passed to linear())."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) with the weight as pack() returned it."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def apply(x: torch.Tensor, weight: torch.Tensor | None, packed: torch.Tensor | None,
          bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b through the packed weight when a layer has one, else F.linear."""
    if packed is not None:
        return linear(x, packed, bias)
    return F.linear(x, weight, bias)


@functools.cache
def available(dtype: torch.dtype) -> bool:
    """Whether packed products of this dtype run here and equal F.linear bit for bit."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if dtype == torch.float32 or not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(96, 80, generator=gen).to(dtype)
        bias = torch.randn(96, generator=gen).to(dtype)
        for rows in (1, 37):
            x = torch.randn(rows, 80, generator=gen).to(dtype)
            if not torch.equal(linear(x, pack(weight, 16), bias), F.linear(x, weight, bias)):
                log.info("packed CPU products of %s differ from F.linear here; not used", dtype)
                return False
        return True
    except (RuntimeError, AttributeError) as e:  # op missing or dtype unsupported by oneDNN
        log.info("packed CPU products of %s unavailable (%s)", dtype, e)
        return False


def packed_bytes(model: torch.nn.Module) -> int:
    """Bytes of the packed weights in model (they are not among its parameters)."""
    total = 0
    for module in model.modules():
        for attr in ("packed", "packed_halves"):
            value = getattr(module, attr, None)
            for t in value if isinstance(value, tuple) else (value,):
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
    return total


def pack_model(model: torch.nn.Module, dtype: torch.dtype, batch_hint: int) -> int:
    """Pack the weights of every module that can take them (pack_weights(batch_hint));
    returns how many modules did. The modules keep only the packed copy."""
    if not available(dtype):
        return 0
    packed = 0
    for module in model.modules():
        if hasattr(module, "pack_weights"):
            module.pack_weights(batch_hint)
            packed += 1
    return packed
