"""Mixture-of-experts feed-forward as two grouped matrix products (GPU).

The (token, choice) pairs of a batch are sorted by expert and each expert's run is padded
to a multiple of BLOCK_M, so every BLOCK_M-row block of the sorted order belongs to one
expert. One program multiplies one block by one tile of its expert's weights:

1. `_gate_up_kernel`: the block's token rows times the expert's gate and up rows, then
   silu(gate) * up, stored in the model's dtype per sorted position;
2. `_down_kernel`: those rows times the expert's down matrix, scaled by the pair's routing
   weight, stored per (token, choice) pair; the choices are summed by the caller.

The plan (sorting, padding, each block's expert) is made with tensor ops of shapes fixed
by the token count alone, with no host synchronisation, so decode steps can be captured in
CUDA graphs. Blocks past the batch's padded total have expert -1 and return at once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import dot_settings, is_interpreted

BLOCK_M = 16


@triton.jit
def _gate_up_kernel(
    out_ptr,            # [num_slots, inter] sorted position -> silu(gate) * up
    x_ptr,              # [num_tokens, hidden]
    w13_ptr,            # [num_experts, 2 * inter, hidden]: gate rows, then up rows
    slot_pair_ptr,      # [num_slots] int32: the (token, choice) pair at each position, or num_pairs
    block_expert_ptr,   # [num_blocks] int32: the expert of each BLOCK_M rows, or -1
    num_pairs, hidden, inter,
    stride_xt, stride_xh,
    stride_we, stride_wn, stride_wh,
    stride_ot, stride_on,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert >= 0:
        slots = block * BLOCK_M + tl.arange(0, BLOCK_M)
        pairs = tl.load(slot_pair_ptr + slots)
        live = pairs < num_pairs
        tokens = (pairs // TOP_K).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < inter
        w = w13_ptr + expert * stride_we
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < hidden
            a = tl.load(x_ptr + tokens[:, None] * stride_xt + k[None, :] * stride_xh,
                        mask=live[:, None] & k_ok[None, :], other=0.0)
            wg = tl.load(w + n[None, :] * stride_wn + k[:, None] * stride_wh,
                         mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            wu = tl.load(w + (n[None, :] + inter) * stride_wn + k[:, None] * stride_wh,
                         mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            if DOT_F32:
                a, wg, wu = a.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
            gate += tl.dot(a, wg, input_precision=DOT_PRECISION)
            up += tl.dot(a, wu, input_precision=DOT_PRECISION)
        # rounded to the model's dtype between each step, as the unfused products are
        gate = gate.to(out_ptr.dtype.element_ty).to(tl.float32)
        up = up.to(out_ptr.dtype.element_ty).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
        h = (silu * up).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + slots[:, None].to(tl.int64) * stride_ot + n[None, :] * stride_on, h,
                 mask=live[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    out_ptr,            # [num_pairs, hidden] per (token, choice) pair
    h_ptr,              # [num_slots, inter]
    w2_ptr,             # [num_experts, hidden, inter]
    slot_pair_ptr,      # [num_slots] int32
    block_expert_ptr,   # [num_blocks] int32
    pair_weight_ptr,    # [num_pairs] routing weight of each pair (float32 or the model's)
    num_pairs, hidden, inter,
    stride_ht, stride_hn,
    stride_we, stride_wh, stride_wn,
    stride_op, stride_oh,
    WEIGHT_IN_MODEL_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert >= 0:
        slots = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        pairs = tl.load(slot_pair_ptr + slots)
        live = pairs < num_pairs
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < hidden
        w = w2_ptr + expert * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < inter
            a = tl.load(h_ptr + slots[:, None] * stride_ht + k[None, :] * stride_hn,
                        mask=live[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w + n[None, :] * stride_wh + k[:, None] * stride_wn,
                        mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            if DOT_F32:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc += tl.dot(a, b, input_precision=DOT_PRECISION)
        weight = tl.load(pair_weight_ptr + pairs, mask=live, other=0.0).to(tl.float32)
        y = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        y = y * weight[:, None]
        if WEIGHT_IN_MODEL_DTYPE:
            y = y.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + pairs[:, None].to(tl.int64) * stride_op + n[None, :] * stride_oh,
                 y.to(out_ptr.dtype.element_ty), mask=live[:, None] & n_ok[None, :])


def plan_blocks(experts: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot_pair, block_expert) for the [num_tokens, top_k] expert ids: the pairs in
    expert order with each expert's run padded to block_m (padding holds num_pairs), and
    each block's expert (-1 past the end). Shapes depend on the sizes only."""
    flat = experts.flatten()
    num_pairs = flat.numel()
    device = flat.device
    num_slots = num_pairs + num_experts * (block_m - 1)
    num_slots = -(-num_slots // block_m) * block_m
    order = torch.argsort(flat, stable=True)
    # (bincount would read the largest id on the host: no capture in a CUDA graph)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    start = torch.cumsum(counts, 0) - counts
    sorted_expert = flat[order]
    rank = torch.arange(num_pairs, device=device) - start[sorted_expert]
    position = padded_end[sorted_expert] - padded[sorted_expert] + rank
    slot_pair = torch.full((num_slots,), num_pairs, dtype=torch.int32, device=device)
    slot_pair.scatter_(0, position, order.to(torch.int32))
    block_start = torch.arange(0, num_slots, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_start < padded_end[-1], block_expert, -1).to(torch.int32)
    return slot_pair, block_expert


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, experts: torch.Tensor,
              weights: torch.Tensor, weights_in_model_dtype: bool,
              block_m: int | None = None) -> torch.Tensor:
    """sum over each token's top_k choices of weight * expert(x) ([num_tokens, hidden]);
    experts/weights are the router's [num_tokens, top_k] choices."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = experts.shape[1]
    num_pairs = num_tokens * top_k
    # 16-row blocks while experts get a few rows each (decode), 64 for prefill batches
    if block_m is None:
        small = num_pairs <= 16 * num_experts or is_interpreted(_gate_up_kernel)
        block_m = BLOCK_M if small else 64
    slot_pair, block_expert = plan_blocks(experts, num_experts, block_m)
    h = torch.empty(slot_pair.numel(), inter, dtype=x.dtype, device=x.device)
    per_pair = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    dot_f32, precision = dot_settings(_gate_up_kernel, x.dtype)
    block_n, block_k = (32, 32) if is_interpreted(_gate_up_kernel) else (64, 64)
    num_blocks = block_expert.numel()
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        h, x, w13, slot_pair, block_expert, num_pairs, hidden, inter,
        *x.stride(), *w13.stride(), *h.stride(),
        TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_F32=dot_f32, DOT_PRECISION=precision)
    _down_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        per_pair, h, w2, slot_pair, block_expert, weights.flatten().contiguous(),
        num_pairs, hidden, inter, *h.stride(), *w2.stride(), *per_pair.stride(),
        WEIGHT_IN_MODEL_DTYPE=weights_in_model_dtype, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, DOT_F32=dot_f32, DOT_PRECISION=precision)
    return per_pair.view(num_tokens, top_k, hidden).sum(dim=1)
