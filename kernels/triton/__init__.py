"""Triton kernels for GPUs: paged attention (decode and prefill), the KV-cache write, the
fused mixture-of-experts products and the FP8 linear layers (`fp8_matmul.linear`). On a CPU
they run only under the Triton interpreter."""
