"""Continuous batching without phases: each step asks every request to catch its
computed tokens up with its total tokens, under a token budget and a sequence cap.

Running requests go first (oldest first), then waiting ones. A prompt longer than the
remaining budget is split across steps (chunked prefill). The running requests at a block
boundary get their blocks in one commit when the free blocks cover them all; when not,
they are allocated for one by one, and a request that needs a block when none is free
preempts the most recently admitted running request: its blocks are freed and it is
recomputed later (its prefix is usually still cached).

As in vLLM V1, a request's computed tokens count its scheduled ones as soon as they are
scheduled: by the time the next plan is made, the one before has run. With async
scheduling the next plan is made while the one before runs, and a request that samples in
it has computed all its known tokens: its next one is on its way, and is scheduled as a
placeholder (its value unknown until update_from_output brings it), unless it reaches the
request's length limit.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from operator import attrgetter

from batchinfer.engine.kv_cache_manager import KVCacheManager
from batchinfer.engine.request import Request, RequestStatus
from batchinfer.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the model runner has not seen, or one resumed after preemption."""
    req_id: str
    token_ids: list[int]          # prompt + output so far
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    """The requests the runner already holds, as parallel lists (one entry per request):
    a decode step adds three list entries per request rather than an object."""
    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """The step plan: plain data, so it can be sent to other tensor-parallel ranks."""
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: CachedRequestData = field(default_factory=CachedRequestData)
    # the cached requests' in their order, then the new requests' (the runner relies on it)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    finished_req_ids: set[str] = field(default_factory=set)   # since the last plan
    preempted_req_ids: set[str] = field(default_factory=set)


@dataclass
class RunnerOutput:
    """What a step sampled: plain data, shared with the other ranks under pipeline
    parallelism (batchinfer.engine.wire)."""
    req_ids: list[str]                 # the requests that sampled a token this step
    token_ids: list[int]
    logprobs: list[tuple[list[int], list[float], int]] | None = None  # top ids, values (+sampled), rank
    # req id -> (first prompt position scored, per position as in logprobs)
    prompt_logprobs: dict[str, tuple[int, list]] | None = None
    # req id -> why its structured output cannot go on (it sampled an end-of-sequence)
    errors: dict[str, str] | None = None


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.requests: dict[str, Request] = {}  # the unfinished ones, by id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.num_prompt_tokens_computed = 0
        self.num_generated_tokens = 0
        self.num_steps = 0
        # the requests of the plan being made that compute prompt tokens: those that sample
        # with it get their first token (update_from_output); then, per plan not yet
        # updated from its output, its list (one plan, or two with async scheduling)
        self._prompting: list[Request] = []
        self._plans_prompting: deque[tuple[SchedulerOutput, list[Request]]] = deque()

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        now = time.monotonic()
        self._prompting = []
        budget, prompt_computed = self._schedule_running(out)
        while (self.waiting and budget > 0 and not out.preempted_req_ids
               and len(self.running) < self.max_num_seqs):
            req = self.waiting[0]
            hits, num_hit = self.kv.get_computed_blocks(req)
            n = min(req.num_tokens - num_hit, budget)
            cached_logprobs = self.kv.cached_prompt_logprobs(req, num_hit) if num_hit else None
            if self.kv.allocate_slots(req, n, hits, num_hit) is None:
                break
            self.waiting.popleft()
            req.num_computed_tokens = num_hit + n
            if num_hit < req.num_prompt_tokens:
                prompt_computed += min(n, req.num_prompt_tokens - num_hit)
                self._prompting.append(req)
            if cached_logprobs is not None:
                req.prompt_logprobs.extend(cached_logprobs)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
                req.metrics.first_scheduled_time = now
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.new_requests.append(NewRequestData(
                req.request_id, list(req.token_ids), req.num_prompt_tokens, req.params,
                self.kv.block_ids(req.request_id), num_hit))
            out.num_scheduled_tokens[req.request_id] = n
            budget -= n

        self.num_prompt_tokens_computed += prompt_computed
        out.total_num_scheduled_tokens = self.max_num_batched_tokens - budget
        out.finished_req_ids, self.finished_req_ids = self.finished_req_ids, set()
        self._plans_prompting.append((out, self._prompting))
        return out

    def _schedule_running(self, out: SchedulerOutput) -> tuple[int, int]:
        """Plan the running requests (oldest first) into `out`; returns the token budget
        left and the prompt tokens planned. The requests at a block boundary (a block to
        allocate, or a full one to register in the prefix cache) get their blocks in one
        commit when the free blocks cover them all; when not, the plan is made again
        request by request, preempting from the tail where the blocks run out."""
        budget, prompt_computed, boundary = self._plan_running(out, batched=True)
        if not boundary:
            return budget, prompt_computed
        cached, by_id, scheduled = out.cached_requests, self.requests, out.num_scheduled_tokens
        requests = [by_id[cached.req_ids[i]] for i in boundary]
        counts = [scheduled[r.request_id] for r in requests]
        block_ids = self.kv.allocate_slots_running(requests, counts)
        if block_ids is None:
            for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens):
                by_id[req_id].num_computed_tokens = computed
            out.cached_requests, out.num_scheduled_tokens = CachedRequestData(), {}
            self._prompting = []
            budget, prompt_computed, _ = self._plan_running(out, batched=False)
            return budget, prompt_computed
        new_block_ids = cached.new_block_ids
        for i, req, n, ids in zip(boundary, requests, counts, block_ids):
            new_block_ids[i] = ids
            req.num_computed_tokens += n
        return budget, prompt_computed

    def _plan_running(self, out: SchedulerOutput, batched: bool) -> tuple[int, int, list[int]]:
        """The running requests' part of the plan: (budget left, prompt tokens planned, the
        plan indices of the requests at a block boundary). batched: those get no blocks
        and keep their computed tokens (_schedule_running allocates for them together);
        otherwise each is allocated for in turn, with preemption."""
        budget = self.max_num_batched_tokens
        allocate = self.kv.allocate_slots
        cached = out.cached_requests
        add_id, add_blocks = cached.req_ids.append, cached.new_block_ids.append
        add_computed = cached.num_computed_tokens.append
        counts = []
        add_count = counts.append
        boundary = []
        prompt_computed = 0
        running = self.running
        # a for loop over a list that preemption shortens from its tail: it ends where the
        # list does, and at the request that preempts itself
        for req in running:
            if budget <= 0:
                break
            computed = req.num_computed_tokens
            total = len(req.token_ids)
            if computed == total:  # (async scheduling) a token on its way
                total += 1
                if total >= req.length_limit:
                    continue  # its last
            n = total - computed
            if n > budget:
                n = budget
            if computed < req.num_prompt_tokens:
                prompt_computed += min(n, req.num_prompt_tokens - computed)
                self._prompting.append(req)
            if computed + n <= req.kv_room:
                block_ids = []  # the common decode step: room in its blocks (allocate's test)
                req.num_computed_tokens = computed + n
            elif batched:
                block_ids = None  # _schedule_running's
                boundary.append(len(counts))
            else:
                while (new_blocks := allocate(req, n)) is None:
                    victim = running.pop()
                    self._preempt(victim, out)
                    if victim is req:
                        break
                if new_blocks is None:
                    break
                block_ids = [b.block_id for b in new_blocks]
                req.num_computed_tokens = computed + n
            add_id(req.request_id)
            add_blocks(block_ids)
            add_computed(computed)
            add_count(n)
            budget -= n
        out.num_scheduled_tokens.update(zip(cached.req_ids, counts))
        return budget, prompt_computed, boundary

    def update_from_output(self, plan: SchedulerOutput, req_ids: list[str],
                           token_ids: list[int]) -> list[Request]:
        """After the step `plan` ran: each request in `req_ids` gets its sampled token
        (their computed tokens caught up with what was scheduled when it was planned).
        Returns those requests, in `req_ids` order."""
        self.num_steps += 1
        self.num_generated_tokens += len(token_ids)
        sampled = list(map(self.requests.__getitem__, req_ids))
        # one append per request, looped over in C
        deque(map(list.append, map(_token_ids, sampled), token_ids), maxlen=0)
        plans = self._plans_prompting
        while plans and plans[0][0] is not plan:  # plans that computed nothing, or failed
            plans.popleft()
        prompting = plans.popleft()[1] if plans else ()
        if prompting:
            now = time.monotonic()
            for req in prompting:  # those that sampled now have their first token
                if req.metrics.first_token_time is None and req.num_output_tokens > 0:
                    req.metrics.first_token_time = now
        return sampled

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted_req_ids.add(req.request_id)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Mark a running or waiting request finished and release its blocks."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif not req.status.finished:
            self.waiting.remove(req)
        req.status = status
        req.metrics.finished_time = time.monotonic()
        self.kv.free(req)
        self.finished_req_ids.add(req.request_id)
        del self.requests[req.request_id]


_token_ids = attrgetter("token_ids")
