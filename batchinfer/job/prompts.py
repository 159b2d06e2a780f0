"""From input rows to engine requests: which column holds the prompt, and what each row asks.

Three shapes of input are understood: a text prompt column, a chat messages column
(rendered with the tokenizer's chat template), and OpenAI Batch API lines (`custom_id`,
`method`, `url`, `body`), whose body carries the messages or prompt and the row's own
sampling settings. Or the prompt is rendered from the row's columns by a template
(templates.py). A row that cannot become a request becomes a WorkItem with an error.
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
from batchinfer.job.row_sampling import RowSampling
from batchinfer.job.templates import RowTemplates
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
    mode: str                 # "prompt" | "messages" | "openai" | "template"
    column: str | None        # the prompt or messages column; "body" for OpenAI Batch;
    id_column: str | None     # None for a template (its columns are its own)

    def restrict(self) -> dict[str, str]:
        """The one kind of value each prompt-bearing column may hold (see schema.py)."""
        if self.mode == "template":
            return {}
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

    if options.prompt_template is not None or options.messages_template is not None:
        mode, column = "template", None
    elif options.prompt_column:
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


def row_settings(options: JobOptions, columns: list[str], system_prompt: str | None,
                 json_columns: set[str] = frozenset()
                 ) -> tuple[RowTemplates | None, RowSampling | None]:
    """The job's templates and sampling columns, checked against the input's columns
    (JobError naming a missing one)."""
    templates = None
    if options.prompt_template is not None or options.messages_template is not None or (
            system_prompt is not None and _is_template(system_prompt)):
        templates = RowTemplates(options.prompt_template_text(),
                                 options.messages_template_list(), system_prompt, columns)
    names = options.sampling_column_names()
    if names is None:
        return templates, None
    names, required = names
    missing = [n for n in names if n not in columns]
    if required and missing:
        raise JobError(f"--sampling-columns: no column {missing[0]!r} in INPUT (columns: "
                       f"{', '.join(columns)})")
    names = [n for n in names if n in columns]
    if not names:
        raise JobError(f"--sampling-columns: INPUT has none of the columns "
                       f"{', '.join(options.sampling_column_names()[0])} (columns: "
                       f"{', '.join(columns)})")
    return templates, RowSampling(names, options.max_n, json_columns)


def _is_template(text: str) -> bool:
    """A system prompt with Jinja markup is rendered per row; plain text is used as is."""
    return any(mark in text for mark in ("{{", "{%", "{#"))


def check_types(spec: PromptSpec, schema: pa.Schema) -> None:
    """Refuse a prompt column whose stored type can never hold a valid prompt."""
    if spec.mode == "template":
        return
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
    text: str | None = None  # the prompt's text, kept with --keep-prompt
    with_tools: bool = False  # the chat template was given tools: its output may call them
    forced_tool: str | None = None  # tool_choice named this function: the output is a call

    @property
    def sort_key(self) -> array:
        """Requests sharing a prefix sort next to each other (arrays compare as lists)."""
        return self.prompt


@dataclass(slots=True)
class _Text:
    """A prompt still to tokenize: encoded with the rest of its batch in one call."""
    text: str
    add_special_tokens: bool  # False for a rendered chat: the template wrote them
    with_tools: bool = False
    forced_tool: str | None = None


class PromptBuilder:
    """Turns input rows into WorkItems. `render_chat` renders a conversation to text with
    the engine's chat template; `encode` tokenizes a list of texts at once (the engine's
    encode_prompts). `templates` render a row's prompt, messages or system prompt from its
    columns; `sampling` applies its sampling columns; `keep_prompt` keeps each prompt's
    text on its WorkItem."""

    def __init__(self, spec: PromptSpec, params: SamplingParams, system_prompt: str | None,
                 render_chat: RenderChat, encode: Encode,
                 chat_template_kwargs: dict | None = None, max_n: int = 128, *,
                 templates: RowTemplates | None = None, sampling: RowSampling | None = None,
                 keep_prompt: bool = False, tools: list[dict] | None = None):
        self.spec = spec
        self.templates = templates
        self.sampling = sampling
        self.keep_prompt = keep_prompt
        self.tools = tools  # --tools: for every chat the template renders
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
            if self.keep_prompt:
                for item, text in zip(pending, texts):
                    item.text = text
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
        value = row.values.get(spec.column) if spec.column is not None else None
        try:
            system = self.system_prompt
            if self.templates is not None and self.templates.system is not None:
                system = self.templates.render_system(row.values)
            if spec.mode == "prompt":
                prompt, item.params = self._from_text(value, system=system), self.params
            elif spec.mode == "messages":
                prompt, item.params = self._from_messages(value, system=system), self.params
            elif spec.mode == "template":
                prompt, item.params = self._from_template(row.values, system), self.params
            else:
                prompt, item.params = self._from_openai(value, row.values.get("url"), system)
            if self.sampling is not None:
                item.params = self.sampling.apply(row.values, item.params)
        except ValueError as e:
            item.error = str(e)
            return item
        if isinstance(prompt, _Text):
            item.prompt, item.with_tools = prompt, prompt.with_tools
            item.forced_tool = prompt.forced_tool
        else:
            item.prompt = array("i", prompt)
        return item

    def _from_template(self, values: dict[str, Any], system: str | None) -> _Text:
        if self.templates.prompt is not None:
            return self._from_text(self.templates.render_prompt(values),
                                   "the prompt --prompt-template rendered", system)
        return self._render(self.templates.render_messages(values), system=system)

    def _from_text(self, value: Any, what: str = "prompt", system: str | None = None) -> _Text:
        if value is None:
            raise ValueError(f"{what} is missing (column {self.spec.column!r} is null)"
                             if what == "prompt" else f"{what} is missing")
        if not isinstance(value, str):
            raise ValueError(f"{what} must be text, got {_type_name(value)}")
        if not value.strip():
            raise ValueError(f"{what} is empty")
        if system is None:
            return _Text(value, True)
        return self._render([{"role": "user", "content": value}], system=system)

    def _from_messages(self, value: Any, template_kwargs: dict | None = None,
                       system: str | None = None, tools: list[dict] | None = None) -> _Text:
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
        return self._render(messages, template_kwargs, system, tools)

    def _render(self, messages: list[dict], template_kwargs: dict | None = None,
                system: str | None = None, tools: list[dict] | None = None) -> _Text:
        if system is not None and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": system}, *messages]
        kwargs = {**self.chat_template_kwargs, **(template_kwargs or {})}
        tools = self.tools if tools is None else tools or None  # [] : none for this row
        given = {} if tools is None else {"tools": tools}  # (a renderer may not take it)
        try:
            return _Text(self.render_chat(messages, chat_template_kwargs=kwargs, **given),
                         False, tools is not None)
        except ValueError as e:
            raise ValueError(f"invalid messages: {e}") from None

    def _from_openai(self, body: Any, url: Any,
                     system: str | None) -> tuple[_Text | list[int], SamplingParams]:
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
            tools, forced = _body_tools(body, self.tools)
            text = self._from_messages(body["messages"], row_kwargs, system, tools)
            if forced is not None:
                text.forced_tool = forced["name"]
                params = _forced_call_params(params, forced)
            return text, params
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            if any(isinstance(t, bool) or not 0 <= t < 2 ** 31 for t in prompt):
                raise ValueError("body.prompt token ids must be integers in [0, vocab size)")
            return prompt, params
        if isinstance(prompt, list):
            raise ValueError("body.prompt must be one text (or one list of token ids); put "
                             "each prompt on its own line")
        # completions are not chat: no system prompt
        return self._from_text(prompt, "body.prompt or body.messages"), params

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


def _body_tools(body: dict, default: list[dict] | None
                ) -> tuple[list[dict] | None, dict | None]:
    """A chat line's tools as the template takes them (None for the flags' --tools, [] for
    none: tool_choice "none"), and the function tool_choice names, if it names one
    ({"type": "function", "function": {"name": ...}}). tool_choice "auto" (the default)
    lets the model choose; "required" is not supported."""
    from batchinfer.tool_parsers import check_tools
    choice = body.get("tool_choice")
    if choice == "none":
        return [], None
    tools = body.get("tools")
    if tools is not None:
        try:
            tools = check_tools(tools)
        except ValueError as e:
            raise ValueError(f"body.{e}") from None
    if choice in (None, "auto"):
        return tools, None
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) \
        and choice.get("type") == "function" and isinstance(choice.get("function"), dict) \
        else None
    if not isinstance(name, str):
        raise ValueError(f"body.tool_choice {json.dumps(choice)} is not supported; use "
                         '"auto", "none" or {"type": "function", "function": {"name": ...}}')
    named = [t["function"] for t in (tools if tools is not None else default or [])
             if t["function"]["name"] == name]
    if not named:
        raise ValueError(f"body.tool_choice names {name!r}, which is not among the tools")
    return tools, named[0]


def _forced_call_params(params: SamplingParams, function: dict) -> SamplingParams:
    """The line's params with the output made a JSON instance of the function's
    parameters (vLLM's way with a named tool_choice)."""
    if params.structured_outputs is not None:
        raise ValueError("body.tool_choice naming a function cannot be combined with another "
                         "constraint (guided_*, structured_outputs, response_format)")
    schema = function.get("parameters") or {"type": "object"}
    try:
        return params.clone(structured_outputs={"json": schema})
    except (TypeError, ValueError) as e:
        message = str(e).replace("SamplingParams.structured_outputs: ", "")
        raise ValueError(f"body.tool_choice: the parameters of {function['name']!r}: "
                         f"{message}") from None


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
