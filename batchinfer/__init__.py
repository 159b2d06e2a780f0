"""batchinfer: offline batch inference with continuous batching, paged attention and
prefix caching."""
from batchinfer.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from batchinfer.sampling_params import SamplingParams, StructuredOutputsParams


def __getattr__(name: str):
    # LLM pulls in torch model code; import it on first use so `batchinfer --help` is quick.
    if name == "LLM":
        from batchinfer.llm import LLM
        return LLM
    raise AttributeError(f"module 'batchinfer' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob",
           "RequestMetrics"]
