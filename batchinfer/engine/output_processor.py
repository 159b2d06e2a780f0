"""From sampled tokens to outputs: each request's logprobs, its text and stop strings, and
per add_request call (n sample streams) one RequestOutput once every sample finished."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from batchinfer.engine.model_runner import RunnerOutput
from batchinfer.engine.request import Request, RequestStatus
from batchinfer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from batchinfer.reasoning import ReasoningParser


@dataclass
class _Parent:
    """One add_request call: its n sample streams and their finished completions."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    # (parser, whether the output starts inside the reasoning), with a reasoning parser
    reasoning: tuple[ReasoningParser, bool] | None = None
    done: dict[int, CompletionOutput] = field(default_factory=dict)


class OutputProcessor:
    """Owns what turns tokens into text: the tokenizer's per-token texts, the parents of
    sample streams, and the stop decisions. `on_prompt_logprobs(request)` is told when a
    request recorded prompt logprobs (the KV cache manager keeps them on cached blocks)."""

    def __init__(self, tokenizer: Any, on_prompt_logprobs: Callable[[Request], None]):
        self.tokenizer = tokenizer
        self.on_prompt_logprobs = on_prompt_logprobs
        self.parents: dict[str, _Parent] = {}
        self._token_texts: dict[int, str] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            children: list[Request],
            reasoning: tuple[ReasoningParser, bool] | None = None) -> None:
        self.parents[request_id] = _Parent(request_id, prompt, prompt_token_ids, children,
                                           reasoning)

    def pop(self, request_id: str) -> list[Request]:
        """Forget an aborted call; its sample streams."""
        parent = self.parents.pop(request_id, None)
        return parent.children if parent is not None else []

    def process(self, sampled: list[Request], result: RunnerOutput,
                requests: dict[str, Request]) -> list[tuple[Request, RequestStatus]]:
        """Record what a step computed (`result`) for the requests that sampled a token
        (`sampled`, in result.req_ids' order, the token appended already) and those that
        scored prompt positions; returns the requests that stop, with why. A request in
        result.errors (its structured output cannot go on) stops with its error."""
        tokens, logprobs, errors = result.token_ids, result.logprobs, result.errors
        for req_id, (first, rows) in (result.prompt_logprobs or {}).items():
            req = requests[req_id]
            self._record_prompt_logprobs(req, first, rows)
            self.on_prompt_logprobs(req)
        stopped = []
        if logprobs is None and not errors:
            # the common step: _check_stop's answer for most tokens, without the call
            for req, token in zip(sampled, tokens):
                if (req.detokenizer is None and token not in req.stop_token_ids
                        and len(req.token_ids) < req.length_limit):
                    continue
                status = self._check_stop(req, token)
                if status is not None:
                    stopped.append((req, status))
            return stopped
        for i, (req, token) in enumerate(zip(sampled, tokens)):
            if req.logprobs is not None:
                top_ids, values, rank = logprobs[i]
                req.logprobs.add(token, top_ids, values, rank, req.params.logprobs,
                                 self._token_text)
                req.cumulative_logprob += values[-1]
            if errors and req.request_id in errors:
                req.error = errors[req.request_id]
                stopped.append((req, RequestStatus.FINISHED_ERROR))
                continue
            if (req.detokenizer is None and token not in req.stop_token_ids
                    and len(req.token_ids) < req.length_limit):
                continue  # _check_stop's answer for most tokens, without the call
            status = self._check_stop(req, token)
            if status is not None:
                stopped.append((req, status))
        return stopped

    def finish(self, req: Request) -> RequestOutput | None:
        """Record a finished sample stream; its call's output once all its samples are."""
        parent = self.parents[req.parent_id]
        ids = req.output_token_ids
        by_token = (req.status == RequestStatus.FINISHED_STOPPED
                    and not isinstance(req.stop_reason, str))  # not by a stop string
        if by_token and not req.params.include_stop_str_in_output:
            ids = ids[:-1]  # as in vLLM, a stop token's text is left out by default
        skip = req.params.skip_special_tokens

        def decode(part):
            return self.tokenizer.decode(part, skip_special_tokens=skip)

        text = req.detokenizer.text if req.detokenizer is not None else None
        reasoning = None
        if parent.reasoning is not None:
            parser, in_reasoning = parent.reasoning
            reasoning, text = parser.split(ids, decode, in_reasoning, text)
        elif text is None:
            text = decode(ids)
        parent.done[req.sample_index] = CompletionOutput(
            req.sample_index, text, req.output_token_ids, req.cumulative_logprob, req.logprobs,
            req.status.value, req.stop_reason, req.metrics, reasoning)
        if len(parent.done) < len(parent.children):
            return None
        del self.parents[parent.request_id]
        outputs = [parent.done[i] for i in range(len(parent.children))]
        first = parent.children[0]
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outputs,
                             True, max(first.num_cached_tokens, 0),
                             merge_metrics([c.metrics for c in parent.children]),
                             next((c.error for c in parent.children if c.error), None),
                             prompt_logprobs=first.prompt_logprobs)

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        num_output = len(req.token_ids) - req.num_prompt_tokens
        past_min = num_output >= req.params.min_tokens
        detokenizer = req.detokenizer
        if past_min and token in req.stop_token_ids:
            if token in req.params.stop_token_ids:
                req.stop_reason = token
            if detokenizer is not None and req.params.include_stop_str_in_output:
                detokenizer.add(token, check_stop=False)
            status = RequestStatus.FINISHED_STOPPED
        else:
            if detokenizer is not None:
                stop = detokenizer.add(token, check_stop=past_min)
                if stop is not None:
                    req.stop_reason = stop
                    return RequestStatus.FINISHED_STOPPED
            if num_output < req.max_tokens:
                return None
            status = RequestStatus.FINISHED_LENGTH
        # ending: the text held back for an incomplete character is the request's too
        if detokenizer is not None and (stop := detokenizer.flush(past_min)) is not None:
            req.stop_reason = stop
            status = RequestStatus.FINISHED_STOPPED
        return status

    def _token_text(self, token: int) -> str:
        """One token decoded alone (the text logprobs report), cached per token id."""
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.tokenizer.decode([token])
        return text

    def _record_prompt_logprobs(self, req: Request, first: int, rows) -> None:
        """Prompt positions first, first + 1, ...: each (top ids, values (+ the prompt
        token's), its rank), as the model runner computed them for one prefill chunk."""
        k, recorded = req.params.prompt_logprobs, req.prompt_logprobs
        for offset, (top_ids, values, rank) in enumerate(rows):
            position = first + offset
            if position < len(recorded):
                continue  # a chunk computed again (after a preemption) gives the same
            while len(recorded) < position:
                recorded.add_none()
            recorded.add(req.token_ids[position], top_ids, values, rank, k, self._token_text)


def merge_metrics(parts: list[RequestMetrics]) -> RequestMetrics:
    """One call's metrics from its sample streams': the first times, the last finish."""
    def first(values):
        values = [v for v in values if v is not None]
        return min(values) if values else None

    finished = [m.finished_time for m in parts if m.finished_time is not None]
    return RequestMetrics(
        arrival_time=parts[0].arrival_time,
        first_scheduled_time=first(m.first_scheduled_time for m in parts),
        first_token_time=first(m.first_token_time for m in parts),
        finished_time=max(finished) if finished else None,
        num_preemptions=sum(m.num_preemptions for m in parts))
