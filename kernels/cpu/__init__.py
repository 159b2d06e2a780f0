"""C kernels for CPUs, built with GCC on first use (build.py) and called through ctypes:
paged attention (decode, prefill, the shared prefix), fused elementwise ops, rotary
embedding with the KV-cache write, sampling, logprobs and weight-only FP8 linear products.

Each wrapper module has the same small interface: available() (built here and not switched
off by BATCHINFER_CPU_KERNELS=0), supports(...) (whether the kernel applies to these
tensors), and its call(s), for what supports() takes. Where a kernel does not apply, the
callers keep to torch.
"""
from . import (build, decode, fp8_linear, logprobs, ops, prefill, rope, sample,
               shared_prefix)

__all__ = ["build", "decode", "fp8_linear", "logprobs", "ops", "prefill", "rope", "sample",
           "shared_prefix"]
