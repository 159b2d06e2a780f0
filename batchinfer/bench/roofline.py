"""Work per step against what the device can do: decode bandwidth and prefill MFU.

Decode reads every weight once per step plus the whole KV context of every running
sequence, so achieved bandwidth = (weight bytes + KV bytes) / step time. Prefill is
compute-bound: MFU = model FLOPs of the prefill tokens / time / the device's dense peak.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from batchinfer.model import cpu_linear
from batchinfer.model.config import ModelConfig

# Dense (no sparsity) peaks per device name fragment: (bf16/fp16 FLOP/s, fp32 FLOP/s, bytes/s).
# Checked in order, so a name that contains another comes first (GH200 before H200, L40S
# and L40 before L4).
DEVICE_PEAKS: list[tuple[str, float, float, float]] = [
    ("GH200", 989e12, 67e12, 4.0e12),
    ("H200", 989e12, 67e12, 4.8e12),
    ("H100 PCIe", 756e12, 51e12, 2.0e12),
    ("H100 NVL", 835e12, 60e12, 3.9e12),
    ("H100", 989e12, 67e12, 3.35e12),
    ("B200", 2250e12, 80e12, 8.0e12),
    ("A100-SXM4-80GB", 312e12, 19.5e12, 2.039e12),
    ("A100 80GB PCIe", 312e12, 19.5e12, 1.935e12),
    ("A100", 312e12, 19.5e12, 1.555e12),
    ("L40S", 362e12, 91.6e12, 0.864e12),
    ("L40", 181e12, 90.5e12, 0.864e12),
    ("L4", 121e12, 30.3e12, 0.3e12),
    ("A10", 125e12, 31.2e12, 0.6e12),
]


@dataclass(frozen=True)
class DevicePeak:
    name: str
    flops_per_s: float
    bytes_per_s: float


def device_peak(device: torch.device, dtype: torch.dtype,
                num_devices: int = 1) -> DevicePeak | None:
    """The dense peak for dtype of num_devices devices like `device` together (a
    tensor-parallel group), or None on CPU or an unknown GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, half_peak, fp32_peak, bandwidth in DEVICE_PEAKS:
        if fragment in name:
            flops = fp32_peak if dtype == torch.float32 else half_peak
            if num_devices > 1:
                name = f"{num_devices} x {name}"
            return DevicePeak(name, flops * num_devices, bandwidth * num_devices)
    return None


@dataclass(frozen=True)
class ModelShape:
    """The dimensions that set per-token work, from the model's config."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def from_config(cls, config: ModelConfig) -> "ModelShape":
        mlp_width = config.intermediate_size
        if config.moe is not None:  # mixture of experts: the experts a token runs through
            mlp_width = config.moe.top_k * config.moe.intermediate_size
        return cls(config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
                   config.num_key_value_heads, config.head_dim, mlp_width, config.vocab_size)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def linear_flops_per_token(self) -> int:
        """Matmul FLOPs of one token through all layers (QKV, O, gated MLP)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2
        mlp = 3 * h * self.intermediate_size
        return 2 * self.num_layers * (attn + mlp)

    def logits_flops(self) -> int:
        return 2 * self.hidden_size * self.vocab_size

    def prefill_flops(self, prompt_len: int, num_cached: int) -> int:
        """FLOPs to compute positions [num_cached, prompt_len) of one prompt, logits for the
        last one; causal attention reads positions 0..p for query position p."""
        new = max(prompt_len - num_cached, 0)
        if new == 0:
            return 0
        # sum of (p + 1) for p in [num_cached, prompt_len)
        keys = (prompt_len * (prompt_len + 1) - num_cached * (num_cached + 1)) // 2
        attention = 4 * self.num_layers * self.num_heads * self.head_dim * keys
        return new * self.linear_flops_per_token() + attention + self.logits_flops()


@dataclass(frozen=True)
class WeightBytes:
    """The weights a decode step reads: all of the dense ones, and of a mixture of
    experts' expert weights the share its router sends the batch to."""
    dense: int
    experts: int = 0       # every expert of every MoE layer
    num_experts: int = 1
    top_k: int = 0

    def across(self, ranks: int) -> "WeightBytes":
        """What `ranks` tensor-parallel ranks read together, from one rank's share (each
        holds an equal slice; the few replicated norm weights are counted on every rank)."""
        return WeightBytes(self.dense * ranks, self.experts * ranks, self.num_experts,
                           self.top_k)

    def read_by(self, batch: int) -> float:
        """Bytes for a step of `batch` sequences; with experts, the expected share of them
        hit when each token picks top_k of num_experts uniformly."""
        if not self.experts:
            return float(self.dense)
        hit = 1.0 - (1.0 - self.top_k / self.num_experts) ** batch
        return self.dense + self.experts * hit


def weight_bytes_read_per_step(model: torch.nn.Module, shape: ModelShape,
                               tied_embeddings: bool) -> WeightBytes:
    """Bytes of weights a decode step reads: every parameter and every weight packed for
    oneDNN (those are not parameters), except the input embedding table unless the LM head
    reads it (tied and not packed); only the batch's rows are gathered from it. Expert
    weights are counted apart (WeightBytes.read_by)."""
    from batchinfer.model.moe import SparseMoE
    total = cpu_linear.packed_bytes(model)
    elem = experts = num_experts = top_k = 0
    for module in model.modules():
        if isinstance(module, SparseMoE):
            experts += module.expert_weight_bytes()
            num_experts, top_k = module.num_experts, module.top_k
    total -= experts
    for p in model.parameters():
        total += p.numel() * p.element_size()
        elem = p.element_size()
    head_packed = getattr(getattr(model, "lm_head", None), "packed", None) is not None
    if not tied_embeddings or head_packed:
        # this rank's table: a tensor-parallel rank holds a slice of the vocabulary
        table = getattr(getattr(getattr(model, "model", None), "embed_tokens", None), "weight", None)
        total -= (table.numel() * table.element_size() if table is not None
                  else shape.vocab_size * shape.hidden_size * elem)
    return WeightBytes(total, experts, max(num_experts, 1), top_k)
