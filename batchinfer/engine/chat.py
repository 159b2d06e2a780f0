"""Prompts as token ids: chat conversations rendered through a chat template, and texts
encoded many at a time. The engine's API (render_chat, render_chat_text, encode_prompts)
calls these with its tokenizer."""
from __future__ import annotations

import json
from typing import Any


def encode_prompts(tokenizer: Any, texts: list[str],
                   add_special_tokens: bool = True) -> list[list[int]]:
    """Token ids of many texts in one tokenizer call, the same ids as encoding each
    alone: a fast (Rust) tokenizer encodes the batch on all cores without the GIL.
    Rendered chats take add_special_tokens=False (the template wrote them); a text that
    is not valid Unicode raises ValueError."""
    for text in texts:
        check_unicode(text, "prompt")
    if not texts:
        return []
    return tokenizer(texts, add_special_tokens=add_special_tokens,
                     return_attention_mask=False, return_token_type_ids=False)["input_ids"]


def render_chat_text(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = True,
                     *, chat_template: str | None = None,
                     chat_template_kwargs: dict | None = None,
                     continue_final_message: bool = False,
                     tools: list[dict] | None = None) -> str:
    """A conversation through the tokenizer's chat template (or the given Jinja
    `chat_template`) as text, with `chat_template_kwargs` as extra template variables
    (e.g. {"enable_thinking": False} for Qwen3). `continue_final_message` leaves the last
    message open for the model to continue, instead of starting a new turn. `tools`: an
    OpenAI tools list, for templates that describe tools to the model. Messages may hold
    an assistant's `tool_calls` (their JSON `arguments` handed to the template as objects,
    as vLLM does) and `tool` results. ValueError names what is wrong with the messages or
    the template."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    messages = [_text_message(m) for m in messages]
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model's tokenizer has no chat template")
    kwargs = check_chat_template_kwargs(chat_template_kwargs)
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be "
                         "set: the last message is either continued or answered")
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, chat_template=chat_template,
            tools=tools, **kwargs)
    except Exception as e:  # a template error (jinja2's TemplateError and its kin)
        if isinstance(e, ValueError):
            raise
        raise ValueError(f"the chat template failed: {type(e).__name__}: {e}") from None
    check_unicode(text, "the conversation")  # roles and content parts included
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
    as vLLM does for templates that take a string. An assistant message with `tool_calls`
    may have no content."""
    if not (isinstance(message, dict) and isinstance(message.get("role"), str)):
        raise ValueError("each message must be a dict with string 'role' and 'content'")
    if message.get("tool_calls") is not None:
        message = {**message, "tool_calls": _tool_calls(message["tool_calls"])}
        if message.get("content") is None:
            return {k: v for k, v in message.items() if k != "content"}
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


def _tool_calls(calls) -> list[dict]:
    """An assistant's tool calls ([{"id", "type": "function", "function": {"name",
    "arguments"}}]) with each `arguments` JSON text parsed to its object."""
    if not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("function"), dict)
            and isinstance(c["function"].get("name"), str) for c in calls):
        raise ValueError("tool_calls must be a list of {'id', 'type': 'function', "
                         "'function': {'name', 'arguments'}} objects")
    out = []
    for call in calls:
        arguments = call["function"].get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                raise ValueError(f"tool_calls: the arguments of {call['function']['name']!r} "
                                 "are not JSON") from None
        out.append({**call, "function": {**call["function"], "arguments": arguments or {}}})
    return out


def check_unicode(text: str, what: str) -> None:
    """Text a tokenizer can take: encodable as UTF-8 (a lone surrogate such as the JSON
    escape \\ud800 is not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode ({e.reason}: {text[e.start:e.end]!r} "
                         f"at character {e.start})") from None
