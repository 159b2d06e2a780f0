"""The engine loop: add requests, step (schedule -> execute -> process outputs), collect
finished ones. It knows nothing of files; the job runner and LLM drive it."""
from __future__ import annotations

import numbers
import time
import weakref
from dataclasses import dataclass, field

import torch

from batchinfer.config import DTYPES, EngineConfig, check_device
from batchinfer.engine.detokenizer import IncrementalDetokenizer
from batchinfer.engine.kv_cache_manager import KVCacheManager
from batchinfer.engine.model_runner import ModelRunner
from batchinfer.engine.regex_guide import RegexGuide, VocabBytes, token_bytes
from batchinfer.engine.request import Request, RequestStatus
from batchinfer.engine.scheduler import Scheduler
from batchinfer.engine.tensor_parallel import (RunnerArgs, TensorParallelGroup, WorkerError,
                                                check_divisible)
from batchinfer.model.config import ModelConfig
from batchinfer.model.loader import resolve_model_path, resolve_tokenizer_path
from batchinfer.model.parallel import TensorParallel
from batchinfer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from batchinfer.sampling_params import SamplingParams

# distinct regex patterns whose guides (and the DFA states they reached) are kept
MAX_REGEX_GUIDES = 64


@dataclass
class _Parent:
    """One add_request call: its n sample streams and their finished completions."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    done: dict[int, CompletionOutput] = field(default_factory=dict)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        from transformers import AutoConfig, AutoTokenizer
        self.config = config
        path = resolve_model_path(config.model)
        self.model_config = ModelConfig.from_hf(
            AutoConfig.from_pretrained(path, trust_remote_code=config.trust_remote_code))
        tokenizer_path = resolve_tokenizer_path(config.tokenizer) if config.tokenizer else path
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path,
                                                       trust_remote_code=config.trust_remote_code)
        self.eos_token_ids = _eos_token_ids(path, self.model_config, self.tokenizer)
        self.device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        check_device(self.device)
        self.dtype = _resolve_dtype(config.dtype, self.model_config, self.device)
        max_len = self.model_config.max_position_embeddings
        if config.max_model_len is not None:
            if config.max_model_len > max_len:
                raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's "
                                 f"max_position_embeddings ({max_len})")
            max_len = config.max_model_len
        short = self.model_config.short_context_limit
        if short is not None and max_len > short:
            if config.max_model_len is not None:
                raise ValueError(f"max_model_len {config.max_model_len} exceeds {short}: this "
                                 "model's LongRoPE runs with its short-context factors only, "
                                 "up to original_max_position_embeddings")
            max_len = short
        torch.manual_seed(config.seed)
        self.tensor_parallel: TensorParallelGroup | None = None
        if TensorParallel.size > 1:  # the parallel layers' state is the process's
            raise RuntimeError("a tensor-parallel engine is running in this process; call "
                               "shutdown() on it before starting another engine")
        if config.tensor_parallel_size > 1:
            check_divisible(self.model_config, config.tensor_parallel_size)
            self.tensor_parallel = TensorParallelGroup(config.tensor_parallel_size, RunnerArgs(
                config, self.model_config, path, self.device, self.dtype, max_len,
                self.eos_token_ids))
            # an engine dropped without shutdown() still stops its workers
            weakref.finalize(self, self.tensor_parallel.shutdown)
        try:
            self.model_runner = ModelRunner(
                config, self.model_config, path, self.device, self.dtype, max_len,
                self.eos_token_ids,
                plan_sink=self.tensor_parallel.send_plan if self.tensor_parallel else None)
            if self.tensor_parallel is not None:
                self.tensor_parallel.wait_until_built()
        except BaseException as e:
            # a worker that failed or died first explains rank 0's error (a broken collective:
            # the worker's sockets close a moment before it is seen to have exited)
            failed = None
            if self.tensor_parallel is not None:
                broken = isinstance(e, RuntimeError) and not isinstance(e, WorkerError)
                failed = self.tensor_parallel.failed_worker("while starting",
                                                            grace_s=5.0 if broken else 0.0)
            self.shutdown()
            if failed is not None and not isinstance(e, WorkerError):
                raise WorkerError(failed) from e
            raise
        self.max_model_len = self.model_runner.max_model_len  # resolved: the caller's config
        self.kv = KVCacheManager(self.model_runner.num_blocks, config.block_size,
                                 config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.requests: dict[str, Request] = {}
        self.parents: dict[str, _Parent] = {}
        self._failed: list[RequestOutput] = []
        self.num_prompt_tokens_computed = 0
        self.num_generated_tokens = 0
        self._token_texts: dict[int, str] = {}
        self._regex_guides: dict[str, RegexGuide] = {}
        self._vocab_bytes: VocabBytes | None = None
        self.num_steps = 0

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "LLMEngine":
        unknown = set(kwargs) - EngineConfig.field_names()
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        return cls(EngineConfig(model=model, **kwargs))

    # ---- requests --------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, *,
                    prompt_token_ids: list[int] | None = None) -> None:
        """Queue a prompt. A bad prompt does not raise: it comes back from step() as an
        output with .error set and finish_reason "error". `prompt_token_ids`: a text
        prompt's ids, already encoded (encode_prompts); the text is kept for the output."""
        # n > 1 samples run as requests "ID#0", "ID#1", ...: none may share an id either
        child_ids = ([request_id] if params.n == 1
                     else [f"{request_id}#{i}" for i in range(params.n)])
        taken = next((c for c in child_ids if c in self.requests), None)
        if request_id in self.parents or taken == request_id:
            raise ValueError(f"request id {request_id!r} is already in use")
        if taken is not None:
            raise ValueError(f"request id {request_id!r}: the id of its sample {taken!r} is "
                             "already in use")
        arrival = arrival_time or time.monotonic()
        text = prompt if isinstance(prompt, str) else None
        token_ids: list[int] = []
        try:
            token_ids = self._truncate(self._prompt_token_ids(
                prompt if prompt_token_ids is None else prompt_token_ids), params)
            self.check_params(params)
            params = self._resolve_choices(params)
            if len(token_ids) >= self.max_model_len:
                raise ValueError(f"prompt has {len(token_ids)} tokens but max_model_len is "
                                 f"{self.max_model_len} (room for at least one output token "
                                 "is needed)")
        except (ValueError, TypeError) as e:  # TypeError: text the tokenizer cannot take
            self._fail(request_id, text, token_ids, params, str(e), arrival)
            return
        children = []
        for i in range(params.n):
            child_params = params
            if params.n > 1:
                child_params = params.clone(
                    n=1, seed=None if params.seed is None else params.seed + i,
                    # the first sample scores the prompt; the others read the prefix cache
                    prompt_logprobs=params.prompt_logprobs if i == 0 else None)
            child = Request(child_ids[i], token_ids, child_params, self.eos_token_ids,
                            self.max_model_len, arrival, request_id, i)
            if child_params.stop:
                child.detokenizer = IncrementalDetokenizer(
                    self.tokenizer, child_params.stop, child_params.skip_special_tokens,
                    child_params.include_stop_str_in_output)
            children.append(child)
        self.parents[request_id] = _Parent(request_id, text, token_ids, children)
        for child in children:
            self.requests[child.request_id] = child
            self.scheduler.add_request(child)

    def _truncate(self, token_ids: list[int], params: SamplingParams) -> list[int]:
        """The last truncate_prompt_tokens of the prompt, as vLLM truncates; -1: as many as
        leave room for max_tokens within max_model_len (at least one)."""
        keep = params.truncate_prompt_tokens
        if keep is None:
            return token_ids
        if keep == -1:
            keep = max(1, self.max_model_len - (params.max_tokens or 1))
        return token_ids[-keep:] if len(token_ids) > keep else token_ids

    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: the bounds this model's vocabulary sets
        (ValueError)."""
        keep = params.truncate_prompt_tokens
        if keep is not None and keep >= self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens {keep} leaves no room for output: "
                             f"max_model_len is {self.max_model_len} (use at most "
                             f"{self.max_model_len - 1}, or -1)")
        vocab = self.model_config.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > vocab:
                raise ValueError(f"{name} {k} exceeds the vocabulary size ({vocab})")
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids in [0, {vocab}), got "
                             f"{params.stop_token_ids}")
        for name, ids in (("logit_bias", params.logit_bias or ()),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            if any(t >= vocab for t in ids):
                raise ValueError(f"{name} must name token ids in [0, {vocab})")
        if params.allowed_token_ids is not None and params.min_tokens:
            stops = set(params.stop_token_ids) | (set() if params.ignore_eos
                                                  else set(self.eos_token_ids))
            if set(params.allowed_token_ids) <= stops:
                raise ValueError("allowed_token_ids holds only stop tokens, which min_tokens "
                                 "forbids before it is reached")

    def _resolve_choices(self, params: SamplingParams) -> SamplingParams:
        """params with its structured-output choices as token ids (a copy). Each choice is
        encoded so that it decodes to exactly its text (a tokenizer that adds a leading
        space on its own is encoded after a newline instead)."""
        if params.structured_outputs is None:
            return params
        if params.structured_outputs.choice is None:  # a regex, or a JSON schema's
            return params.clone(regex_guide=self._regex_guide(params.structured_outputs.pattern()))
        choices = [self._choice_ids(c) for c in params.structured_outputs.choice]
        vocab = self.model_config.vocab_size
        for text, ids in zip(params.structured_outputs.choice, choices):
            if any(t >= vocab or t in self.eos_token_ids or t in params.stop_token_ids
                   for t in ids):
                raise ValueError(f"choice {text!r} holds an end-of-sequence or stop token, "
                                 "or a token beyond the model's vocabulary")
        return params.clone(choice_token_ids=choices)

    def _regex_guide(self, pattern: str) -> RegexGuide:
        """The pattern's guide, kept for the next requests with it (the most recent
        MAX_REGEX_GUIDES patterns); the vocabulary's bytes are read on first use."""
        if self.tensor_parallel is not None:
            raise ValueError("structured outputs by regex are not supported with tensor "
                             "parallelism")
        guide = self._regex_guides.pop(pattern, None)
        if guide is None:
            if self._vocab_bytes is None:
                pieces = token_bytes(self.tokenizer)
                vocab = self.model_config.vocab_size
                pieces = [None if i >= vocab or i in self.eos_token_ids else p
                          for i, p in enumerate(pieces[:vocab])]
                self._vocab_bytes = VocabBytes(pieces)
            guide = RegexGuide(pattern, self._vocab_bytes)
            if len(self._regex_guides) >= MAX_REGEX_GUIDES:
                self._regex_guides.pop(next(iter(self._regex_guides)))
        self._regex_guides[pattern] = guide
        return guide

    def _choice_ids(self, text: str) -> list[int]:
        encode, decode = self.tokenizer.encode, self.tokenizer.decode
        ids = encode(text, add_special_tokens=False)
        if ids and decode(ids) == text:
            return ids
        lead = encode("\n", add_special_tokens=False)
        after = encode("\n" + text, add_special_tokens=False)
        if after[:len(lead)] == lead and decode(after[len(lead):]) == text:
            return after[len(lead):]
        raise ValueError(f"choice {text!r} has no encoding that decodes to exactly that text")

    def _prompt_token_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            _check_unicode(prompt, "prompt")
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            vocab = self.model_config.vocab_size
            if prompt and set(map(type, prompt)) == {int}:
                # plain ints (the common case) checked in C loops: ~10x faster than the
                # per-element test below, which a 10k-token prompt would feel
                if not (min(prompt) >= 0 and max(prompt) < vocab):
                    raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
                token_ids = list(prompt)
            elif not all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                         and 0 <= t < vocab for t in prompt):
                raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
            else:
                token_ids = [int(t) for t in prompt]
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt has no tokens")
        return token_ids

    def _fail(self, request_id: str, prompt: str | None, token_ids: list[int],
              params: SamplingParams, error: str, arrival: float) -> None:
        now = time.monotonic()
        metrics = RequestMetrics(arrival_time=arrival, finished_time=now)
        outputs = [CompletionOutput(i, "", [], None, None, "error", metrics=metrics)
                   for i in range(params.n)]
        self._failed.append(RequestOutput(request_id, prompt, token_ids, outputs, True, 0,
                                          metrics, error))

    def abort_request(self, request_ids: list[str]) -> None:
        dropped = set(request_ids)
        self._failed = [out for out in self._failed if out.request_id not in dropped]
        for request_id in request_ids:
            parent = self.parents.pop(request_id, None)
            for child in parent.children if parent else ():
                if not child.status.finished:
                    self.scheduler.finish(child, RequestStatus.FINISHED_ABORTED)
                self.requests.pop(child.request_id, None)

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes (nothing to do without them). The
        engine cannot step after this; a process can then start another parallel engine."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.shutdown()
            self.tensor_parallel = None

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents or self._failed)

    def get_num_unfinished_requests(self) -> int:
        return len(self.parents) + len(self._failed)

    # ---- the step --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the requests that finished during it."""
        finished, self._failed = self._failed, []
        if not self.scheduler.has_unfinished():
            return finished
        plan = self.scheduler.schedule()
        if plan.total_num_scheduled_tokens == 0:
            raise RuntimeError("the scheduler could not schedule any request")
        try:
            result = self.model_runner.execute(plan)
        except BaseException as e:
            if self.tensor_parallel is not None:
                self.tensor_parallel.mark_broken(f"{type(e).__name__}: {e}")
            raise
        now = time.monotonic()
        self.num_steps += 1
        for req_id, n in plan.num_scheduled_tokens.items():
            req = self.requests[req_id]
            if req.num_computed_tokens < req.num_prompt_tokens:
                self.num_prompt_tokens_computed += min(n, req.num_prompt_tokens - req.num_computed_tokens)
            req.num_computed_tokens += n
        self.num_generated_tokens += len(result.token_ids)
        requests = self.requests
        for req_id, (first, rows) in (result.prompt_logprobs or {}).items():
            self._record_prompt_logprobs(requests[req_id], first, rows)
            self.kv.share_prompt_logprobs(requests[req_id])
        for i, (req_id, token) in enumerate(zip(result.req_ids, result.token_ids)):
            req = requests[req_id]
            req.token_ids.append(token)
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            if req.logprobs is not None:
                self._record_logprobs(req, token, result.logprobs[i])
            if (req.detokenizer is None and token not in req.stop_token_ids
                    and len(req.token_ids) < req.length_limit):
                continue  # _check_stop's answer for most tokens, without the call
            status = self._check_stop(req, token)
            if status is not None:
                req.metrics.finished_time = now
                self.scheduler.finish(req, status)
                output = self._finish_child(req)
                if output is not None:
                    finished.append(output)
        return finished

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

    def _record_logprobs(self, req: Request, token: int, entry) -> None:
        top_ids, values, rank = entry
        req.logprobs.add(token, top_ids, values, rank, req.params.logprobs, self._token_text)
        req.cumulative_logprob += values[-1]

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

    def _finish_child(self, req: Request) -> RequestOutput | None:
        parent = self.parents[req.parent_id]
        if req.detokenizer is not None:
            text = req.detokenizer.text
        else:
            ids = req.output_token_ids
            if (req.status == RequestStatus.FINISHED_STOPPED
                    and not req.params.include_stop_str_in_output):
                ids = ids[:-1]  # as in vLLM, a stop token's text is left out by default
            text = self.tokenizer.decode(ids, skip_special_tokens=req.params.skip_special_tokens)
        parent.done[req.sample_index] = CompletionOutput(
            req.sample_index, text, req.output_token_ids, req.cumulative_logprob, req.logprobs,
            req.status.value, req.stop_reason, req.metrics)
        del self.requests[req.request_id]
        if len(parent.done) < len(parent.children):
            return None
        del self.parents[parent.request_id]
        outputs = [parent.done[i] for i in range(len(parent.children))]
        first = parent.children[0]
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outputs,
                             True, max(first.num_cached_tokens, 0),
                             _merge_metrics([c.metrics for c in parent.children]),
                             prompt_logprobs=first.prompt_logprobs)

    # ---- introspection ---------------------------------------------------------------
    def stats(self) -> dict:
        return {
            "prefix_cache_queried_tokens": self.kv.queried_tokens,
            "prefix_cache_hit_tokens": self.kv.hit_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_free_blocks": self.kv.num_free_blocks,
            "num_total_blocks": self.kv.pool.num_blocks,
            "num_cached_blocks": len(self.kv.pool.cached),
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": self.kv.usage,
            "num_prompt_tokens_computed": self.num_prompt_tokens_computed,
            "num_generated_tokens": self.num_generated_tokens,
            "num_steps": self.num_steps,
            "block_size": self.config.block_size,
            "max_model_len": self.max_model_len,
        }

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, *,
                    chat_template: str | None = None,
                    chat_template_kwargs: dict | None = None,
                    continue_final_message: bool = False) -> list[int]:
        """Token ids of a conversation through the tokenizer's chat template (or the given
        Jinja `chat_template`), with `chat_template_kwargs` as extra template variables
        (e.g. {"enable_thinking": False} for Qwen3). `continue_final_message` leaves the
        last message open for the model to continue, instead of starting a new turn."""
        text = self.render_chat_text(messages, add_generation_prompt, chat_template=chat_template,
                                     chat_template_kwargs=chat_template_kwargs,
                                     continue_final_message=continue_final_message)
        return self.encode_prompts([text], add_special_tokens=False)[0]

    def encode_prompts(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of many texts in one tokenizer call, the same ids as encoding each
        alone: a fast (Rust) tokenizer encodes the batch on all cores without the GIL.
        Rendered chats take add_special_tokens=False (the template wrote them); a text that
        is not valid Unicode raises ValueError."""
        for text in texts:
            _check_unicode(text, "prompt")
        if not texts:
            return []
        return self.tokenizer(texts, add_special_tokens=add_special_tokens,
                              return_attention_mask=False,
                              return_token_type_ids=False)["input_ids"]

    def render_chat_text(self, messages: list[dict], add_generation_prompt: bool = True, *,
                         chat_template: str | None = None,
                         chat_template_kwargs: dict | None = None,
                         continue_final_message: bool = False) -> str:
        """render_chat's conversation as text, before tokenizing (see encode_prompts)."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
        messages = [_text_message(m) for m in messages]
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("the model's tokenizer has no chat template")
        kwargs = check_chat_template_kwargs(chat_template_kwargs)
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be "
                             "set: the last message is either continued or answered")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, chat_template=chat_template,
                **kwargs)
        except Exception as e:  # a template error (jinja2's TemplateError and its kin)
            if isinstance(e, ValueError):
                raise
            raise ValueError(f"the chat template failed: {type(e).__name__}: {e}") from None
        _check_unicode(text, "the conversation")  # roles and content parts included
        return text


# apply_chat_template's own arguments: not template variables
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tokenize", "add_generation_prompt", "chat_template",
    "continue_final_message", "return_tensors", "return_dict", "tools", "documents",
    "padding", "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask"})


def check_chat_template_kwargs(kwargs) -> dict:
    """chat_template_kwargs as a dict of template variables, or a ValueError naming what
    is wrong."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError("chat_template_kwargs must be an object of template variables, e.g. "
                         '{"enable_thinking": false}')
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if reserved:
        raise ValueError(f"chat_template_kwargs cannot set {', '.join(reserved)}")
    return kwargs


def _text_message(message) -> dict:
    """A chat message with string content. OpenAI's list of content parts is taken when
    every part is text ({"type": "text", "text": ...}); the texts are joined by newlines,
    as vLLM does for templates that take a string."""
    if not (isinstance(message, dict) and isinstance(message.get("role"), str)):
        raise ValueError("each message must be a dict with string 'role' and 'content'")
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text"
                   and isinstance(p.get("text"), str) for p in content):
            raise ValueError("message content parts must be text parts "
                             "({'type': 'text', 'text': ...}); other kinds are not supported")
        return {**message, "content": "\n".join(p["text"] for p in content)}
    if not isinstance(content, str):
        raise ValueError("each message must be a dict with string 'role' and 'content'")
    return message


def _check_unicode(text: str, what: str) -> None:
    """Text a tokenizer can take: encodable as UTF-8 (a lone surrogate such as the JSON
    escape \\ud800 is not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode ({e.reason}: {text[e.start:e.end]!r} "
                         f"at character {e.start})") from None


def _merge_metrics(parts: list[RequestMetrics]) -> RequestMetrics:
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


def _eos_token_ids(path, model_config: ModelConfig, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    try:
        from transformers import GenerationConfig
        gen = GenerationConfig.from_pretrained(path)
        eos = gen.eos_token_id
    except (OSError, ValueError):
        eos = model_config.eos_token_id
    if eos is not None:
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def _resolve_dtype(name: str, model_config: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    dtype = model_config.dtype
    if isinstance(dtype, str):
        dtype = DTYPES.get(dtype, torch.float32)
    if dtype not in DTYPES.values():
        dtype = torch.float32
    if dtype == torch.float16 and device.type == "cpu":
        dtype = torch.bfloat16
    return dtype
