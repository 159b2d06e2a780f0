"""What generate() returns: vLLM-shaped request and completion outputs."""
from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class FlatLogprobs(Sequence):
    """Logprobs read as vLLM's list of {token_id: Logprob} dicts, one per token (a sample's:
    the sampled token first, then the top k by rank; a prompt's: the same for the prompt
    token, and None for the first), but stored flat: a run with logprobs=k keeps k + 1
    numbers and a shared string per token in a few lists, not k + 1 objects and a dict.
    Indexing builds a position's dict; the job writer reads the lists. Position i's entries
    are [starts[i], starts[i + 1]) of token_ids, logprobs, ranks and decoded_tokens; a
    position with none reads as None."""

    __slots__ = ("starts", "token_ids", "logprobs", "ranks", "decoded_tokens")

    def __init__(self) -> None:
        self.starts = [0]
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.ranks: list[int] = []
        self.decoded_tokens: list[str] = []

    def add(self, token: int, top_ids: list[int], values: list[float], rank: int, k: int,
            text: Callable[[int], str]) -> None:
        """One position: the sampled token (values[-1], at rank `rank`), then the top k
        (top_ids[:k], values[:k], ranks 1..k) but for the sampled token if it is one."""
        ids, lps, ranks = self.token_ids, self.logprobs, self.ranks
        ids.append(token)
        lps.append(values[-1])
        ranks.append(rank)
        top = top_ids[:k]
        if token in top:
            j = top.index(token)
            ids += top[:j]
            ids += top[j + 1:]
            lps += values[:j]
            lps += values[j + 1:k]
            ranks += range(1, j + 1)
            ranks += range(j + 2, k + 1)
        else:
            ids += top
            lps += values[:k]
            ranks += range(1, k + 1)
        self.decoded_tokens += map(text, ids[self.starts[-1]:])
        self.starts.append(len(ids))

    def add_none(self) -> None:
        """A position with no logprobs (a prompt's first token)."""
        self.starts.append(self.starts[-1])

    def section(self, a: int, b: int) -> FlatLogprobs:
        """Positions [a, b) copied into arrays, for keeping (the prefix cache's blocks keep
        their prompt logprobs): about 32 bytes an entry, the strings shared."""
        out = FlatLogprobs.__new__(FlatLogprobs)
        lo, hi = self.starts[a], self.starts[b]
        out.starts = array("q", [s - lo for s in self.starts[a:b + 1]])
        out.token_ids = array("q", self.token_ids[lo:hi])
        out.logprobs = array("d", self.logprobs[lo:hi])
        out.ranks = array("q", self.ranks[lo:hi])
        out.decoded_tokens = self.decoded_tokens[lo:hi]
        return out

    def extend(self, other: FlatLogprobs, a: int = 0, b: int | None = None) -> None:
        """Append other's positions [a, b) (b: to its end)."""
        b = len(other) if b is None else b
        lo, hi = other.starts[a], other.starts[b]
        base = self.starts[-1] - lo
        self.starts += [s + base for s in other.starts[a + 1:b + 1]]
        self.token_ids += other.token_ids[lo:hi]
        self.logprobs += other.logprobs[lo:hi]
        self.ranks += other.ranks[lo:hi]
        self.decoded_tokens += other.decoded_tokens[lo:hi]

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("logprobs position out of range")
        a, b = self.starts[i], self.starts[i + 1]
        if a == b:
            return None
        return {t: Logprob(lp, r, d) for t, lp, r, d in
                zip(self.token_ids[a:b], self.logprobs[a:b], self.ranks[a:b],
                    self.decoded_tokens[a:b])}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    def __repr__(self) -> str:
        return f"FlatLogprobs({list(self)!r})"


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
    logprobs: FlatLogprobs | None  # a sequence of {token_id: Logprob}, one per token
    finish_reason: str | None  # "stop" | "length" | "error"
    stop_reason: int | str | None = None
    metrics: RequestMetrics | None = None  # this sample's own timeline
    # with a reasoning parser: the text inside the think tags (None where the output had
    # none); `text` is then the answer after them
    reasoning_content: str | None = None

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
    prompt_logprobs: FlatLogprobs | None = None
