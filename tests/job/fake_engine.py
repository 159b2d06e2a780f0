"""A stand-in engine with LLMEngine's interface that "completes" every request at once.

It lets the job machinery (reading, ordering, committing, metrics) be tested at scale
without a model: each step finishes up to max_num_seqs requests; the completion is a
deterministic function of the prompt, so runs can be compared. A prompt holding
"|reply:" is completed with the text after it instead (less a chat prompt's "<assistant>").
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from batchinfer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from batchinfer.reasoning import ReasoningParser
from batchinfer.sampling_params import SamplingParams


@dataclass
class FakeConfig:
    max_num_seqs: int = 64
    max_model_len: int = 1 << 20


class FakeTokenizer:
    chat_template = "fake"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", "replace")


class FakeEngine:
    def __init__(self, max_num_seqs: int = 64, max_model_len: int = 1 << 20):
        self.config = FakeConfig(max_num_seqs, max_model_len)
        self.tokenizer = FakeTokenizer()
        self._queue: deque[tuple] = deque()

    @classmethod
    def factory(cls, model: str, kwargs: dict[str, Any]) -> "FakeEngine":
        return cls(kwargs.get("max_num_seqs", 64), kwargs.get("max_model_len") or 1 << 20)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, *,
                    reasoning_parser: ReasoningParser | None = None) -> None:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        error = None
        if not ids:
            error = "prompt has no tokens"
        elif len(ids) >= self.config.max_model_len:
            error = f"prompt has {len(ids)} tokens but max_model_len is {self.config.max_model_len}"
        self._queue.append((request_id, ids, params, arrival_time or time.monotonic(), error,
                            reasoning_parser))

    def get_reasoning_parser(self, name: str,
                             chat_template_kwargs: dict | None = None) -> ReasoningParser:
        return ReasoningParser(name, self.tokenizer, chat_template_kwargs)

    def step(self) -> list[RequestOutput]:
        outputs = []
        now = time.monotonic()
        for _ in range(min(self.config.max_num_seqs, len(self._queue))):
            request_id, ids, params, arrival, error, parser = self._queue.popleft()
            metrics = RequestMetrics(arrival, now, now, now)
            if error is not None:
                outs = [CompletionOutput(0, "", [], None, None, "error", metrics=metrics)]
                outputs.append(RequestOutput(request_id, None, [], outs, True, 0, metrics, error))
                continue
            length = min(params.max_tokens or 16, 4)
            tokens = ids[-length:]
            text = bytes(ids).decode("utf-8", "replace")
            if "|reply:" in text:
                reply = text.split("|reply:", 1)[1].removesuffix("<assistant>")
                tokens = self.tokenizer.encode(reply)
                texts = [reply] * params.n
            else:
                texts = [f"echo{i}:" + bytes(tokens).decode("utf-8", "replace")
                         for i in range(params.n)]
            outs = [CompletionOutput(i, t, tokens, None, None, "length", metrics=metrics)
                    for i, t in enumerate(texts)]
            if parser is not None:
                for o in outs:
                    o.reasoning_content, o.text = parser.split(
                        o.token_ids, self.tokenizer.decode, parser.starts_in_reasoning(ids))
            outputs.append(RequestOutput(request_id, None, ids, outs, True, 0, metrics))
        return outputs

    def check_params(self, params: SamplingParams) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def has_unfinished_requests(self) -> bool:
        return bool(self._queue)

    def get_num_unfinished_requests(self) -> int:
        return len(self._queue)

    def abort_request(self, request_ids: list[str]) -> None:
        drop = set(request_ids)
        self._queue = deque(r for r in self._queue if r[0] not in drop)

    def stats(self) -> dict[str, Any]:
        return {"prefix_cache_queried_tokens": 0, "prefix_cache_hit_tokens": 0,
                "num_preemptions": 0, "num_free_blocks": 0, "num_total_blocks": 0,
                "num_running": 0, "num_waiting": len(self._queue), "kv_cache_usage": 0.0}

    def render_chat_text(self, messages: list[dict], add_generation_prompt: bool = True, *,
                         chat_template: str | None = None,
                         chat_template_kwargs: dict | None = None,
                         tools: list[dict] | None = None) -> str:
        """The messages as <role>content, after <tools>[names] when tools are given; an
        assistant's tool calls as <call>name."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        for m in messages:
            content_ok = isinstance(m.get("content"), str) or (
                m.get("content") is None and m.get("tool_calls"))
            if not (isinstance(m.get("role"), str) and content_ok):
                raise ValueError("each message must be a dict with string 'role' and 'content'")
        text = "" if tools is None else f"<tools>{[t['function']['name'] for t in tools]}"
        text += "".join(f"<{m['role']}>{m.get('content') or ''}"
                        + "".join(f"<call>{c['function']['name']}"
                                  for c in m.get("tool_calls") or ()) for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def encode_prompts(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [self.tokenizer.encode(t) for t in texts]


class SeededEngine(FakeEngine):
    """A FakeEngine whose completions depend on each sample's seed, so that a sample asked
    for again with another seed can come out differently. A prompt holding "|replies:"
    lists the completions, separated by "|": a sample without a seed gets the first, a
    seeded one the one its seed picks among the others (seed % (count - 1)). Every sample
    ends with "stop"; the samples of a request take seed, seed + 1, ... as the engine's."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.seeds: dict[str, int | None] = {}

    def step(self) -> list[RequestOutput]:
        outputs = super().step()
        for output in outputs:
            seed = self.seeds.pop(output.request_id)
            if output.error is not None:
                continue
            text = bytes(output.prompt_token_ids).decode("utf-8", "replace")
            if "|replies:" not in text:
                continue
            replies = text.split("|replies:", 1)[1].removesuffix("<assistant>").split("|")
            for c in output.outputs:
                pick = 0 if seed is None else 1 + (seed + c.index) % (len(replies) - 1)
                c.text, c.finish_reason = replies[pick], "stop"
                c.token_ids = self.tokenizer.encode(c.text)
        return outputs

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, **kwargs: Any) -> None:
        self.seeds[request_id] = params.seed
        super().add_request(request_id, prompt, params, arrival_time, **kwargs)
