"""Sparse mixture-of-experts feed-forward blocks (Mixtral, Qwen3-MoE, GLM-4.5, gpt-oss).

A router picks each token's top-k experts: by softmax (Mixtral, Qwen3-MoE), or as
DeepSeekMoE does (GLM-4.5): sigmoid scores, chosen with a learned bias added among the best
groups of experts, their weights scaled (MoEConfig); that router computes in float32 and
keeps its weights in float32, as transformers does. Each expert is a SiLU-gated MLP, and a
block may have shared experts (a dense MLP every token goes through, added after). Tokens are
grouped by expert (one sort), and each expert that received tokens runs two products on
just those rows; the outputs, scaled by the routing weights, are added into the result in
ascending expert order, as transformers' eager experts do, so float32 results match its
sums. With tensor parallelism every rank holds a slice of every expert's intermediate
dimension and the partial results are summed by one all-reduce per layer.

gpt-oss's block (scoring "topk_softmax") differs: the router has a bias and its weights are
a softmax over the top k logits; the experts have biases (the down projection's added on
rank 0 only under tensor parallelism) and a clamped SwiGLU (MoEConfig.swiglu_limit); the
checkpoint stores all experts of a layer as one tensor per projection, gate and up
interleaved by column (load_fused_experts), or as MXFP4 blocks and scales dequantized at
load (batchinfer.model.mxfp4). It runs the loop over the experts on every device.

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

from batchinfer.model import cpu_linear, fp8
from batchinfer.model.config import ModelConfig, MoEConfig
from batchinfer.model.parallel import TensorParallel, _check_divisible, _fp8_parameter, _shard
from batchinfer.model.quantization import LinearQuant
from batchinfer.model.weights import CheckpointTensor

# a checkpoint's per-expert tensor: (block).experts.(e).(projection).(weight or an FP8 scale)
EXPERT_TENSOR = re.compile(r"(.+)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\."
                           r"(weight|weight_scale|weight_scale_inv|input_scale)")
# gpt-oss's: all experts of a block in one tensor per projection, its bias, or MXFP4 parts
FUSED_EXPERT_TENSOR = re.compile(r"(.+)\.experts\.(gate_up_proj|down_proj)"
                                 r"(|_bias|_blocks|_scales)")


class Router(nn.Module):
    """The routing logits' weights (and gpt-oss's bias); DeepSeekMoE's (sigmoid scoring) in
    float32, with the correction bias of its scores."""

    def __init__(self, num_experts: int, hidden_size: int, sigmoid: bool = False,
                 bias: bool = False):
        super().__init__()
        if not sigmoid:
            self.weight = nn.Parameter(torch.empty(num_experts, hidden_size),
                                       requires_grad=False)
            self.bias = (nn.Parameter(torch.empty(num_experts), requires_grad=False)
                         if bias else None)
            return
        self.weight = _fp8_parameter(torch.empty(num_experts, hidden_size))  # kept float32
        self.e_score_correction_bias = _fp8_parameter(torch.zeros(num_experts))


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 normalize: bool, weights_in_model_dtype: bool, quant: LinearQuant | None = None,
                 routing: MoEConfig | None = None, shared_experts: nn.Module | None = None):
        super().__init__()
        _check_divisible(intermediate_size, "expert intermediate size")
        self.num_experts, self.top_k, self.normalize = num_experts, top_k, normalize
        # Qwen3-MoE rounds the routing weights to the model's dtype; Mixtral keeps float32
        self.weights_in_model_dtype = weights_in_model_dtype
        self.intermediate = intermediate_size // TensorParallel.size
        # DeepSeekMoE's routing settings (scoring "sigmoid"); None: softmax routing
        self.routing = routing if routing is not None and routing.scoring == "sigmoid" else None
        # gpt-oss's: (limit, alpha) of its clamped SwiGLU; None: SiLU-gated experts
        self.swiglu = None
        if routing is not None and routing.scoring == "topk_softmax":
            self.swiglu = (routing.swiglu_limit, routing.swiglu_alpha)
        self.gate = Router(num_experts, hidden_size, sigmoid=self.routing is not None,
                           bias=self.swiglu is not None)
        self.shared_experts = shared_experts
        # per expert: [gate; up] rows, and down
        self.quant = quant
        if quant is None:
            self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate, hidden_size),
                                    requires_grad=False)
            self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.intermediate),
                                   requires_grad=False)
        else:
            self._init_fp8(quant, hidden_size, intermediate_size)
        # gpt-oss's expert biases: [E, 2n] ([gate; up], this rank's) and [E, hidden]
        self.b13 = self.b2 = None
        if self.swiglu is not None:
            if quant is not None:
                raise ValueError("FP8 experts are not supported for gpt-oss")
            self.b13 = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate),
                                    requires_grad=False)
            self.b2 = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.loaded: set[tuple[int, str]] = set()
        # the grouped Triton products: on CUDA (None: decided by the device)
        self.use_fused: bool | None = None
        # per expert, (w13, w2) in oneDNN's layout, once pack_weights() ran (CPU)
        self.packed_experts: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None

    def _init_fp8(self, quant: LinearQuant, hidden_size: int, intermediate_size: int) -> None:
        """FP8 experts (batchinfer.model.fp8's layout, one more leading dimension): w13 and
        w2 in float8_e4m3fn with float32 w13_scale [E, 2n, groups] and w2_scale [E, hidden,
        groups]; block scales of w2 are cut with its columns under tensor parallelism."""
        n, e = self.intermediate, self.num_experts
        width = quant.block[1] if quant.block else None
        if width and TensorParallel.size > 1 and n % width:
            raise ValueError(f"tensor_parallel_size {TensorParallel.size} cuts the experts' "
                             f"{intermediate_size} input features into {n}, not a multiple of "
                             f"the checkpoint's {width}-wide scale blocks; use a "
                             "tensor_parallel_size that does")
        self.group13, self.group2 = width or hidden_size, width or n
        self.full_groups2 = fp8.num_groups(intermediate_size, width) if width else 1
        self.w13 = _fp8_parameter(torch.empty(e, 2 * n, hidden_size, dtype=fp8.FP8))
        self.w13_scale = _fp8_parameter(
            torch.ones(e, 2 * n, fp8.num_groups(hidden_size, self.group13)))
        self.w2 = _fp8_parameter(torch.empty(e, hidden_size, n, dtype=fp8.FP8))
        self.w2_scale = _fp8_parameter(torch.ones(e, hidden_size, fp8.num_groups(n, self.group2)))

    def pack_weights(self, batch_hint: int) -> None:
        """Each expert's weights packed for products of about the rows it gets when
        batch_hint tokens spread over the experts; only the packed copies are kept."""
        if self.packed_experts is not None or self.quant is not None:
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
        scales = (self.w13_scale, self.w2_scale) if self.quant is not None else ()
        return sum(p.numel() * p.element_size() for p in (self.w13, self.w2, *scales))

    def _product(self, e: int, which: int, x: torch.Tensor) -> torch.Tensor:
        """x times expert e's w13 (which 0) or w2 (which 1), transposed."""
        if self.packed_experts is not None:
            return cpu_linear.linear(x, self.packed_experts[e][which])
        if self.quant is not None:
            weight, scale = (self.w13, self.w13_scale) if which == 0 else (self.w2, self.w2_scale)
            return fp8.linear(x, weight[e], scale[e], (self.group13, self.group2)[which])
        return F.linear(x, (self.w13, self.w2)[which][e])

    def load_expert(self, expert: int, projection: str, loaded: CheckpointTensor,
                    kind: str = "weight") -> None:
        """One expert's gate_proj, up_proj or down_proj (kind "weight": this rank's rows or
        columns are read), or an FP8 one's scale ("weight_scale", read whole; "input_scale"
        is not used: activations are dynamic here), as the checkpoint holds it."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"checkpoint has expert {expert}; the config has {self.num_experts}")
        if kind == "input_scale":
            return
        n = self.intermediate
        down = projection == "down_proj"
        rows = slice(None) if down else slice(0, n) if projection == "gate_proj" else slice(n, 2 * n)
        weight, scale = (self.w2, getattr(self, "w2_scale", None)) if down \
            else (self.w13, getattr(self, "w13_scale", None))
        if kind == "weight_scale":
            if self.quant is None:
                raise ValueError(f"expert {expert} {projection} has a scale, but the model is "
                                 "not FP8")
            full = fp8.rows_from_checkpoint(loaded.read(), loaded_rows(weight, rows, down),
                                            self.quant.block,
                                            self.full_groups2 if down else scale.shape[2])
            if down:
                groups = scale.shape[2]
                if groups != self.full_groups2:
                    full = full[:, TensorParallel.rank * groups:(TensorParallel.rank + 1) * groups]
                scale.data[expert].copy_(full)
            else:
                scale.data[expert, rows].copy_(_shard(full, 0))
            self.loaded.add((expert, projection + " scale"))
            return
        part = _shard(loaded, 1 if down else 0).read()
        if self.quant is not None and part.dtype != fp8.FP8:
            if not self.quant.online:
                raise ValueError(f"is {part.dtype}, expected float8_e4m3fn (the checkpoint's "
                                 "quantization_config says the experts are FP8)")
            part, row_scales = fp8.quantize_rows(part)
            scale.data[expert, rows].copy_(row_scales.expand_as(scale.data[expert, rows]))
            self.loaded.add((expert, projection + " scale"))
        weight.data[expert, rows].copy_(part.to(weight.dtype))
        self.loaded.add((expert, projection))

    def load_fused_experts(self, projection: str, suffix: str,
                           loaded: CheckpointTensor | torch.Tensor) -> None:
        """gpt-oss's experts as its checkpoint stores them: gate_up_proj [E, hidden, 2n]
        (gate and up interleaved by column) and down_proj [E, n, hidden], products from
        the right, or their biases (suffix "_bias": [E, 2n], interleaved likewise, and
        [E, hidden]). A tensor here may also be one batchinfer.model.mxfp4 dequantized."""
        if self.swiglu is None:
            raise ValueError("is a fused experts tensor, which only gpt-oss's blocks take")
        e, n, hidden = self.num_experts, self.intermediate, self.w2.shape[1]
        full_n = n * TensorParallel.size
        down = projection == "down_proj"
        bias = suffix == "_bias"
        expected = ([e, hidden] if down else [e, 2 * full_n]) if bias \
            else [e, full_n, hidden] if down else [e, hidden, 2 * full_n]
        if list(loaded.shape) != expected:
            raise ValueError(f"has shape {list(loaded.shape)}, expected {expected}")
        data = loaded if isinstance(loaded, torch.Tensor) else loaded.read()
        part = slice(TensorParallel.rank * n, (TensorParallel.rank + 1) * n)
        if down and bias:
            self.b2.data.copy_(data)
        elif down:  # [E, n, hidden] -> this rank's [E, hidden, n]
            self.w2.data.copy_(data[:, part].transpose(1, 2))
        else:
            gate, up = data[..., 0::2], data[..., 1::2]
            if bias:
                self.b13.data.copy_(torch.cat([gate[:, part], up[:, part]], dim=1))
            else:  # [E, hidden, n] each -> [E, 2n, hidden]
                self.w13.data.copy_(torch.cat([gate[..., part], up[..., part]],
                                              dim=2).transpose(1, 2))
        names = ("down_proj",) if down else ("gate_proj", "up_proj")
        self.loaded.update((expert, name + (" bias" if bias else ""))
                           for expert in range(e) for name in names)

    def missing_experts(self) -> list[str]:
        kinds = ("", " scale") if self.quant is not None else \
            ("", " bias") if self.swiglu is not None else ("",)
        return [f"expert {e} {p}{k}" for e in range(self.num_experts)
                for p in ("gate_proj", "up_proj", "down_proj") for k in kinds
                if (e, p + k) not in self.loaded]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(routing weights [T, top_k], experts [T, top_k]) of the tokens x [T, hidden]."""
        if self.routing is not None:
            return self._route_grouped(x)
        if self.swiglu is not None:  # gpt-oss: a softmax over the top k logits
            logits = F.linear(x, self.gate.weight, self.gate.bias)
            top, experts = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(top, dim=-1), experts
        logits = F.linear(x, self.gate.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        if self.weights_in_model_dtype:
            weights = weights.to(x.dtype)
        return weights, experts

    def _route_grouped(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeekMoE's routing, in float32 and in transformers' order of operations."""
        r = self.routing
        scores = F.linear(x.float(), self.gate.weight).sigmoid()
        choice = scores + self.gate.e_score_correction_bias
        if r.num_groups > 1:
            grouped = choice.view(-1, r.num_groups, self.num_experts // r.num_groups)
            best = torch.topk(grouped.topk(2, dim=-1)[0].sum(dim=-1), k=r.topk_groups,
                              dim=-1, sorted=False)[1]
            kept = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=x.device)
            kept.scatter_(1, best, True)
            choice = choice.masked_fill(~kept.repeat_interleave(grouped.shape[2], dim=1),
                                        float("-inf"))
        experts = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if self.normalize:
            weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
        return weights * r.routed_scaling_factor, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._routed(x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        if self.quant is None and self.fused(x):
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
        if self.swiglu is not None:
            rows_per_expert = torch.tensor(counts, device=x.device)
            gate_up = gate_up + self.b13.repeat_interleave(rows_per_expert, dim=0)
            h = self._clamped_swiglu(gate_up)
        else:
            h = F.silu(gate_up[:, :self.intermediate]) * gate_up[:, self.intermediate:]
        y = torch.cat([self._product(e, 1, h[a:b]) for e, a, b in spans])
        if self.swiglu is not None and TensorParallel.rank == 0:
            y = y + self.b2.repeat_interleave(rows_per_expert, dim=0)
        y = y * weights.flatten()[order, None]
        # rows in expert order: each token's choices are added in ascending expert order
        out = torch.zeros_like(x).index_add_(0, tokens, y.to(x.dtype))
        return TensorParallel.all_reduce(out)

    def _clamped_swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gpt-oss's activation of [gate | up] rows."""
        limit, alpha = self.swiglu
        gate = gate_up[:, :self.intermediate].clamp(max=limit)
        up = gate_up[:, self.intermediate:].clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    def fused(self, x: torch.Tensor) -> bool:
        if self.quant is not None or self.swiglu is not None:
            # FP8 experts run one product each (fp8.linear); the fused kernel has no
            # biases nor gpt-oss's activation
            return False
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


def moe_block(config: ModelConfig, prefix: str,
              shared_experts: nn.Module | None = None) -> SparseMoE:
    """A layer's MoE block, as config.moe describes it, with the shared experts given;
    its experts FP8 where the model's quantization covers them (named as expert 0's
    projections are)."""
    moe = config.moe
    quant = None
    if config.quantization is not None:
        quant = config.quantization.linear_quant(
            [f"{prefix}.experts.0.{p}" for p in ("gate_proj", "up_proj", "down_proj")])
    return SparseMoE(config.hidden_size, moe.intermediate_size, moe.num_experts, moe.top_k,
                     moe.normalize, moe.weights_in_model_dtype, quant, moe, shared_experts)


def loaded_rows(weight: torch.Tensor, rows: slice, down: bool) -> int:
    """Rows of one expert's checkpoint tensor for this part: down_proj's whole hidden size,
    gate_proj's or up_proj's intermediate size before tensor parallelism cut it."""
    if down:
        return weight.shape[1]
    return (rows.stop - rows.start) * TensorParallel.size


# Mixtral's checkpoint names for the block and its projections
MIXTRAL_NAMES = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."),
                 (".w3.", ".up_proj."), (".w2.", ".down_proj."))


def mixtral_name(name: str) -> str:
    if ".block_sparse_moe." not in name:
        return name
    for old, new in MIXTRAL_NAMES:
        name = name.replace(old, new)
    return name
