"""`batchinfer bench`: offline throughput of our engine against transformers, prefix caching
on vs off, and the engine's own per-step overhead.

cli (flags) -> runner (one invocation) -> workloads (prompts), models (--model to a
directory), engine_run (drive and sample our engine), hf_baseline (transformers),
overhead (--model-stub), roofline (bandwidth and MFU), report (summary and printed lines);
structured (`bench structured`: compiling structured-output constraints).
"""
