"""The vLLM-compatible Python entry point."""
from __future__ import annotations

import itertools
import numbers

from tqdm.auto import tqdm

from batchinfer.demo import resolve_model
from batchinfer.engine.engine import LLMEngine
from batchinfer.engine.gc_freeze import startup_heap_frozen
from batchinfer.outputs import RequestOutput
from batchinfer.sampling_params import SamplingParams


class LLM:
    """LLM(model=..., dtype=..., block_size=..., ...) with the fields of EngineConfig;
    model="demo" runs the built-in random-weight demo model."""

    def __init__(self, model: str, **kwargs):
        self.llm_engine = LLMEngine.from_kwargs(resolve_model(model), **kwargs)
        self._ids = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's recommended values (its generation_config.json,
        or the generation_config directory given; none with generation_config="vllm"),
        SamplingParams' own defaults for the rest. generate() without params uses these; a
        SamplingParams passed in is used as given."""
        return SamplingParams(**self.llm_engine.default_sampling)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False, *,
                 reasoning_parser: str | None = None) -> list[RequestOutput]:
        """Outputs in the order of the prompts (strings or token-id lists).
        `reasoning_parser` ("deepseek_r1" or "qwen3"): each completion's text inside the
        think tags goes to its reasoning_content and `text` keeps the answer after them;
        a structured output applies to the answer."""
        return self._generate(prompts, sampling_params, use_tqdm,
                              self._reasoning_parser(reasoning_parser, None))

    def _reasoning_parser(self, name: str | None, chat_template_kwargs: dict | None):
        if name is None:
            return None
        return self.llm_engine.get_reasoning_parser(name, chat_template_kwargs)

    def _generate(self, prompts, sampling_params, use_tqdm: bool,
                  reasoning_parser) -> list[RequestOutput]:
        if hasattr(prompts, "tolist") and not isinstance(prompts, list):
            prompts = prompts.tolist()  # a numpy array (or tensor) of token ids
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and isinstance(prompts[0], numbers.Integral)):
            prompts = [prompts]
        params = sampling_params or self.get_default_sampling_params()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        encoded = self._encode_texts(prompts)
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                request_id = str(next(self._ids))
                self.llm_engine.add_request(request_id, prompt, p,
                                            prompt_token_ids=encoded.get(i),
                                            reasoning_parser=reasoning_parser)
                ids.append(request_id)
        except BaseException:  # a bad argument or Ctrl-C part way: the added ones go too
            self.llm_engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def _encode_texts(self, prompts: list) -> dict[int, list[int]]:
        """The ids of the text prompts, by position, from one tokenizer call; empty when
        one cannot be encoded (add_request then reports it, and encodes the others)."""
        texts = {i: p for i, p in enumerate(prompts) if isinstance(p, str) and p}
        if not texts:
            return {}
        try:
            encoded = self.llm_engine.encode_prompts(list(texts.values()))
        except ValueError:
            return {}
        return dict(zip(texts, encoded))

    def chat(self, messages, sampling_params=None, use_tqdm: bool = False,
             add_generation_prompt: bool = True, *, chat_template: str | None = None,
             chat_template_kwargs: dict | None = None,
             continue_final_message: bool = False,
             reasoning_parser: str | None = None,
             tools: list[dict] | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them.
        `chat_template` replaces the tokenizer's template (Jinja text);
        `chat_template_kwargs` are extra template variables, such as
        {"enable_thinking": False}; `continue_final_message` continues the last message
        (pass add_generation_prompt=False with it); `reasoning_parser` as in generate();
        `tools`, an OpenAI tools list for the template, as in vLLM."""
        parser = self._reasoning_parser(reasoning_parser, chat_template_kwargs)
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        engine = self.llm_engine
        texts = [engine.render_chat_text(
            c, add_generation_prompt, chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
            continue_final_message=continue_final_message, tools=tools) for c in conversations]
        # one tokenizer call for all of them (the template wrote the special tokens)
        return self._generate(engine.encode_prompts(texts, add_special_tokens=False),
                              sampling_params, use_tqdm, parser)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        with bar, startup_heap_frozen():
            try:
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        done[out.request_id] = out
                        bar.update(1)
            except BaseException:
                # the exception is the caller's; this call's requests leave the engine with
                # it, so the next call starts clean rather than meeting them again
                engine.abort_request([i for i in ids if i not in done])
                raise
        return [done[i] for i in ids]

    def stats(self) -> dict:
        return self.llm_engine.stats()

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes (they also stop when this process
        exits). Needed only to start another tensor-parallel LLM in the same process."""
        self.llm_engine.shutdown()
