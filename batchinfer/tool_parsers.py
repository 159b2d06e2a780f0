"""Tool calls in a completion, with vLLM's parser names and formats:

    parser = ToolParser("hermes")
    content, calls = parser.parse(text)    # calls: [{"name", "arguments" (JSON text)}]

- hermes, qwen3: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  (the last one may be left open at the end of the output);
- llama3_json: the output (after an optional `<|python_tag|>`) is a JSON object
  `{"name": ..., "parameters": {...}}` ("arguments" is taken too), or several separated
  by ";";
- mistral: `[TOOL_CALLS]` followed by a JSON list of `{"name", "arguments"}` objects.

`content` is the text outside the calls, stripped. A call that is not JSON, or not an
object with a string "name", makes the whole output content with no calls, as in vLLM.
"""
from __future__ import annotations

import hashlib
import json
import re
import string
from typing import Any

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "qwen3")
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TOOL_CALLS = "[TOOL_CALLS]"
_TAGGED_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_DECODER = json.JSONDecoder()
_ID_ALPHABET = string.ascii_letters + string.digits


def check_tool_parser_name(name: str) -> None:
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}: use one of "
                         f"{', '.join(TOOL_CALL_PARSERS)}")


def check_tools(tools: Any) -> list[dict]:
    """An OpenAI tools list ([{"type": "function", "function": {"name", "description",
    "parameters"}}, ...]), or a ValueError naming what is wrong."""
    if not isinstance(tools, list) or not tools:
        raise ValueError("tools must be a non-empty list of "
                         '{"type": "function", "function": {"name": ...}} objects')
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" \
                or not isinstance(function, dict):
            raise ValueError(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}')
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
    return tools


class _Malformed(ValueError):
    pass


def _call(value: Any, arguments_keys: tuple[str, ...] = ("arguments",)) -> dict[str, str]:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise _Malformed("a tool call must be an object with a string name")
    arguments = next((value[k] for k in arguments_keys if k in value), {})
    return {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}


def call_id(parser: str | None, row_id: Any, sample_index: int, position: int) -> str:
    """A call's id, the same on every run: Mistral's 9 letters and digits (its chat template
    takes no other), else vLLM's chatcmpl-tool- and 32 hex digits."""
    digest = hashlib.sha256(json.dumps([str(row_id), sample_index, position]).encode())
    if parser == "mistral":
        number = int.from_bytes(digest.digest()[:8], "little")
        return "".join(_ID_ALPHABET[(number >> (6 * i)) % 62] for i in range(9))
    return "chatcmpl-tool-" + digest.hexdigest()[:32]


class ToolParser:
    def __init__(self, name: str):
        check_tool_parser_name(name)
        self.name = name
        # Mistral's [TOOL_CALLS] is a special token: the text must keep it (as in vLLM)
        self.skip_special_tokens = name != "mistral"

    def parse(self, text: str) -> tuple[str, list[dict[str, str]]]:
        """(content, calls) of one completion; (text, []) when it holds no well-formed
        calls."""
        parse = {"hermes": _tagged, "qwen3": _tagged, "llama3_json": _llama3_json,
                 "mistral": _mistral}[self.name]
        try:
            found = parse(text)
        except (_Malformed, json.JSONDecodeError, RecursionError):
            return text, []
        return (text, []) if found is None else found



def _tagged(text: str) -> tuple[str, list[dict[str, str]]] | None:
    matches = list(_TAGGED_CALL.finditer(text))
    if not matches:
        return None
    calls, outside, at = [], [], 0
    for m in matches:
        body = m.group(1) if m.group(1) is not None else m.group(2)
        calls.append(_call(json.loads(body.strip())))
        outside.append(text[at:m.start()])
        at = m.end()
    outside.append(text[at:])
    return "".join(outside).strip(), calls


def _llama3_json(text: str) -> tuple[str, list[dict[str, str]]] | None:
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].lstrip()
    if not body.startswith("{"):
        return None
    calls, pos = [], 0
    while True:
        value, pos = _DECODER.raw_decode(body, pos)
        calls.append(_call(value, ("parameters", "arguments")))
        rest = body[pos:].lstrip()
        if not rest.startswith(";"):
            break
        pos = len(body) - len(rest) + 1
        while pos < len(body) and body[pos].isspace():
            pos += 1
    return body[pos:].strip(), calls


def _mistral(text: str) -> tuple[str, list[dict[str, str]]] | None:
    start = text.find(MISTRAL_TOOL_CALLS)
    if start < 0:
        return None
    rest = text[start + len(MISTRAL_TOOL_CALLS):].lstrip()
    value, end = _DECODER.raw_decode(rest)
    values = value if isinstance(value, list) else [value]
    if not values:
        raise _Malformed("an empty list of tool calls")
    calls = [_call(v) for v in values]
    return (text[:start] + rest[end:]).strip(), calls
