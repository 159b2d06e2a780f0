"""Linear layers on CPU with their weights packed once for oneDNN.

torch runs a bfloat16 or float16 product on CPU through oneDNN, which reorders the weight
into its blocked layout on every call. Packing each weight once after loading (what
torch.compile's CPU weight freezing does) skips that reorder: at decode batch sizes the
products of the bench's shapes run 1.2-2x faster on an AMX host, with the same bits.

A probe at load time decides per dtype. bfloat16 and float16 are packed where the packed
product gives exactly F.linear's result on this machine. float32 goes to MKL in F.linear,
whose result for a row can change with the number of rows in the product; it is packed
where oneDNN's product does not (each row's result is the same whatever rows it is
computed with, so a request's products do not depend on what shares its batch). oneDNN
adds in another order than MKL (results differ by about one part in a million); on an
AMD Zen 4 host its products of the bench's shapes run 1.25-1.75x faster.
BATCHINFER_CPU_PACKED_LINEAR=0 turns packing off, for torch's own bits.
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
    """Whether packed products of this dtype run here and pass the probe: bit for bit
    F.linear's for bfloat16 and float16; for float32, each row the same whatever rows it
    is computed with, and within rounding of F.linear."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        if dtype == torch.float32:
            return _rows_independent(gen)
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


def _rows_independent(gen: torch.Generator) -> bool:
    """The float32 probe: a packed product's rows equal the same rows computed in products
    of other row counts (1 to 1100: decode and prefill sizes, odd and even), and F.linear's
    within rounding."""
    for k, n in ((256, 688), (688, 256), (128, 1000)):
        weight = torch.randn(n, k, generator=gen)
        bias = torch.randn(n, generator=gen)
        x = torch.randn(1100, k, generator=gen)
        packed = pack(weight, 64)
        full = linear(x, packed, bias)
        if not torch.allclose(full, F.linear(x, weight, bias), rtol=1e-4, atol=1e-4):
            log.info("packed CPU products of float32 disagree with F.linear here; not used")
            return False
        for start, rows in ((0, 1), (0, 7), (5, 16), (3, 64), (37, 255), (70, 1024)):
            if not torch.equal(linear(x[start:start + rows], packed, bias),
                               full[start:start + rows]):
                log.info("packed CPU products of float32 depend on the row count here; "
                         "not used")
                return False
    return True


def packed_bytes(model: torch.nn.Module) -> int:
    """Bytes of the packed weights in model (they are not among its parameters)."""
    def tensors(value):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, tuple):
            for item in value:
                yield from tensors(item)

    return sum(t.numel() * t.element_size() for module in model.modules()
               for attr in ("packed", "packed_halves", "packed_experts")
               for t in tensors(getattr(module, attr, None)))


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
