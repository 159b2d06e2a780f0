"""The tool call parsers over completions as the models write them, malformed ones included."""
from __future__ import annotations

import json
import re

import pytest

from batchinfer.tool_parsers import TOOL_CALL_PARSERS, ToolParser, call_id, check_tools


def parse(name: str, text: str) -> tuple[str, list[tuple[str, object]]]:
    content, calls = ToolParser(name).parse(text)
    return content, [(c["name"], json.loads(c["arguments"])) for c in calls]


@pytest.mark.parametrize("name", ["hermes", "qwen3"])
def test_tagged_calls(name):
    one = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
           '"celsius"}}\n</tool_call>')
    assert parse(name, one) == ("", [("get_weather", {"city": "Paris", "unit": "celsius"})])
    two = ("Let me look both up.\n\n" + one + "\n"
           '<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}\n'
           "</tool_call>")
    content, calls = parse(name, two)
    assert content == "Let me look both up."
    assert [c[0] for c in calls] == ["get_weather", "get_time"]
    # text after the calls stays too; a call left open at the end (cut off) still parses
    # when its JSON is whole
    assert parse(name, one + "\nDone.") == ("Done.", [calls[0]])
    assert parse(name, '<tool_call>\n{"name": "f", "arguments": {}}') == ("", [("f", {})])
    assert parse(name, "The weather is fine.") == ("The weather is fine.", [])


@pytest.mark.parametrize("name", ["hermes", "qwen3"])
@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut off
    '<tool_call>\n{"name": get_weather}\n</tool_call>',                  # not JSON
    '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',        # no name
    '<tool_call>\n["get_weather"]\n</tool_call>',                        # not an object
    'Sure.<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>oops</tool_call>',
])
def test_malformed_tagged_calls_leave_the_text(name, text):
    assert ToolParser(name).parse(text) == (text, [])


def test_llama3_json():
    text = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert parse("llama3_json", text) == ("", [("get_weather", {"city": "Paris"})])
    tagged = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert parse("llama3_json", tagged) == ("", [("get_weather", {"city": "Oslo"})])
    several = ('{"name": "get_weather", "parameters": {"city": "Paris"}}; '
               '{"name": "get_time", "arguments": {"zone": "CET"}}')
    assert parse("llama3_json", several)[1] == [("get_weather", {"city": "Paris"}),
                                                ("get_time", {"zone": "CET"})]
    assert parse("llama3_json", '{"name": "now"}') == ("", [("now", {})])
    plain = "It is sunny in Paris today."
    assert parse("llama3_json", plain) == (plain, [])


@pytest.mark.parametrize("text", [
    '{"name": "get_weather", "parameters": {"city": "Paris"',   # cut off
    '{"city": "Paris"}',                                        # an answer, not a call
    '{"name": "a", "parameters": {}}; {"name": ',               # the second one cut off
    '{"name": 3, "parameters": {}}',
])
def test_malformed_llama3_json_leaves_the_text(text):
    assert ToolParser("llama3_json").parse(text) == (text, [])


def test_mistral():
    text = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    assert parse("mistral", text) == ("", [("get_weather", {"city": "Paris"})])
    two = ('Checking.[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, '
           '{"name": "b", "arguments": {}}]')
    assert parse("mistral", two) == ("Checking.", [("a", {"x": 1}), ("b", {})])
    assert parse("mistral", "No tools needed.") == ("No tools needed.", [])
    for bad in ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"ci',
                "[TOOL_CALLS] []", '[TOOL_CALLS] [{"arguments": {}}]', "[TOOL_CALLS] hello"):
        assert ToolParser("mistral").parse(bad) == (bad, [])


def test_arguments_are_json_text_and_ids_are_stable():
    parser = ToolParser("hermes")
    _, calls = parser.parse('<tool_call>{"name": "f", "arguments": {"q": "café"}}</tool_call>')
    assert calls == [{"name": "f", "arguments": '{"q": "café"}'}]
    ids = {call_id("hermes", "row-1", s, p) for s in range(3) for p in range(3)}
    assert len(ids) == 9 and all(re.fullmatch("chatcmpl-tool-[0-9a-f]{32}", i) for i in ids)
    assert call_id("hermes", "row-1", 0, 0) == call_id(None, "row-1", 0, 0)
    assert call_id("hermes", "row-1", 0, 0) != call_id("hermes", "row-2", 0, 0)
    mistral = call_id("mistral", "row-1", 0, 0)
    assert re.fullmatch("[A-Za-z0-9]{9}", mistral)  # Mistral's template takes no other
    assert not ToolParser("mistral").skip_special_tokens  # [TOOL_CALLS] is a special token
    assert all(ToolParser(n).skip_special_tokens for n in TOOL_CALL_PARSERS if n != "mistral")


def test_unknown_parser_and_bad_tools_are_named():
    with pytest.raises(ValueError, match="unknown tool call parser 'pythonic'"):
        ToolParser("pythonic")
    good = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert check_tools(good) == good
    for bad, why in (([], "non-empty list"), ({"type": "function"}, "non-empty list"),
                     ([{"function": {"name": "f"}}], r"tools\[0\] must be"),
                     ([{"type": "function", "function": {"name": ""}}], "name must be"),
                     ([{"type": "function", "function": {"name": "f", "parameters": []}}],
                      "parameters must be")):
        with pytest.raises(ValueError, match=why):
            check_tools(bad)
