"""MXFP4 expert weights (gpt-oss's published checkpoints), dequantized at load.

A projection is stored as `*_blocks` (uint8 [experts, rows, groups, 16]: 32 FP4 E2M1
codes per group, two a byte, the even element in the low nibble) and `*_scales` (uint8
[experts, rows, groups]: an E8M0 exponent per group, biased by 127); a value is the code's
E2M1 number times 2 ** (scale - 127). Rows are the projection's output features, so the
dequantized [experts, rows, columns] is transposed to the float checkpoint's layout
(products from the right: gate_up_proj [E, hidden, 2n], down_proj [E, n, hidden]).
"""
from __future__ import annotations

import torch

# the E2M1 number of each 4-bit code: sign in bit 3, then the magnitude's 8 steps
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32  # values sharing one scale


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[E, rows, groups, 16] codes and [E, rows, groups] exponents -> [E, columns, rows]
    (columns = groups * 32) in dtype."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and "
                         f"{scales.dtype}")
    if blocks.dim() != 4 or blocks.shape[-1] != GROUP // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} "
                         f"do not match ([E, rows, groups, {GROUP // 2}] and [E, rows, groups])")
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    e, rows, groups, _ = blocks.shape
    out = torch.empty(e, groups * GROUP, rows, dtype=dtype, device=blocks.device)
    for expert in range(e):  # one expert's float32 temporaries at a time
        codes = blocks[expert]
        values = torch.stack([table[(codes & 0x0F).long()], table[(codes >> 4).long()]],
                             dim=-1).flatten(-2)  # [rows, groups, 32], elements in order
        values = torch.ldexp(values, (scales[expert].to(torch.int32) - 127)[..., None])
        out[expert] = values.flatten(-2).t()
    return out


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse for a float [E, columns, rows] tensor (the float checkpoint's layout):
    (blocks, scales) with each group of 32 values along columns scaled by the power of two
    that brings its largest magnitude to at most 6, then rounded to the nearest E2M1 value
    (ties to the smaller magnitude)."""
    w = weight.float().transpose(1, 2)  # [E, rows, columns]
    e, rows, columns = w.shape
    if columns % GROUP:
        raise ValueError(f"{columns} columns are not a multiple of {GROUP}")
    groups = w.reshape(e, rows, columns // GROUP, GROUP)
    amax = groups.abs().amax(dim=-1)
    exponents = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)),
                            torch.zeros_like(amax)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponents)[..., None]
    magnitudes = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32)
    nearest = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1)
    codes = (nearest + 8 * (scaled < 0)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponents + 127).to(torch.uint8)
