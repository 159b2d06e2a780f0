"""The decoder's elementwise operations: on the CPU by the C kernels where they apply
(batchinfer.kernels.cpu: ops for the norms and the gated activation, rope for the rotary
embedding with the KV-cache write), in torch everywhere else. The kernels round where torch
rounds (bfloat16 gives torch's bits but for rare last-place differences in RMSNorm's sum;
see kernels/README.md), so the layers call these without caring which runs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from batchinfer.kernels import cpu
from batchinfer.model.rope import apply_rotary


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, gemma: bool = False):
    """norm(x); with residual, (norm(x + residual), x + residual): the residual add fused
    into the norm (residual may be updated in place). gemma: Gemma's norm (torch_rms_norm)."""
    if cpu.ops.supports(x, residual):  # bfloat16/float32 on CPU: one fused pass
        out = _kernel_rms_norm(x, weight, eps, residual, None, gemma)
        return out if residual is None else (out, residual)
    if residual is None:
        return torch_rms_norm(x, weight, eps, gemma)
    x = x + residual
    return torch_rms_norm(x, weight, eps, gemma), x


def rms_norm_(x: torch.Tensor, weight: torch.Tensor, eps: float,
              gemma: bool = False) -> torch.Tensor:
    """norm(x) written over x, which may be a view of some heads of a projection's output
    (q or k of a fused qkv): per-head norms without a copy on CPU."""
    if cpu.ops.supports_heads(x):
        return _kernel_rms_norm(x, weight, eps, None, x, gemma)
    return x.copy_(torch_rms_norm(x, weight, eps, gemma))


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   gemma: bool = False) -> torch.Tensor:
    """RMSNorm over the last dimension as transformers computes it. Llama's rounds the
    normalised x to x's dtype, then multiplies by weight; Gemma's weight is an offset from 1
    and multiplies in float32 before the one rounding."""
    if gemma:
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + eps)
        return (out * (1.0 + weight.float())).to(x.dtype)
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _kernel_rms_norm(x, weight, eps, residual, out, gemma) -> torch.Tensor:
    if gemma:  # 1 + weight in float32, multiplied before the one rounding (bfloat16)
        return cpu.ops.rms_norm(x, 1.0 + weight.float(), eps, residual, out,
                                gemma_order=x.dtype == torch.bfloat16)
    return cpu.ops.rms_norm(x, weight, eps, residual, out)


def act_mul_(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up, over gate (in place on CPU); act "silu" or "gelu_pytorch_tanh"."""
    if cpu.ops.supports(gate, up):  # in one pass
        return (cpu.ops.silu_mul_ if act == "silu" else cpu.ops.gelu_tanh_mul_)(gate, up)
    if act != "silu":
        return F.gelu(gate, approximate="tanh").mul_(up)
    return F.silu(gate).mul_(up)


def rope_and_cache(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   num_heads: int, slot_mapping: torch.Tensor,
                   kv_cache: tuple[torch.Tensor, torch.Tensor], k_scale: float = 1.0,
                   v_scale: float = 1.0
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(q, k, v) of qk [T, num_heads + Hkv, D] (q's heads first) and v, with q and k
    rotated. On CPU k and v are written to their cache slots in the same C pass (an FP8
    cache's with its scales), and come back None (the attention backend writes them
    otherwise)."""
    if cpu.rope.supports(qk, kv_cache[0].dtype):
        return cpu.rope.rotate_and_write(qk, v, cos, sin, slot_mapping, *kv_cache, k_scale,
                                         v_scale), None, None
    qk = apply_rotary(qk, cos, sin)  # q and k in one pass; both are views of its output
    return qk[:, :num_heads], qk[:, num_heads:], v
