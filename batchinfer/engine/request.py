"""One request's state, with one state machine:
WAITING -> RUNNING -> [PREEMPTED -> WAITING ->] FINISHED_*."""
from __future__ import annotations

import enum
import time

from batchinfer.outputs import FlatLogprobs, RequestMetrics
from batchinfer.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")


class Request:
    """A single sample stream. n > 1 samples of one prompt are n Requests (children)
    that share the prompt's cached blocks."""

    # Slots keep a request's fields in the object itself: an engine step reads a few of
    # them for every running request, and with a thousand requests the memory each read
    # touches, not the interpreter, is most of the step's host time.
    __slots__ = ("request_id", "parent_id", "sample_index", "params", "prompt_token_ids",
                 "num_prompt_tokens", "token_ids", "num_computed_tokens", "status",
                 "block_hashes", "num_cached_tokens", "kv_room", "metrics", "max_tokens",
                 "length_limit", "stop_token_ids", "stop_reason", "error", "logprobs",
                 "cumulative_logprob", "prompt_logprobs", "detokenizer")

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: frozenset[int], max_model_len: int,
                 arrival_time: float | None = None, parent_id: str | None = None,
                 sample_index: int = 0):
        self.request_id = request_id
        self.parent_id = parent_id or request_id
        self.sample_index = sample_index
        self.params = params
        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt + output
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.block_hashes: list[int] = []  # chained hashes of full blocks, filled lazily
        self.num_cached_tokens = -1        # prefix-cache hit at first scheduling
        # the most tokens (computed + scheduled) its KV blocks take with no block to
        # allocate or register in the prefix cache; kept by KVCacheManager
        self.kv_room = 0
        self.metrics = RequestMetrics(arrival_time=arrival_time or time.monotonic())
        limit = max_model_len - self.num_prompt_tokens
        self.max_tokens = min(params.max_tokens or limit, limit)
        self.length_limit = self.num_prompt_tokens + self.max_tokens  # len(token_ids) at the end
        if params.stop_token_ids:
            self.stop_token_ids = frozenset(params.stop_token_ids) | (
                frozenset() if params.ignore_eos else eos_token_ids)
        else:  # the usual case: one set shared by the requests, which stays in cache
            self.stop_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.stop_reason: int | str | None = None
        self.error: str | None = None  # why it finished with FINISHED_ERROR
        self.logprobs = FlatLogprobs() if params.logprobs is not None else None
        self.cumulative_logprob = 0.0 if params.logprobs is not None else None
        self.prompt_logprobs = None  # the first prompt token has none
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = FlatLogprobs()
            self.prompt_logprobs.add_none()
        self.detokenizer = None  # set by the engine when stop strings need incremental text

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
