"""The engine loop: add requests, step (schedule -> execute -> process outputs), collect
finished ones. It knows nothing of files; the job runner and LLM drive it."""
from __future__ import annotations

import numbers
import time
import weakref

import torch

from batchinfer.config import DTYPES, EngineConfig, check_device
from batchinfer.engine.chat import check_unicode, encode_prompts, render_chat_text
from batchinfer.engine.detokenizer import IncrementalDetokenizer
from batchinfer.engine.kv_cache_manager import KVCacheManager
from batchinfer.engine.nodes import NodeGroup
from batchinfer.engine.model_runner import (CPU_DEFAULT_KV_BYTES, DeferredOutput, ModelRunner,
                                            RunnerOutput)
from batchinfer.engine.output_processor import OutputProcessor
from batchinfer.engine.request import Request, RequestStatus
from batchinfer.engine.scheduler import Scheduler, SchedulerOutput
from batchinfer.engine.tensor_parallel import (RunnerArgs, TensorParallelGroup, WorkerError,
                                                check_divisible)
from batchinfer.model.checks import check_memory, check_shapes
from batchinfer.model.config import ModelConfig
from batchinfer.model.generation_config import generation_defaults
from batchinfer.model.loader import (hf_config, hf_tokenizer, resolve_model_path,
                                     resolve_tokenizer_path, tensor_shapes)
from batchinfer.model.parallel import PipelineParallel, TensorParallel, stage_layers
from batchinfer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from batchinfer.reasoning import END_TAG, ReasoningParser
from batchinfer.sampling_params import SamplingParams
from batchinfer.structured.grammar import GrammarCompiler


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        path = resolve_model_path(config.model)
        # SamplingParams values the model recommends (LLM.get_default_sampling_params)
        self.default_sampling = generation_defaults(path, config.generation_config)
        self.model_config = ModelConfig.from_hf(hf_config(path, config.trust_remote_code),
                                                config.quantization)
        _check_mla(config, self.model_config)
        if config.load_format != "dummy":  # the weights' shapes, from the files' headers
            check_shapes(tensor_shapes(path), self.model_config, str(path))
        tokenizer_path = resolve_tokenizer_path(config.tokenizer) if config.tokenizer else path
        self.tokenizer = hf_tokenizer(tokenizer_path, config.trust_remote_code)
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
        world = config.tensor_parallel_size * config.pipeline_parallel_size
        check_memory(self.model_config, self.dtype.itemsize, max_len,
                     _kv_bytes_asked(config, self.model_config, self.dtype, max_len,
                                     self.device), world, self.device)
        torch.manual_seed(config.seed)
        self.tensor_parallel: TensorParallelGroup | None = None
        if TensorParallel.size > 1 or PipelineParallel.size > 1:  # the process's state
            raise RuntimeError("a tensor-parallel engine is running in this process; call "
                               "shutdown() on it before starting another engine")
        nodes = NodeGroup.of(config)
        if world > 1 or nodes is not None:
            check_divisible(self.model_config, config.tensor_parallel_size)
            stage_layers(self.model_config.num_hidden_layers, config.pipeline_parallel_size, 0)
            if nodes is not None:
                nodes.ranks_per_node(world)
            self.tensor_parallel = TensorParallelGroup(world, RunnerArgs(
                config, self.model_config, path, self.device, self.dtype, max_len,
                self.eos_token_ids), nodes)
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
        self.output_processor = OutputProcessor(self.tokenizer, self.kv.share_prompt_logprobs)
        self._failed: list[RequestOutput] = []  # requests refused by add_request
        # async scheduling: the step running (its plan, its output to come, and the ids of
        # its requests that ended since it started, whose tokens from it are dropped)
        self._running_step: tuple[SchedulerOutput, DeferredOutput, set[str]] | None = None
        # the unfinished sample streams whose sampling reads their last token (structured
        # outputs, penalties): while there is one, each step waits for the one before
        self._needs_last_token: set[str] = set()
        # regexes, JSON schemas and grammars for this tokenizer (rank 0's alone with tensor
        # parallelism, as is sampling)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                        self.eos_token_ids)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "LLMEngine":
        unknown = set(kwargs) - EngineConfig.field_names()
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        return cls(EngineConfig(model=model, **kwargs))

    # ---- requests --------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, *,
                    prompt_token_ids: list[int] | None = None,
                    reasoning_parser: ReasoningParser | None = None) -> None:
        """Queue a prompt. A bad prompt does not raise: it comes back from step() as an
        output with .error set and finish_reason "error". `prompt_token_ids`: a text
        prompt's ids, already encoded (encode_prompts); the text is kept for the output.
        `reasoning_parser` (get_reasoning_parser): the completions' text is split into
        reasoning_content and the answer, and a structured output constrains the answer."""
        # n > 1 samples run as requests "ID#0", "ID#1", ...: none may share an id either
        child_ids = ([request_id] if params.n == 1
                     else [f"{request_id}#{i}" for i in range(params.n)])
        taken = next((c for c in child_ids if c in self.scheduler.requests), None)
        if request_id in self.output_processor.parents or taken == request_id:
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
            in_reasoning = (reasoning_parser is not None
                            and reasoning_parser.starts_in_reasoning(token_ids))
            if in_reasoning and params.structured_outputs is not None:
                params = self._after_reasoning(params, reasoning_parser)
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
            if child_params.structured_outputs is not None or child_params.uses_penalties:
                self._needs_last_token.add(child.request_id)
        self.output_processor.add(request_id, text, token_ids, children,
                                  (reasoning_parser, in_reasoning) if reasoning_parser else None)
        for child in children:
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
        so = params.structured_outputs
        if self.config.pipeline_parallel_size > 1 and so is not None and so.choice is None:
            raise ValueError("regex and JSON-schema outputs are not supported with "
                             "pipeline_parallel_size > 1 yet, nor JSON-object and grammar ones "
                             "(choice outputs are); use tensor parallelism alone")
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
        if params.structured_outputs.choice is None:  # a regex, JSON schema or grammar
            return params.clone(compiled_grammar=self.grammars.compile(
                params.structured_outputs.grammar_text()))
        choices = [self._choice_ids(c) for c in params.structured_outputs.choice]
        vocab = self.model_config.vocab_size
        for text, ids in zip(params.structured_outputs.choice, choices):
            if any(t >= vocab or t in self.eos_token_ids or t in params.stop_token_ids
                   for t in ids):
                raise ValueError(f"choice {text!r} holds an end-of-sequence or stop token, "
                                 "or a token beyond the model's vocabulary")
        return params.clone(choice_token_ids=choices)

    def get_reasoning_parser(self, name: str,
                             chat_template_kwargs: dict | None = None) -> ReasoningParser:
        """The reasoning parser `name` (deepseek_r1 or qwen3; ValueError for another) over
        this engine's tokenizer; chat_template_kwargs: those the prompts were rendered with
        (qwen3 reads enable_thinking)."""
        return ReasoningParser(name, self.tokenizer, chat_template_kwargs)

    @staticmethod
    def _after_reasoning(params: SamplingParams, parser: ReasoningParser) -> SamplingParams:
        """params whose structured output starts after the reasoning's end token."""
        if parser.end_token_id is None:
            raise ValueError(f"structured outputs after reasoning need {END_TAG} to be one "
                             "token of the tokenizer's vocabulary, and it is not")
        return params.clone(reasoning_end_token_id=parser.end_token_id)

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
            check_unicode(prompt, "prompt")
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
            for child in self.output_processor.pop(request_id):
                if not child.status.finished:
                    self._finish(child, RequestStatus.FINISHED_ABORTED)

    def serve(self) -> None:
        """On a node other than node 0 of a multi-node engine (node_rank > 0): run the steps
        node 0 plans until it shuts the engine down. ConnectionError when node 0 goes
        away instead."""
        if self.tensor_parallel is None or self.tensor_parallel.first_rank == 0:
            raise RuntimeError("serve() is for the nodes other than node 0 (node_rank > 0)")
        self.tensor_parallel.serve(self.model_runner)

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes (nothing to do without them). The
        engine cannot step after this; a process can then start another parallel engine."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.shutdown()
            self.tensor_parallel = None

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.parents or self._failed)

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.parents) + len(self._failed)

    # ---- the step --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step (schedule, execute, update the scheduler, make outputs);
        returns the requests that finished during it. With async scheduling, a step plans
        and starts the next model step, then takes the output of the one before (which
        ran meanwhile on a GPU)."""
        finished, self._failed = self._failed, []
        if self.config.async_scheduling:
            return finished + self._step_async()
        if not self.scheduler.has_unfinished():
            return finished
        plan = self.scheduler.schedule()
        return finished + self._update(plan, self._execute(plan))

    def _step_async(self) -> list[RequestOutput]:
        before, self._running_step = self._running_step, None
        if (self.scheduler.has_unfinished()
                and (before is None or not self._needs_last_token)):
            plan = self.scheduler.schedule()
            if plan.total_num_scheduled_tokens:
                self._running_step = (plan, self._execute(plan, defer=True), set())
            elif before is None:  # (every request waits for a token, or nothing fits)
                raise RuntimeError("the scheduler could not schedule any request")
            else:  # every request's next token is on its way: only what ended is told
                self.model_runner.update_states(plan)
        finished = []
        if before is not None:
            plan, output, ended = before
            finished = self._update(plan, _without(output.result(), ended))
        if self._needs_last_token and self._running_step is not None:
            plan, output, ended = self._running_step  # this step's sampling needs it
            self._running_step = None
            finished += self._update(plan, _without(output.result(), ended))
        return finished

    def _update(self, plan: SchedulerOutput, result: RunnerOutput) -> list[RequestOutput]:
        """Bring the scheduler and the outputs up to a step's result; the requests that
        finished with it."""
        sampled = self.scheduler.update_from_output(plan, result.req_ids, result.token_ids)
        stopped = self.output_processor.process(sampled, result, self.scheduler.requests)
        finished = []
        for req, status in stopped:
            self._finish(req, status)
            output = self.output_processor.finish(req)
            if output is not None:
                finished.append(output)
        return finished

    def _finish(self, req: Request, status: RequestStatus) -> None:
        self.scheduler.finish(req, status)
        self._needs_last_token.discard(req.request_id)
        if self._running_step is not None:  # its token from the running step is dropped
            self._running_step[2].add(req.request_id)

    def _execute(self, plan: SchedulerOutput, defer: bool = False) -> RunnerOutput | DeferredOutput:
        if plan.total_num_scheduled_tokens == 0:
            raise RuntimeError("the scheduler could not schedule any request")
        try:
            if defer:
                return self.model_runner.execute(plan, defer=True)
            return self.model_runner.execute(plan)
        except BaseException as e:
            if self.tensor_parallel is None:
                raise
            self.tensor_parallel.mark_broken(f"{type(e).__name__}: {e}")
            # a broken collective: the rank or node that went away explains it
            if isinstance(e, RuntimeError) and not isinstance(e, WorkerError):
                lost = self.tensor_parallel.failure("during a step", grace_s=5.0)
                if lost is not None:
                    raise WorkerError(lost) from None
            raise

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
            "num_prompt_tokens_computed": self.scheduler.num_prompt_tokens_computed,
            "num_generated_tokens": self.scheduler.num_generated_tokens,
            "num_steps": self.scheduler.num_steps,
            "block_size": self.config.block_size,
            "kv_cache_dtype": str(self.model_runner.kv_dtype).removeprefix("torch."),
            "max_model_len": self.max_model_len,
            # this rank's weights (with tensor parallelism, each rank holds about 1/N)
            "weight_bytes": self.model_runner.weight_bytes,
            # this rank's KV cache per token: every layer's key and value rows, or latent row
            "kv_bytes_per_token": self.model_runner.block_bytes // self.config.block_size,
            "quantization": (self.model_config.quantization.method
                             if self.model_config.quantization else None),
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
        """Token ids of many texts in one tokenizer call (see chat.encode_prompts)."""
        return encode_prompts(self.tokenizer, texts, add_special_tokens)

    def render_chat_text(self, messages: list[dict], add_generation_prompt: bool = True, *,
                         chat_template: str | None = None,
                         chat_template_kwargs: dict | None = None,
                         continue_final_message: bool = False,
                         tools: list[dict] | None = None) -> str:
        """render_chat's conversation as text, before tokenizing (see encode_prompts)."""
        return render_chat_text(self.tokenizer, messages, add_generation_prompt,
                                chat_template=chat_template,
                                chat_template_kwargs=chat_template_kwargs,
                                continue_final_message=continue_final_message, tools=tools)


def _without(result: RunnerOutput, req_ids: set[str]) -> RunnerOutput:
    """result less what it holds for req_ids (requests that ended while it was computed)."""
    if not req_ids:
        return result
    keep = [i for i, r in enumerate(result.req_ids) if r not in req_ids]
    return RunnerOutput(
        [result.req_ids[i] for i in keep], [result.token_ids[i] for i in keep],
        [result.logprobs[i] for i in keep] if result.logprobs is not None else None,
        {r: v for r, v in result.prompt_logprobs.items() if r not in req_ids}
        if result.prompt_logprobs else result.prompt_logprobs,
        {r: v for r, v in result.errors.items() if r not in req_ids}
        if result.errors else result.errors)


def _eos_token_ids(path, model_config: ModelConfig, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    eos = model_config.eos_token_id
    if path.is_dir():  # a GGUF file has no generation config
        from transformers import GenerationConfig
        try:
            eos = GenerationConfig.from_pretrained(path).eos_token_id
        except (OSError, ValueError):
            pass
    if eos is not None:
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def _check_mla(config: EngineConfig, model_config: ModelConfig) -> None:
    """Refuse the settings multi-head latent attention does not run with yet."""
    if model_config.mla is None:
        return
    if config.kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype {config.kv_cache_dtype!r}: multi-head latent "
                         f"attention ({model_config.architecture}) keeps its latent cache in "
                         "the model's dtype for now; use kv_cache_dtype auto")


def _kv_bytes_asked(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype,
                    max_len: int, device: torch.device) -> int:
    """The KV cache the settings ask for, in bytes (0 on a GPU left to size it from the
    memory the weights leave, which it measures)."""
    kv_dtype = config.kv_cache_torch_dtype(dtype)
    block_bytes = config.block_size * model_config.kv_elements_per_token * kv_dtype.itemsize
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks * block_bytes
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes
    if device.type == "cuda":
        return 0
    useful = config.max_num_seqs * -(-max_len // config.block_size) + 1
    return min(CPU_DEFAULT_KV_BYTES, useful * block_bytes)


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
