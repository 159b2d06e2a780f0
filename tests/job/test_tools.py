"""Tools: --tools and OpenAI Batch lines' tools reach real chat templates (Qwen3's and Llama
3.1's, written into random-weight checkpoints), conversations hold tool calls and tool
results, and --tool-call-parser turns the completion into a tool_calls column.

The random-weight model would never write a call by itself: a --regex (or a line's
guided_regex) makes it write one in its model's format, through the real decoding path."""
from __future__ import annotations

import copy
import io
import json
import re
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from batchinfer.job.options import JobOptions
from batchinfer.job.runner import run_job
from fake_engine import FakeEngine

# Qwen3's chat template (Qwen/Qwen3-8B, tokenizer_config.json), verbatim.
QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

# Llama 3.1's chat template (meta-llama/Llama-3.1-8B-Instruct, tokenizer_config.json),
# verbatim.
LLAMA31_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
FIRST_CALL = {"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATIONS = [
    [{"role": "user", "content": "What is the weather in Paris?"}],
    [{"role": "user", "content": "What is the weather in Paris?"},
     {"role": "assistant", "content": None, "tool_calls": [FIRST_CALL]},
     {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
     {"role": "user", "content": "And in Oslo?"}],
]
CITY = "[A-Z][a-z]{2,6}"
# what each model writes for a call, as a regex that makes the random-weight model write one
CALL_REGEX = {
    "qwen3": r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "' + CITY
             + r'"\}\}\n</tool_call>',
    "llama3_json": r'\{"name": "get_weather", "parameters": \{"city": "' + CITY + r'"\}\}',
}


def with_template(model_dir: Path, dest: Path, template: str) -> Path:
    """The checkpoint with `template` as its tokenizer_config.json's chat template (the
    weights linked, not copied)."""
    dest.mkdir()
    for path in model_dir.iterdir():
        if path.name not in ("tokenizer_config.json", "chat_template.jinja"):
            (dest / path.name).symlink_to(path)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    return dest


def templated(template: str, messages: list[dict], tools: list[dict] | None,
              model_dir: Path) -> str:
    """What transformers renders, with the calls' JSON arguments as objects (as vLLM hands
    them to templates)."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [{k: v for k, v in m.items() if v is not None} for m in copy.deepcopy(messages)]
    for m in messages:
        for call in m.get("tool_calls", []):
            call["function"] = {**call["function"],
                                "arguments": json.loads(call["function"]["arguments"])}
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=True, chat_template=template)


def read_rows(out: Path) -> list[dict]:
    return sorted(ds.dataset(out, format="parquet").to_table().to_pylist(), key=lambda r: r["id"])


@pytest.mark.parametrize("model, template, parser", [
    ("qwen3", QWEN3_TEMPLATE, "qwen3"), ("qwen3", QWEN3_TEMPLATE, "hermes"),
    ("llama", LLAMA31_TEMPLATE, "llama3_json")])
def test_tools_reach_the_template_and_calls_become_a_column(
        tmp_path, run_cli, request, model, template, parser):
    model_dir = with_template(request.getfixturevalue(f"{model}_dir"), tmp_path / "model",
                              template)
    (tmp_path / "tools.json").write_text(json.dumps(TOOLS))
    (tmp_path / "in.jsonl").write_text("".join(
        json.dumps({"id": i, "messages": m}) + "\n" for i, m in enumerate(CONVERSATIONS)))
    regex = CALL_REGEX["llama3_json" if parser == "llama3_json" else "qwen3"]
    result = run_cli(tmp_path / "in.jsonl", "-o", tmp_path / "out", "--model", model_dir,
                     "--tools", f"@{tmp_path / 'tools.json'}", "--tool-call-parser", parser,
                     "--regex", regex, "--max-tokens", "120", "--temperature", "0",
                     "--save-token-ids")
    assert result.exit_code == 0, result.output
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for row, messages in zip(read_rows(tmp_path / "out"), CONVERSATIONS):
        prompt = tokenizer.decode(row["prompt_token_ids"])
        assert prompt == templated(template, messages, TOOLS, model_dir)
        assert '"name": "get_weather"' in prompt and "The current weather in a city." in prompt
        if len(messages) > 1:  # the earlier call, with its arguments as an object, and result
            if parser == "llama3_json":
                assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in prompt
                assert "<|start_header_id|>ipython<|end_header_id|>" in prompt
            else:
                assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
                assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in prompt
        assert row["finish_reason"] == "stop" and row["completion"] == "", row
        [call] = row["tool_calls"]
        assert call["type"] == "function" and call["function"]["name"] == "get_weather"
        assert re.fullmatch(CITY, json.loads(call["function"]["arguments"])["city"])
        assert call["id"].startswith("chatcmpl-tool-")


LABEL_TOOL = {"type": "function", "function": {
    "name": "set_label", "description": "Label the city's weather.",
    "parameters": {"type": "object", "properties": {
        "label": {"enum": ["sunny", "rainy"]}, "city": {"type": "string", "maxLength": 8}},
        "required": ["label", "city"], "additionalProperties": False}}}
NAMED = {"type": "function", "function": {"name": "set_label"}}


def test_openai_lines_with_tools(tmp_path, run_cli, qwen3_dir):
    model_dir = with_template(qwen3_dir, tmp_path / "model", QWEN3_TEMPLATE)
    forced = {"guided_regex": CALL_REGEX["qwen3"]}
    lines = {
        "auto": {"tools": TOOLS, "tool_choice": "auto", **forced},
        "none": {"tools": TOOLS, "tool_choice": "none", **forced},
        "no-tools": forced,
        "named": {"tools": [*TOOLS, LABEL_TOOL], "tool_choice": NAMED},
        "named-unknown": {"tools": TOOLS, "tool_choice": NAMED},
        "named-and-regex": {"tools": [LABEL_TOOL], "tool_choice": NAMED, **forced},
        "required": {"tools": TOOLS, "tool_choice": "required"},
        "bad-tools": {"tools": [{"type": "function", "function": {}}]},
    }
    (tmp_path / "batch.jsonl").write_text("".join(json.dumps({
        "custom_id": name, "method": "POST", "url": "/v1/chat/completions",
        "body": {"messages": CONVERSATIONS[1], "max_tokens": 120, "temperature": 0,
                 **body}}) + "\n"
        for name, body in lines.items()))
    result = run_cli(tmp_path / "batch.jsonl", "-o", tmp_path / "out", "--model", model_dir,
                     "--tool-call-parser", "hermes", "--output-format", "openai",
                     "--save-token-ids")
    assert result.exit_code == 0, result.output
    rows = {r["id"]: r for r in read_rows(tmp_path / "out")}
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.decode(rows["auto"]["prompt_token_ids"]) == templated(
        QWEN3_TEMPLATE, CONVERSATIONS[1], TOOLS, model_dir)
    assert tokenizer.decode(rows["none"]["prompt_token_ids"]) == templated(
        QWEN3_TEMPLATE, CONVERSATIONS[1], None, model_dir)
    assert len(rows["auto"]["tool_calls"]) == 1 and rows["auto"]["completion"] == ""
    for name in ("none", "no-tools"):  # no tools given: the text stays the completion
        assert rows[name]["tool_calls"] == [] and rows[name]["completion"].startswith("<tool_")
    # a named tool_choice: the output is the function's arguments, made to fit its schema
    [named] = rows["named"]["tool_calls"]
    assert named["function"]["name"] == "set_label" and rows["named"]["completion"] == ""
    arguments = json.loads(named["function"]["arguments"])
    assert arguments["label"] in ("sunny", "rainy") and len(arguments["city"]) <= 8
    assert "not among the tools" in rows["named-unknown"]["error"]
    assert "cannot be combined" in rows["named-and-regex"]["error"]
    assert "tool_choice \"required\" is not supported" in rows["required"]["error"]
    assert "body.tools[0].function.name" in rows["bad-tools"]["error"]
    for name in ("required", "bad-tools", "named-unknown", "named-and-regex"):
        assert rows[name]["finish_reason"] == "error" and rows[name]["tool_calls"] is None
    out = {o["custom_id"]: o["response"] for o in map(json.loads, (
        tmp_path / "out" / "__batchinfer__" / "openai_output.jsonl").open())}
    choice = out["auto"]["body"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    assert choice["message"]["tool_calls"] == rows["auto"]["tool_calls"]
    plain = out["none"]["body"]["choices"][0]
    assert plain["finish_reason"] == "stop" and "tool_calls" not in plain["message"]
    assert plain["message"]["content"] == rows["none"]["completion"]
    assert out["required"]["status_code"] == 400
    named_choice = out["named"]["body"]["choices"][0]  # "stop", as OpenAI's API writes it
    assert named_choice["finish_reason"] == "stop"
    assert named_choice["message"]["tool_calls"] == rows["named"]["tool_calls"]


def test_a_parser_without_tools_is_refused_before_the_model_loads(tmp_path, run_cli):
    (tmp_path / "in.jsonl").write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n")
    result = run_cli(tmp_path / "in.jsonl", "-o", tmp_path / "out", "--tool-call-parser",
                     "hermes")
    assert result.exit_code == 2 and "--tool-call-parser hermes needs --tools" in result.output
    for value, why in (("@" + str(tmp_path / "missing.json"), "cannot read"),
                       ("[1]", "tools[0] must be"), ("{", "not valid JSON")):
        result = run_cli(tmp_path / "in.jsonl", "-o", tmp_path / "out", "--tools", value)
        assert result.exit_code == 2 and why in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "hello"}) + "\n")
    result = run_cli(tmp_path / "prompts.jsonl", "-o", tmp_path / "out", "--tools",
                     json.dumps(TOOLS))
    assert result.exit_code == 2 and "not through the chat template" in result.output


class RecordingEngine(FakeEngine):
    """A FakeEngine that keeps each request's params."""

    def __init__(self):
        super().__init__()
        self.params: dict[str, object] = {}

    def add_request(self, request_id, prompt, params, *args, **kwargs):
        self.params[request_id] = params
        super().add_request(request_id, prompt, params, *args, **kwargs)


@pytest.mark.parametrize("parser", ["mistral", "hermes"])
def test_each_parser_on_the_job_path(tmp_path, parser):
    """Calls in each parser's format, the rows' samples with their own ids, a row without
    tools and a failed row; mistral rows keep special tokens (its [TOOL_CALLS] is one)."""
    call = {"mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
            "hermes": 'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
                      '</tool_call>'}[parser]
    rows = [{"messages": [{"role": "user", "content": f"q|reply:{call}"}]},
            {"messages": [{"role": "user", "content": "q|reply:no call here"}]},
            {"messages": [{"role": "user", "content": f"q|reply:{call[:-16]}"}]},  # cut
            {"messages": "not a conversation"}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    engine = RecordingEngine()
    options = JobOptions(input=str(tmp_path / "in.jsonl"), model="stand-in",
                         output=str(tmp_path / "out"), tools=json.dumps(TOOLS),
                         tool_call_parser=parser, n=2, progress=False)
    assert run_job(options, lambda m, k: engine, out=io.StringIO(),
                   err=io.StringIO()).exit_code == 0
    out = ds.dataset(tmp_path / "out", format="parquet").to_table().to_pylist()
    by_row = {(r["id"], r["sample_index"]): r for r in out}
    first = [by_row[(0, 0)], by_row[(0, 1)]]
    assert [r["completion"] for r in first] == ["" if parser == "mistral" else "Sure."] * 2
    calls = [r["tool_calls"][0] for r in first]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Oslo"}] * 2
    assert calls[0]["id"] != calls[1]["id"]  # each sample's own
    if parser == "mistral":
        assert all(re.fullmatch("[A-Za-z0-9]{9}", c["id"]) for c in calls)
    assert by_row[(1, 0)]["tool_calls"] == [] and by_row[(1, 0)]["completion"] == "no call here"
    assert by_row[(2, 0)]["tool_calls"] == [] and by_row[(2, 0)]["completion"] == call[:-16]
    assert by_row[(3, 0)]["finish_reason"] == "error" and by_row[(3, 0)]["tool_calls"] is None
    assert {p.skip_special_tokens for p in engine.params.values()} == {parser != "mistral"}


def test_tools_in_a_job_file(tmp_path):
    from batchinfer.job.config_file import load_job_file
    (tmp_path / "job.toml").write_text(
        'model = "demo"\n'
        '[[tools]]\ntype = "function"\n'
        'function = {name = "get_weather", description = "The current weather in a city.", '
        'parameters = {type = "object", properties = {city = {type = "string"}}, '
        'required = ["city"]}}\n')
    values = load_job_file(tmp_path / "job.toml")
    assert JobOptions(tools=values["tools"]).tools_value() == TOOLS


def test_llm_chat_hands_tools_to_the_template(tmp_path, qwen3_dir):
    from batchinfer import LLM, SamplingParams
    from jobtools import ENGINE_KWARGS
    model_dir = with_template(qwen3_dir, tmp_path / "model", QWEN3_TEMPLATE)
    llm = LLM(str(model_dir), **ENGINE_KWARGS)
    [out] = llm.chat(CONVERSATIONS[1], SamplingParams(max_tokens=1), tools=TOOLS)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.decode(out.prompt_token_ids) == templated(
        QWEN3_TEMPLATE, CONVERSATIONS[1], TOOLS, model_dir)
