"""From input rows to engine requests: which column holds the prompt, and what each row asks.

Three shapes of input are understood: a text prompt column, a chat messages column
(rendered with the tokenizer's chat template), and OpenAI Batch API lines (`custom_id`,
`method`, `url`, `body`), whose body carries the messages or prompt and the row's own
sampling settings. A row that cannot become a request becomes a WorkItem with an error.
"""
from __future__ import annotations

import json
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from batchinfer.job.errors import JobError
from batchinfer.job.options import JobOptions
from batchinfer.job.reader import InputRow
from batchinfer.sampling_params import SamplingParams

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
# OpenAI body field -> SamplingParams field. Fields not listed (model, user, ...) are ignored.
OPENAI_SAMPLING = {
    "max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "n": "n",
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "seed": "seed", "stop": "stop", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_tokens", "ignore_eos": "ignore_eos", "stop_token_ids": "stop_token_ids",
    "include_stop_str_in_output": "include_stop_str_in_output",
    "skip_special_tokens": "skip_special_tokens", "logit_bias": "logit_bias",
    # vLLM's extensions: allowed tokens, and a completion that is one of a list of strings
    "allowed_token_ids": "allowed_token_ids", "structured_outputs": "structured_outputs",
    "prompt_logprobs": "prompt_logprobs", "truncate_prompt_tokens": "truncate_prompt_tokens",
}
_TEXT_TYPES = (pa.string(), pa.large_string(), pa.null())

RenderChat = Callable[..., str]  # (messages, chat_template_kwargs=...) -> rendered text
Encode = Callable[[list[str], bool], list[list[int]]]  # (texts, add_special_tokens) -> ids


@dataclass(frozen=True)
class PromptSpec:
    mode: str                 # "prompt" | "messages" | "openai"
    column: str               # the prompt or messages column; "body" for OpenAI Batch
    id_column: str | None

    def restrict(self) -> dict[str, str]:
        """The one kind of value each prompt-bearing column may hold (see schema.py)."""
        kind = {"prompt": "str", "messages": "list", "openai": "dict"}[self.mode]
        return {self.column: kind}

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "column": self.column, "id_column": self.id_column}


def detect(columns: list[str], options: JobOptions) -> PromptSpec:
    """Choose the prompt column from the flags, else from the column names."""
    def need(column: str, flag_name: str) -> str:
        if column not in columns:
            raise JobError(f"{flag_name} {column!r}: no such column in INPUT "
                           f"(columns: {', '.join(columns)})")
        return column

    if options.prompt_column:
        mode, column = "prompt", need(options.prompt_column, "--prompt-column")
    elif options.messages_column:
        mode, column = "messages", need(options.messages_column, "--messages-column")
    elif "custom_id" in columns and "body" in columns:
        mode, column = "openai", "body"
    elif "prompt" in columns:
        mode, column = "prompt", "prompt"
    elif "messages" in columns:
        mode, column = "messages", "messages"
    else:
        raise JobError(f"no prompt column in INPUT (columns: {', '.join(columns)}); name it "
                       "with --prompt-column, or the chat messages with --messages-column")
    if options.id_column:
        id_column = need(options.id_column, "--id-column")
    elif mode == "openai":
        id_column = "custom_id"
    else:
        id_column = "id" if "id" in columns else None
    return PromptSpec(mode, column, id_column)


def check_types(spec: PromptSpec, schema: pa.Schema) -> None:
    """Refuse a prompt column whose stored type can never hold a valid prompt."""
    type_ = schema.field(spec.column).type
    ok = {
        "prompt": type_ in _TEXT_TYPES,
        "messages": type_ in _TEXT_TYPES or pa.types.is_list(type_) or pa.types.is_large_list(type_),
        "openai": type_ in _TEXT_TYPES or pa.types.is_struct(type_),
    }[spec.mode]
    if not ok:
        what = {"prompt": "text", "messages": "a list of messages",
                "openai": "an OpenAI request body"}[spec.mode]
        raise JobError(f"column {spec.column!r} has type {type_}, not {what}; choose the "
                       "prompt column with --prompt-column or --messages-column")
    if spec.id_column is not None:
        id_type = schema.field(spec.id_column).type
        if pa.types.is_nested(id_type):
            raise JobError(f"--id-column {spec.id_column!r} has type {id_type}; ids must be "
                           "text or numbers")


def check_kinds(spec: PromptSpec, kinds: set[str]) -> None:
    """Refuse a prompt column of a JSON or CSV input in which no row holds a usable value
    (`kinds` are the kinds of value found in it, see schema.kind_of)."""
    wanted = {"prompt": {"str"}, "messages": {"list", "str"}, "openai": {"dict", "str"}}[spec.mode]
    if not kinds & wanted:
        words = {"str": "text", "int": "numbers", "float": "numbers", "bool": "booleans",
                 "list": "lists", "dict": "objects"}
        found = ", ".join(sorted({words.get(k, "other values") for k in kinds})) or "all null"
        raise JobError(f"column {spec.column!r} holds no usable prompts (its values are: "
                       f"{found}); choose the prompt column with --prompt-column or "
                       "--messages-column")


@dataclass(slots=True)
class WorkItem:
    row: InputRow
    row_id: Any
    # the prompt's token ids, 4 bytes a token while the row waits in the reorder window
    prompt: array | None = None
    params: SamplingParams | None = None
    error: str | None = None

    @property
    def sort_key(self) -> array:
        """Requests sharing a prefix sort next to each other (arrays compare as lists)."""
        return self.prompt


@dataclass(slots=True)
class _Text:
    """A prompt still to tokenize: encoded with the rest of its batch in one call."""
    text: str
    add_special_tokens: bool  # False for a rendered chat: the template wrote them


class PromptBuilder:
    """Turns input rows into WorkItems. `render_chat` renders a conversation to text with
    the engine's chat template; `encode` tokenizes a list of texts at once (the engine's
    encode_prompts)."""

    def __init__(self, spec: PromptSpec, params: SamplingParams, system_prompt: str | None,
                 render_chat: RenderChat, encode: Encode,
                 chat_template_kwargs: dict | None = None, max_n: int = 128):
        self.spec = spec
        self.max_n = max_n  # completions one row (an OpenAI Batch line's n) may ask for
        self.params = params
        self.system_prompt = system_prompt
        self.render_chat = render_chat
        self.encode = encode
        self.chat_template_kwargs = chat_template_kwargs or {}

    def build(self, row: InputRow) -> WorkItem:
        return self.build_batch([row])[0]

    def build_batch(self, rows: list[InputRow]) -> list[WorkItem]:
        """One WorkItem per row, in order. Texts are tokenized together, one tokenizer call
        for the batch (a prompt such as a long shared system prompt costs its tokenization
        on every row, and a fast tokenizer spreads a batch over the cores)."""
        items = [self._prepare(row) for row in rows]
        for add_special in (True, False):
            pending = [item for item in items if isinstance(item.prompt, _Text)
                       and item.prompt.add_special_tokens == add_special]
            if not pending:
                continue
            texts = [item.prompt.text for item in pending]
            try:
                encoded = self.encode(texts, add_special)
            except ValueError:  # find the row(s) at fault; the others still encode
                encoded = [self._encode_one(item, add_special) for item in pending]
            for item, ids in zip(pending, encoded):
                item.prompt = None if ids is None else array("i", ids)
        return items

    def _encode_one(self, item: WorkItem, add_special: bool) -> list[int] | None:
        try:
            return self.encode([item.prompt.text], add_special)[0]
        except ValueError as e:
            item.error = str(e)
            return None

    def _prepare(self, row: InputRow) -> WorkItem:
        """The row's WorkItem, its prompt a _Text still to encode, token ids (an OpenAI
        prompt given as ids) or None with the error set."""
        spec = self.spec
        if spec.id_column is None:
            item = WorkItem(row, row.index)
        else:
            item = WorkItem(row, row.values.get(spec.id_column))
        if row.error is not None:
            item.error = row.error
            return item
        if item.row_id is None:
            item.error = f"the id column {spec.id_column!r} is empty"
            return item
        value = row.values.get(spec.column)
        try:
            if spec.mode == "prompt":
                prompt, item.params = self._from_text(value), self.params
            elif spec.mode == "messages":
                prompt, item.params = self._from_messages(value), self.params
            else:
                prompt, item.params = self._from_openai(value, row.values.get("url"))
        except ValueError as e:
            item.error = str(e)
            return item
        item.prompt = prompt if isinstance(prompt, _Text) else array("i", prompt)
        return item

    def _from_text(self, value: Any, what: str = "prompt") -> _Text:
        if value is None:
            raise ValueError(f"{what} is missing (column {self.spec.column!r} is null)"
                             if what == "prompt" else f"{what} is missing")
        if not isinstance(value, str):
            raise ValueError(f"{what} must be text, got {_type_name(value)}")
        if not value.strip():
            raise ValueError(f"{what} is empty")
        if self.system_prompt is None:
            return _Text(value, True)
        return self._render([{"role": "user", "content": value}])

    def _from_messages(self, value: Any, template_kwargs: dict | None = None) -> _Text:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise ValueError("messages must be a list of {role, content} objects, got "
                                 "text that is not JSON") from None
        if value is None:
            raise ValueError(f"messages are missing (column {self.spec.column!r} is null)")
        if not isinstance(value, list) or not value:
            raise ValueError("messages must be a non-empty list of {role, content} objects, "
                             f"got {_type_name(value)}")
        if not all(isinstance(m, dict) for m in value):
            raise ValueError("each message must be an object with 'role' and 'content'")
        messages = [{k: v for k, v in m.items() if v is not None} for m in value]
        return self._render(messages, template_kwargs)

    def _render(self, messages: list[dict], template_kwargs: dict | None = None) -> _Text:
        if self.system_prompt is not None and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        kwargs = {**self.chat_template_kwargs, **(template_kwargs or {})}
        try:
            return _Text(self.render_chat(messages, chat_template_kwargs=kwargs), False)
        except ValueError as e:
            raise ValueError(f"invalid messages: {e}") from None

    def _from_openai(self, body: Any, url: Any) -> tuple[_Text | list[int], SamplingParams]:
        if isinstance(body, str):
            try:
                body = json.loads(body)
            except json.JSONDecodeError:
                raise ValueError("body is not valid JSON") from None
        if not isinstance(body, dict):
            raise ValueError(f"body must be an object, got {_type_name(body)}")
        if url is not None and url not in (CHAT_URL, COMPLETIONS_URL):
            raise ValueError(f"url {url!r} is not supported; use {CHAT_URL} or {COMPLETIONS_URL}")
        params = self._openai_params(body)
        if body.get("messages") is not None:
            row_kwargs = body.get("chat_template_kwargs")  # vLLM's extension of the API
            if row_kwargs is not None and not isinstance(row_kwargs, dict):
                raise ValueError("body.chat_template_kwargs must be an object, got "
                                 f"{_type_name(row_kwargs)}")
            return self._from_messages(body["messages"], row_kwargs), params
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            if any(isinstance(t, bool) or not 0 <= t < 2 ** 31 for t in prompt):
                raise ValueError("body.prompt token ids must be integers in [0, vocab size)")
            return prompt, params
        if isinstance(prompt, list):
            raise ValueError("body.prompt must be one text (or one list of token ids); put "
                             "each prompt on its own line")
        saved, self.system_prompt = self.system_prompt, None  # completions are not chat
        try:
            return self._from_text(prompt, "body.prompt or body.messages"), params
        finally:
            self.system_prompt = saved

    def _openai_params(self, body: dict) -> SamplingParams:
        changes = {OPENAI_SAMPLING[k]: v for k, v in body.items()
                   if k in OPENAI_SAMPLING and v is not None}
        if body.get("guided_choice") is not None:  # vLLM's older names
            changes["structured_outputs"] = {"choice": body["guided_choice"]}
        if body.get("guided_regex") is not None:
            changes["structured_outputs"] = {"regex": body["guided_regex"]}
        if body.get("guided_json") is not None:
            changes["structured_outputs"] = {"json": body["guided_json"]}
        if body.get("guided_grammar") is not None:
            changes["structured_outputs"] = {"grammar": body["guided_grammar"]}
        constraint = _response_format_constraint(body.get("response_format"))
        if constraint is not None:
            changes["structured_outputs"] = constraint
        top = body.get("top_logprobs")
        logprobs = body.get("logprobs")
        if isinstance(logprobs, bool):
            if logprobs:
                changes["logprobs"] = top if top is not None else 0
        elif logprobs is not None:
            changes["logprobs"] = logprobs
        if not changes:
            return self.params
        try:
            params = self.params.clone(**changes)
        except (TypeError, ValueError) as e:
            raise ValueError(f"body: {e}".replace("SamplingParams.", "")) from None
        if params.n > self.max_n:
            raise ValueError(f"body.n = {params.n} is over the limit of {self.max_n} "
                             "completions per row (--max-n)")
        return params


def _response_format_constraint(response_format: Any) -> dict | None:
    """The structured output of OpenAI's response_format: {"type": "json_schema",
    "json_schema": {"schema": ...}} or {"type": "json_object"} (any JSON object); None for
    {"type": "text"} or none given."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if isinstance(spec, dict) and spec.get("schema") is not None:
            return {"json": spec["schema"]}
        raise ValueError("body.response_format.json_schema.schema is missing")
    if kind == "json_object":
        return {"json_object": True}
    raise ValueError(f"body.response_format: unknown type {kind!r}")


def _type_name(value: Any) -> str:
    return {str: "text", int: "a number", float: "a number", bool: "a boolean",
            list: "a list", dict: "an object"}.get(type(value), type(value).__name__)
