"""Triton kernels for GPUs: paged attention (decode and prefill), the KV-cache write and the
fused mixture-of-experts products. On a CPU they run only under the Triton interpreter."""
