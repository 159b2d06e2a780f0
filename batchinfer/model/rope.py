"""Rotary position embeddings: the cos/sin table is computed once, looked up per token."""
from __future__ import annotations

import math

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn", "freq_factors")


def attention_scaling(params: dict) -> float:
    """The factor LongRoPE and YaRN multiply cos and sin by (1 for the other types)."""
    if params["rope_type"] not in ("longrope", "yarn"):
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = params["factor"]
    if params["rope_type"] == "yarn":
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
        return yarn_mscale(factor)
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(params["original_max_position_embeddings"]))


def rotary_dim(params: dict, head_dim: int) -> int:
    """How many leading dimensions of each head the rotation covers (partial_rotary_factor)."""
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    if dim % 2 or not 0 < dim <= head_dim:
        raise ValueError(f"partial_rotary_factor {params['partial_rotary_factor']} gives "
                         f"{dim} rotated dimensions of head_dim {head_dim}; need an even number")
    return dim


def partial_rotary_order(rotary: int, head_dim: int) -> list[int] | None:
    """For a rotation over the first `rotary` dimensions only: the order of a head's
    dimensions that puts each rotated pair (i, i + rotary/2) at (j, j + head_dim/2), where
    the full-width rotation pairs them, with the unrotated dimensions filling the rest (their
    table entries are cos 1, sin 0, which leave them exactly as they are). q and k are
    stored in this order; their dot products are the same sums. None when all rotate."""
    if rotary == head_dim:
        return None
    half, rest = rotary // 2, head_dim - rotary
    first = list(range(half)) + list(range(rotary, rotary + rest // 2))
    second = list(range(half, rotary)) + list(range(rotary + rest // 2, head_dim))
    return first + second


def _rotated_inv_freq(params: dict, head_dim: int) -> torch.Tensor:
    base = params["rope_theta"]
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    kind = params["rope_type"]
    if kind == "longrope":
        # the short-context factors: positions stay below original_max_position_embeddings
        short = torch.tensor(params["short_factor"], dtype=torch.float32)
        if short.numel() != head_dim // 2:
            raise ValueError(f"rope short_factor has {short.numel()} entries; {head_dim} "
                             f"rotated dimensions need {head_dim // 2}")
        return 1.0 / (short * base ** exponents)
    if kind == "yarn":
        return _yarn_inv_freq(params, head_dim, base ** exponents)
    if kind == "freq_factors":
        # a GGUF file's rope_freqs: each frequency divided by its factor (how llama.cpp
        # stores Llama 3.1's rope scaling)
        factors = torch.tensor(params["freq_factors"], dtype=torch.float32)
        if factors.numel() != head_dim // 2:
            raise ValueError(f"rope_freqs has {factors.numel()} entries; {head_dim} rotated "
                             f"dimensions need {head_dim // 2}")
        return 1.0 / (factors * base ** exponents)
    inv_freq = 1.0 / (base ** exponents)
    if kind == "linear":
        inv_freq = inv_freq / params["factor"]
    elif kind == "llama3":
        factor = params["factor"]
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor, eq. 21 of the paper: 0.1 * mscale * ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(params: dict, dim: int, pos_freqs: torch.Tensor) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the original context
    are interpolated (divided by factor), those turning more than beta_fast times kept,
    with a linear ramp over the dimensions between; as transformers computes it."""
    base, factor = params["rope_theta"], params["factor"]
    old_len = params["original_max_position_embeddings"]
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dimension turning this many times
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


class RotaryEmbedding(nn.Module):
    """Neox-style rotation (rotate halves), as the Llama family uses. With a partial
    rotation the table is laid out for partial_rotary_order's dimensions: the unrotated
    ones get cos 1 and sin 0."""

    def __init__(self, head_dim: int, max_position: int, params: dict, dtype: torch.dtype):
        super().__init__()
        rotary = rotary_dim(params, head_dim)
        inv_freq = _rotated_inv_freq(params, rotary)
        positions = torch.arange(max_position, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        scaling = attention_scaling(params)
        if scaling != 1.0:
            cos, sin = cos * scaling, sin * scaling
        if rotary < head_dim:
            kept = (head_dim - rotary) // 2
            cos = torch.cat((cos, torch.ones(max_position, kept)), dim=-1)
            sin = torch.cat((sin, torch.zeros(max_position, kept)), dim=-1)
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1).to(dtype), persistent=False)
        self.register_buffer("sin", torch.cat((sin, sin), dim=-1).to(dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for a batch's positions ([T, 1, D]), once per forward pass."""
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] (may be a strided view) by the looked-up cos/sin; returns a
    new contiguous tensor. Same arithmetic as transformers' x * cos + rotate_half(x) * sin,
    so the same bits."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    if x.dtype != torch.float32:
        # reduced precision: strided half-width ops are slow on CPU, the full-width form is not
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin
    # float32: half-width products written straight into the output's halves
    c, s = cos[..., :half], sin[..., :half]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.mul(x1, c, out=out[..., :half]).sub_(x2 * s)
    torch.mul(x2, c, out=out[..., half:]).add_(x1 * s)
    return out
