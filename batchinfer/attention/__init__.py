"""Attention backends behind one interface: forward(query, key, value, k_cache, v_cache,
meta, scale, sliding_window), which writes key and value to the cache first unless they are
None (the model wrote them itself). "auto" picks Triton on CUDA and the torch path on CPU."""
from __future__ import annotations

import os

import torch

from .metadata import AttentionMetadata
from .torch_backend import TorchAttention

__all__ = ["AttentionMetadata", "TorchAttention", "get_attention_backend", "resolve_backend_name"]


def resolve_backend_name(name: str, device: torch.device) -> str:
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("attention_backend='triton' on a CPU device needs TRITON_INTERPRET=1 "
                         "set before batchinfer is imported (the Triton interpreter)")
    return name


def get_attention_backend(name: str, device: torch.device):
    name = resolve_backend_name(name, device)
    if name == "torch":
        return TorchAttention()
    from .triton_backend import TritonAttention
    return TritonAttention()
