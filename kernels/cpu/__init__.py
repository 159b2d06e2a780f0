"""C kernels for CPUs, built with GCC on first use (build.py) and called through ctypes:
paged attention (decode, prefill, the shared prefix), fused elementwise ops, rotary
embedding with the KV-cache write, sampling and logprobs. Each wrapper module says whether
its kernel is available here and whether it applies to given tensors; where not, the
callers keep to torch."""
