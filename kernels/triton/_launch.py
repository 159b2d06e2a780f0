"""Checks and small helpers shared by the kernel launchers."""
from __future__ import annotations

import functools

import torch

from ..fp8 import FP8_DTYPE

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Shared memory one program may use (the opt-in limit per block, which Triton checks at
# launch), in bytes, by the GPUs Triton supports (compute capability 8.0 and above).
SHARED_MEMORY_BYTES = {
    "sm_80 (A100)": 163 * 1024,
    "sm_86, sm_89, sm_120 (RTX, L4, L40)": 99 * 1024,
    "sm_90 (H100, H200)": 227 * 1024,
    "sm_100 (B200)": 227 * 1024,
}
# What the launchers plan for where the device does not say: the smallest of those, so
# the interpreter runs the tiles such a GPU would.
DEFAULT_SHARED_MEMORY_BYTES = 99 * 1024
# Shared memory the compiler may take beyond the tiles (layout conversions, reductions).
SHARED_MEMORY_SLACK = 8 * 1024


def next_power_of_2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


@functools.lru_cache(maxsize=None)
def shared_memory_bytes(device: torch.device) -> int:
    """The shared memory one program may use on `device` (DEFAULT_SHARED_MEMORY_BYTES
    off CUDA)."""
    if device.type != "cuda":
        return DEFAULT_SHARED_MEMORY_BYTES
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", DEFAULT_SHARED_MEMORY_BYTES)


def attention_shared_memory(rows: int, block_n: int, num_stages: int, head_dim: int,
                            cache_bytes: int, dot_bytes: int) -> int:
    """Bytes of shared memory an attention kernel's tiles take (an upper bound): num_stages
    K and V tiles of [block_n, D_PAD] cache elements in flight, an FP8 cache's tiles again
    once converted to the dot's type, and the query and probability tiles ([rows, D_PAD],
    [rows, block_n]) staged for tl.dot. cache_bytes / dot_bytes: element sizes of the
    cache and of the query."""
    d_pad = next_power_of_2(head_dim)
    kv = 2 * block_n * d_pad
    total = num_stages * kv * cache_bytes
    if cache_bytes != dot_bytes:
        total += kv * dot_bytes
    return total + rows * (d_pad + block_n) * dot_bytes


def fits_shared_memory(used: int, shared_memory: int) -> bool:
    """Whether tiles taking `used` bytes leave SHARED_MEMORY_SLACK of `shared_memory`."""
    return used + SHARED_MEMORY_SLACK <= shared_memory


def is_interpreted(kernel: object) -> bool:
    """True when `kernel` was built by the Triton interpreter (TRITON_INTERPRET=1 at import)."""
    return type(kernel).__name__ == "InterpretedFunction"


def check_inputs(kernel: object, head_dim: int, *tensors: torch.Tensor,
                 caches: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Raise ValueError for a dtype, head size or device the kernels do not handle. The
    caches (K and V) may also be FP8 (float8_e4m3fn), both alike."""
    if head_dim % 16 != 0:
        raise ValueError(f"head_dim={head_dim} is not supported by the Triton attention "
                         "kernels: it must be a multiple of 16")
    if caches[0].dtype != caches[1].dtype:
        raise ValueError(f"the K and V caches differ in dtype: {caches[0].dtype} and "
                         f"{caches[1].dtype}")
    for t in (*tensors, *caches):
        if t.dtype not in SUPPORTED_DTYPES and not (t.dtype == FP8_DTYPE and any(
                t is c for c in caches)):
            raise ValueError(f"Triton attention kernels take float16, bfloat16 or float32 "
                             f"tensors (and float8_e4m3fn caches), got {t.dtype}")
        if t.device.type != "cuda" and not is_interpreted(kernel):
            raise ValueError("Triton kernels need CUDA tensors; to run them on CPU set "
                             "TRITON_INTERPRET=1 before batchinfer is imported")


def dot_settings(kernel: object, dtype: torch.dtype) -> tuple[bool, str]:
    """(DOT_F32, DOT_PRECISION) for a kernel whose tl.dot operands have `dtype`.

    The interpreter multiplies bfloat16 tiles as raw uint16 bit patterns, so under it every
    tile is cast to float32 before tl.dot. On a GPU, float16/bfloat16 tiles go to the tensor
    cores as they are (float32 accumulation) and float32 tiles use exact IEEE products, as
    torch does by default.
    """
    return is_interpreted(kernel), ("ieee" if dtype == torch.float32 else "tf32")
