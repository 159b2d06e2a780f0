"""Engine configuration: one dataclass, validated once at the boundary."""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from batchinfer.flags import (ATTENTION_BACKENDS, KV_CACHE_DTYPES, LOAD_FORMATS,
                              QUANTIZATION_METHODS)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    kv_cache_memory_bytes: int | None = None
    num_kv_blocks: int | None = None
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype) | "fp8" = "fp8_e4m3" (E4M3)
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1  # decoder layers split into this many stages
    # one engine over several nodes (batchinfer.engine.nodes): node 0 runs it, the others serve
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"   # node 0's address, where the nodes meet
    master_port: int = 29501
    # the job's secret, which a process must prove it holds to meet the nodes (else
    # $BATCHINFER_NODE_SECRET): batchinfer.engine.node_store
    node_secret_file: str | None = None
    attention_backend: str = "auto"
    enforce_eager: bool = False  # CUDA: run decode steps eagerly, without CUDA graphs
    # plan the next step while the current one runs (engine/engine.py); one process only
    async_scheduling: bool = False
    device: str | None = None
    trust_remote_code: bool = False
    allow_pickle_weights: bool = False
    load_format: str = "auto"  # "auto" (safetensors; .bin only with allow_pickle_weights) | "dummy" (random)
    quantization: str | None = None  # "fp8": a full-precision checkpoint's linears to FP8 at load
    # sampling defaults: "auto" (the model's generation_config.json), "vllm" (none), or a
    # directory holding a generation_config.json (batchinfer/model/generation_config.py)
    generation_config: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128; got {self.block_size}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size",
                     "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in 0..nnodes-1 (nnodes {self.nnodes}), got "
                             f"{self.node_rank}")
        if not 1 <= self.master_port <= 65535:
            raise ValueError(f"master_port must be in 1..65535, got {self.master_port}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                             f"got {self.kv_cache_dtype!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.quantization not in (None, *QUANTIZATION_METHODS):
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}; "
                             f"got {self.quantization!r}")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError("generation_config must be 'auto', 'vllm' or a directory, got "
                             f"{self.generation_config!r}")
        if self.async_scheduling and (self.tensor_parallel_size > 1
                                      or self.pipeline_parallel_size > 1 or self.nnodes > 1):
            raise ValueError("async_scheduling runs one engine process; drop it or "
                             "tensor_parallel_size / pipeline_parallel_size / nnodes")
        if self.device is not None:
            check_device(self.device)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}; "
                             f"got {self.attention_backend!r}")

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def kv_cache_torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """What the KV cache stores: the model's dtype (auto), or E4M3 (fp8, fp8_e4m3)."""
        return model_dtype if self.kv_cache_dtype == "auto" else torch.float8_e4m3fn


def check_device(device: str | torch.device) -> torch.device:
    """device as a torch.device: 'cpu', 'cuda' or 'cuda:N', and there when it is a GPU."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {str(device)!r}")
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            why = ("this torch is built without CUDA" if torch.version.cuda is None
                   else "no CUDA device is visible")
            raise ValueError(f"device {str(device)!r}: {why}; use device 'cpu' or run where "
                             "a GPU is")
        if (parsed.index or 0) >= count:
            raise ValueError(f"device {str(device)!r}: only {count} CUDA device(s) are visible")
    return parsed
