"""Sparse mixture-of-experts feed-forward blocks (Mixtral, Qwen3-MoE).

A router picks each token's top-k experts; each expert is a SiLU-gated MLP. Tokens are
grouped by expert (one sort), and each expert that received tokens runs two products on
just those rows; the outputs, scaled by the routing weights, are added into the result in
ascending expert order, as transformers' eager experts do, so float32 results match its
sums. With tensor parallelism every rank holds a slice of every expert's intermediate
dimension and the partial results are summed by one all-reduce per layer.

On CUDA the experts run as two grouped Triton products (kernels/triton/fused_moe.py) planned
without host synchronisation, so decode steps are captured in CUDA graphs. Elsewhere a loop
over the experts that received tokens runs; it reads the per-expert token counts on the
host. On CPU each expert's weights are packed once for oneDNN (cpu_linear), which would
otherwise reorder them on every product: an extra pass over weights that decode steps
read only a few rows' worth of work from.
"""
from __future__ import annotations

import functools
import importlib.util
import itertools
import re

import torch
import torch.nn.functional as F
from torch import nn

from batchinfer.model import cpu_linear
from batchinfer.model.config import ModelConfig
from batchinfer.model.parallel import TensorParallel, _check_divisible, _shard

# a checkpoint's per-expert tensor: (block).experts.(e).(projection).weight
EXPERT_TENSOR = re.compile(r"(.+)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


class Router(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 normalize: bool, weights_in_model_dtype: bool):
        super().__init__()
        _check_divisible(intermediate_size, "expert intermediate size")
        self.num_experts, self.top_k, self.normalize = num_experts, top_k, normalize
        # Qwen3-MoE rounds the routing weights to the model's dtype; Mixtral keeps float32
        self.weights_in_model_dtype = weights_in_model_dtype
        self.intermediate = intermediate_size // TensorParallel.size
        self.gate = Router(num_experts, hidden_size)
        # per expert: [gate; up] rows, and down
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate, hidden_size),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.intermediate),
                               requires_grad=False)
        self.loaded: set[tuple[int, str]] = set()
        # the grouped Triton products: on CUDA (None: decided by the device)
        self.use_fused: bool | None = None
        # per expert, (w13, w2) in oneDNN's layout, once pack_weights() ran (CPU)
        self.packed_experts: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None

    def pack_weights(self, batch_hint: int) -> None:
        """Each expert's weights packed for products of about the rows it gets when
        batch_hint tokens spread over the experts; only the packed copies are kept."""
        if self.packed_experts is not None:
            return
        rows = max(1, batch_hint * self.top_k // self.num_experts)
        self.packed_experts = tuple((cpu_linear.pack(self.w13[e], rows),
                                     cpu_linear.pack(self.w2[e], rows))
                                    for e in range(self.num_experts))
        self.w13 = self.w2 = None

    def expert_weight_bytes(self) -> int:
        """Bytes of all experts' weights (as held: packed or not)."""
        if self.packed_experts is not None:
            return sum(t.numel() * t.element_size() for pair in self.packed_experts for t in pair)
        return sum(p.numel() * p.element_size() for p in (self.w13, self.w2))

    def _product(self, e: int, which: int, x: torch.Tensor) -> torch.Tensor:
        """x times expert e's w13 (which 0) or w2 (which 1), transposed."""
        if self.packed_experts is not None:
            return cpu_linear.linear(x, self.packed_experts[e][which])
        return F.linear(x, (self.w13, self.w2)[which][e])

    def load_expert(self, expert: int, projection: str, loaded: torch.Tensor) -> None:
        """One expert's gate_proj, up_proj or down_proj, as the checkpoint holds it."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"checkpoint has expert {expert}; the config has {self.num_experts}")
        n = self.intermediate
        if projection == "down_proj":
            self.w2.data[expert].copy_(_shard(loaded, 1))
        else:
            rows = slice(0, n) if projection == "gate_proj" else slice(n, 2 * n)
            self.w13.data[expert, rows].copy_(_shard(loaded, 0))
        self.loaded.add((expert, projection))

    def missing_experts(self) -> list[str]:
        return [f"expert {e} {p}" for e in range(self.num_experts)
                for p in ("gate_proj", "up_proj", "down_proj") if (e, p) not in self.loaded]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.gate.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        if self.weights_in_model_dtype:
            weights = weights.to(x.dtype)
        if self.fused(x):
            from batchinfer.kernels.triton.fused_moe import fused_moe
            out = fused_moe(x, self.w13, self.w2, experts, weights, self.weights_in_model_dtype)
            return TensorParallel.all_reduce(out)
        # the (token, choice) pairs grouped by expert; the per-expert work is the products
        # alone, and everything else runs once over all pairs
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // self.top_k
        rows = x.index_select(0, tokens)
        ends = list(itertools.accumulate(counts))
        spans = [(e, end - n, end) for e, (n, end) in enumerate(zip(counts, ends)) if n]
        gate_up = torch.cat([self._product(e, 0, rows[a:b]) for e, a, b in spans])
        h = F.silu(gate_up[:, :self.intermediate]) * gate_up[:, self.intermediate:]
        y = torch.cat([self._product(e, 1, h[a:b]) for e, a, b in spans])
        y = y * weights.flatten()[order, None]
        # rows in expert order: each token's choices are added in ascending expert order
        out = torch.zeros_like(x).index_add_(0, tokens, y.to(x.dtype))
        return TensorParallel.all_reduce(out)

    def fused(self, x: torch.Tensor) -> bool:
        if self.use_fused is not None:
            if self.use_fused and self.packed_experts is not None:
                raise RuntimeError(
                    "the grouped MoE products need the experts' weights as loaded, and they "
                    f"were packed for CPU products ({cpu_linear.ENV_SWITCH}=0 keeps them)")
            return self.use_fused
        return x.is_cuda and _triton_installed()


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def moe_block(config: ModelConfig) -> SparseMoE:
    """A layer's MoE block, as config.moe describes it."""
    moe = config.moe
    return SparseMoE(config.hidden_size, moe.intermediate_size, moe.num_experts, moe.top_k,
                     moe.normalize, moe.weights_in_model_dtype)


# Mixtral's checkpoint names for the block and its projections
MIXTRAL_NAMES = ((".block_sparse_moe.", ".mlp."), (".w1.weight", ".gate_proj.weight"),
                 (".w3.weight", ".up_proj.weight"), (".w2.weight", ".down_proj.weight"))


def mixtral_name(name: str) -> str:
    if ".block_sparse_moe." not in name:
        return name
    for old, new in MIXTRAL_NAMES:
        name = name.replace(old, new)
    return name
