"""What generate() returns: vLLM-shaped request and completion outputs."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)  # millions of them in a run with logprobs: no per-object __dict__
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.monotonic() seconds) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def queue_s(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_s(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    def tpot_s(self, num_output_tokens: int) -> float | None:
        """Mean time per output token after the first."""
        if num_output_tokens < 2 or self.finished_time is None or self.first_token_time is None:
            return None
        return (self.finished_time - self.first_token_time) / (num_output_tokens - 1)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None  # "stop" | "length" | "error"
    stop_reason: int | str | None = None
    metrics: RequestMetrics | None = None  # this sample's own timeline

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None  # set when the request failed on its own (e.g. prompt too long)
    # with SamplingParams.prompt_logprobs: per prompt token (None for the first) the
    # token's logprob given the ones before it, and the top k there
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
