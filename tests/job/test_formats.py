"""End to end through `batchinfer run`: every input format gives the Python API's completions,
every input column unchanged, and the documented output columns."""
from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from batchinfer import SamplingParams
from batchinfer.job.schema import schema_from_json, schema_to_json

PROMPTS = ["The river runs", "Once upon a time", "In the morning the", "A short note on",
           "The river runs fast", "Numbers are"]
GREEDY = SamplingParams(max_tokens=5, temperature=0.0)
SAMPLING_FLAGS = ["--max-tokens", "5", "--temperature", "0"]
STAT_COLUMNS = {
    "id": None, "sample_index": pa.int32(), "completion": pa.string(),
    "prompt_tokens": pa.int64(), "cached_tokens": pa.int64(), "output_tokens": pa.int64(),
    "finish_reason": pa.string(), "queue_s": pa.float64(), "ttft_s": pa.float64(),
    "tpot_s": pa.float64(), "e2e_s": pa.float64(), "preemptions": pa.int64(),
    "error": pa.string(),
}


def read_output(outdir) -> pa.Table:
    table = ds.dataset(outdir).to_table()
    for name, type_ in STAT_COLUMNS.items():
        assert name in table.column_names, name
        if type_ is not None:
            assert table.schema.field(name).type == type_, name
    return table.sort_by([("id", "ascending"), ("sample_index", "ascending")])


def generate(llm, prompts, params=GREEDY) -> list[str]:
    return [o.outputs[0].text for o in llm.generate(prompts, params)]


def check_ok(result) -> None:
    assert result.exit_code == 0, result.output


@pytest.fixture
def expected(reference_llm) -> list[str]:
    return generate(reference_llm, PROMPTS)


def test_parquet_keeps_columns_and_matches_generate(tmp_path, run_cli, reference_llm, expected):
    source = pa.table({
        "prompt": PROMPTS,
        "score": [1.5, 2.0, None, 4.0, 5.0, 6.25],
        "meta": [{"k": i, "tags": ["a"] * i} for i in range(len(PROMPTS))],
    })
    pq.write_table(source, tmp_path / "in.parquet")
    result = run_cli(tmp_path / "in.parquet", "-o", tmp_path / "out", *SAMPLING_FLAGS)
    check_ok(result)
    table = read_output(tmp_path / "out")
    assert table.column("id").to_pylist() == list(range(len(PROMPTS)))
    assert table.select(source.column_names).equals(source)
    assert table.column("completion").to_pylist() == expected
    assert set(table.column("finish_reason").to_pylist()) <= {"stop", "length"}
    assert table.column("error").null_count == len(PROMPTS)
    outs = reference_llm.generate(PROMPTS, GREEDY)
    assert table.column("prompt_tokens").to_pylist() == [len(o.prompt_token_ids) for o in outs]
    assert table.column("output_tokens").to_pylist() == [len(o.outputs[0].token_ids) for o in outs]
    summary = json.loads((tmp_path / "out" / "__batchinfer__" / "summary.json").read_text())
    assert summary["rows"] == len(PROMPTS) and summary["errors"] == 0
    assert summary["output_tokens"] == sum(table.column("output_tokens").to_pylist())
    for key in ("prompt_tokens", "cached_tokens", "wall_s", "rows_per_s", "output_tokens_per_s",
                "total_tokens_per_s", "prefix_cache_hit_rate", "preemptions",
                "queue_s_p50", "ttft_s_p90", "tpot_s_p99", "e2e_s_p50"):
        assert key in summary, key


def test_jsonl_with_id_column_n_and_extra_columns(tmp_path, run_cli, reference_llm):
    rows = [{"key": f"r{i}", "prompt": p, "extra": {"i": i} if i % 2 else None}
            for i, p in enumerate(PROMPTS)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = run_cli(tmp_path / "in.jsonl", "-o", tmp_path / "out", "--id-column", "key",
                     "--n", "2", "--save-token-ids", "--logprobs", "2", *SAMPLING_FLAGS)
    check_ok(result)
    table = read_output(tmp_path / "out")
    assert table.num_rows == 2 * len(PROMPTS)
    assert table.column("id").to_pylist() == [f"r{i}" for i in range(len(PROMPTS)) for _ in "ab"]
    assert table.column("sample_index").to_pylist() == [0, 1] * len(PROMPTS)
    assert table.column("extra").to_pylist()[::2] == [r["extra"] for r in rows]
    outs = reference_llm.generate(PROMPTS, SamplingParams(max_tokens=5, temperature=0.0, n=2))
    assert table.column("completion").to_pylist() == [c.text for o in outs for c in o.outputs]
    assert table.column("token_ids").to_pylist() == [c.token_ids for o in outs for c in o.outputs]
    assert table.column("prompt_token_ids").to_pylist()[::2] == [o.prompt_token_ids for o in outs]
    logprobs = table.column("logprobs").to_pylist()
    assert all(len(steps) == n for steps, n in zip(logprobs, table.column("output_tokens").to_pylist()))
    assert all(any(e["token_id"] == tid for e in step)
               for steps, tids in zip(logprobs, table.column("token_ids").to_pylist())
               for step, tid in zip(steps, tids))


def test_csv_infers_numbers_keeps_text(tmp_path, run_cli, expected):
    lines = ["prompt,count,code"] + [f'"{p}",{i},00{i}x' for i, p in enumerate(PROMPTS)]
    (tmp_path / "in.csv").write_text("\n".join(lines) + "\n")
    check_ok(run_cli(tmp_path / "in.csv", "-o", tmp_path / "out", *SAMPLING_FLAGS))
    table = read_output(tmp_path / "out")
    assert table.schema.field("count").type == pa.int64()
    assert table.column("count").to_pylist() == list(range(len(PROMPTS)))
    assert table.column("code").to_pylist() == [f"00{i}x" for i in range(len(PROMPTS))]
    assert table.column("completion").to_pylist() == expected


def test_directory_of_files_numbers_rows_across_files(tmp_path, run_cli, expected):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:4]))
    (data / "b.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[4:]))
    (data / "_ignored.jsonl").write_text('{"prompt": "not me"}\n')
    check_ok(run_cli(data, "-o", tmp_path / "out", *SAMPLING_FLAGS))
    table = read_output(tmp_path / "out")
    assert table.column("id").to_pylist() == list(range(len(PROMPTS)))
    assert table.column("completion").to_pylist() == expected


def test_save_to_disk_and_hf_local(tmp_path, run_cli, expected):
    import datasets
    datasets.Dataset.from_dict({"prompt": PROMPTS, "n": list(range(len(PROMPTS)))}).save_to_disk(
        str(tmp_path / "saved"))
    check_ok(run_cli(tmp_path / "saved", "-o", tmp_path / "out1", *SAMPLING_FLAGS))
    assert read_output(tmp_path / "out1").column("completion").to_pylist() == expected

    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "train.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    check_ok(run_cli(f"hf:{repo}:train", "-o", tmp_path / "out2", *SAMPLING_FLAGS))
    assert read_output(tmp_path / "out2").column("completion").to_pylist() == expected


def test_messages_column_and_system_prompt(tmp_path, run_cli, reference_llm):
    convs = [[{"role": "user", "content": p}] for p in PROMPTS[:3]]
    convs.append([{"role": "system", "content": "Own system."}, {"role": "user", "content": "Hi"}])
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    (tmp_path / "system.txt").write_text("Answer briefly.")
    check_ok(run_cli(tmp_path / "in.jsonl", "-o", tmp_path / "out", "--system-prompt",
                     f"@{tmp_path / 'system.txt'}", *SAMPLING_FLAGS))
    table = read_output(tmp_path / "out")
    system = {"role": "system", "content": "Answer briefly."}
    reference = [[system, *c] for c in convs[:3]] + [convs[3]]  # a row's own system message wins
    expected = [o.outputs[0].text for o in reference_llm.chat(reference, GREEDY)]
    assert table.column("completion").to_pylist() == expected
    assert table.column("messages").to_pylist() == convs

    # With a prompt column, --system-prompt turns each prompt into a chat.
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    check_ok(run_cli(tmp_path / "p.jsonl", "-o", tmp_path / "out2", "--system-prompt",
                     "Answer briefly.", *SAMPLING_FLAGS))
    chats = [[system, {"role": "user", "content": p}] for p in PROMPTS]
    expected = [o.outputs[0].text for o in reference_llm.chat(chats, GREEDY)]
    assert read_output(tmp_path / "out2").column("completion").to_pylist() == expected


TEMPLATE = (
    "{%- for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{%- endfor %}"
    "{%- if add_generation_prompt %}<assistant>"
    "{%- if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}"
    "{%- endif %}")


def test_chat_template_file_and_variables(tmp_path, run_cli, reference_llm):
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    convs = [[{"role": "user", "content": p}] for p in PROMPTS[:3]]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    check_ok(run_cli(tmp_path / "in.jsonl", "-o", tmp_path / "out", "--chat-template",
                     tmp_path / "t.jinja", "--chat-template-kwargs",
                     '{"enable_thinking": false}', *SAMPLING_FLAGS))
    expected = reference_llm.chat(convs, GREEDY, chat_template=TEMPLATE,
                                  chat_template_kwargs={"enable_thinking": False})
    table = read_output(tmp_path / "out")
    assert table.column("completion").to_pylist() == [o.outputs[0].text for o in expected]
    assert table.column("prompt_tokens").to_pylist() == [len(o.prompt_token_ids) for o in expected]

    # OpenAI Batch lines carry their own variables (vLLM's chat_template_kwargs), over the flag's
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": c, "max_tokens": 3, "temperature": 0,
                       **({"chat_template_kwargs": {"enable_thinking": True}} if i else {})}}
             for i, c in enumerate(convs[:2])]
    (tmp_path / "batch.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    check_ok(run_cli(tmp_path / "batch.jsonl", "-o", tmp_path / "out2", "--chat-template",
                     tmp_path / "t.jinja", "--chat-template-kwargs", '{"enable_thinking": false}'))
    tok = reference_llm.get_tokenizer()
    lengths = [len(tok.encode(t, add_special_tokens=False)) for t in
               ("<user>" + PROMPTS[0] + "<assistant><no-think>", "<user>" + PROMPTS[1] + "<assistant>")]
    assert read_output(tmp_path / "out2").column("prompt_tokens").to_pylist() == lengths

    # a bad row's variables fail that row alone
    bad = dict(lines[0], custom_id="bad", body=dict(lines[0]["body"], chat_template_kwargs=[1]))
    (tmp_path / "bad.jsonl").write_text(json.dumps(bad) + "\n" + json.dumps(lines[1]) + "\n")
    check_ok(run_cli(tmp_path / "bad.jsonl", "-o", tmp_path / "out3", "--chat-template",
                     tmp_path / "t.jinja"))
    errors = read_output(tmp_path / "out3").column("error").to_pylist()
    assert "chat_template_kwargs must be an object" in errors[0] and errors[1] is None


VERDICT = {"type": "object", "properties": {"verdict": {"enum": ["yes", "no"]},
                                             "score": {"type": "integer", "minimum": 0,
                                                       "maximum": 100}},
           "required": ["verdict", "score"]}


def test_choice_and_per_line_constraints(tmp_path, run_cli, reference_llm):
    labels = ["positive", "negative", "mixed feelings"]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    check_ok(run_cli(tmp_path / "in.jsonl", "-o", tmp_path / "out", *SAMPLING_FLAGS,
                     "--max-tokens", "32", *[a for label in labels for a in ("--choice", label)]))
    table = read_output(tmp_path / "out")
    expected = reference_llm.generate(PROMPTS, GREEDY.clone(
        max_tokens=32, structured_outputs={"choice": labels}))
    assert table.column("completion").to_pylist() == [o.outputs[0].text for o in expected]
    assert set(table.column("completion").to_pylist()) <= set(labels)
    assert set(table.column("finish_reason").to_pylist()) == {"stop"}

    # OpenAI Batch lines: vLLM's guided_choice / structured_outputs, OpenAI's logit_bias
    tok = reference_llm.get_tokenizer()
    forced = tok.encode(" zebra", add_special_tokens=False)[0]
    bodies = [{"guided_choice": ["yes", "no"]},
              {"structured_outputs": {"choice": ["red", "green"]}},
              {"logit_bias": {str(forced): 100}, "max_tokens": 2},
              {"structured_outputs": {"regex": "(cat|dog)s?"}, "max_tokens": 12},
              {"guided_regex": "[0-9]{2}-[a-z]", "max_tokens": 12},
              {"response_format": {"type": "json_object"}, "max_tokens": 40},
              {"response_format": {"type": "json_schema", "json_schema": {
                  "name": "verdict", "schema": VERDICT}}, "max_tokens": 40},
              {"guided_json": VERDICT, "max_tokens": 40},
              {"guided_grammar": 'start: "yes" | "no" | "maybe"'}]
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "Answer:", "temperature": 0, "max_tokens": 5, **b}}
             for i, b in enumerate(bodies)]
    (tmp_path / "batch.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    check_ok(run_cli(tmp_path / "batch.jsonl", "-o", tmp_path / "out2", "--save-token-ids"))
    rows = read_output(tmp_path / "out2").to_pylist()
    assert rows[0]["completion"] in ("yes", "no") and rows[1]["completion"] in ("red", "green")
    assert rows[2]["token_ids"] == [forced, forced]
    assert re.fullmatch("(cat|dog)s?", rows[3]["completion"])
    assert re.fullmatch("[0-9]{2}-[a-z]", rows[4]["completion"])
    assert rows[5]["error"] is None and rows[5]["completion"].startswith("{")
    if rows[5]["finish_reason"] == "stop":  # else cut off by max_tokens
        assert isinstance(json.loads(rows[5]["completion"]), dict)
    assert rows[8]["completion"] in ("yes", "no", "maybe")
    for row in rows[6:8]:
        assert json.loads(row["completion"])["verdict"] in ("yes", "no"), row

    # --json-schema, as JSON text or @FILE
    (tmp_path / "schema.json").write_text(json.dumps(VERDICT))
    for value in (json.dumps(VERDICT), f"@{tmp_path / 'schema.json'}"):
        out = tmp_path / f"out-json-{len(value)}"
        check_ok(run_cli(tmp_path / "in.jsonl", "-o", out, *SAMPLING_FLAGS, "--max-tokens", "40",
                         "--json-schema", value))
        completions = read_output(out).column("completion").to_pylist()
        assert [json.loads(c)["verdict"] in ("yes", "no") for c in completions] \
            == [True] * len(PROMPTS)

    # --grammar @FILE (Lark) and --json-object
    (tmp_path / "answer.lark").write_text('start: "yes" | "no" | "maybe " DIGIT\nDIGIT: /[0-9]/\n')
    check_ok(run_cli(tmp_path / "in.jsonl", "-o", tmp_path / "out-grammar", *SAMPLING_FLAGS,
                     "--max-tokens", "8", "--grammar", f"@{tmp_path / 'answer.lark'}"))
    completions = read_output(tmp_path / "out-grammar").column("completion").to_pylist()
    assert all(re.fullmatch("yes|no|maybe [0-9]", c) for c in completions), completions
    check_ok(run_cli(tmp_path / "in.jsonl", "-o", tmp_path / "out-object", *SAMPLING_FLAGS,
                     "--max-tokens", "24", "--json-object"))
    for row in read_output(tmp_path / "out-object").to_pylist():
        assert row["completion"].startswith("{") and row["error"] is None, row
        if row["finish_reason"] == "stop":
            assert isinstance(json.loads(row["completion"]), dict)

    # --regex: every completion matches
    check_ok(run_cli(tmp_path / "in.jsonl", "-o", tmp_path / "out3", *SAMPLING_FLAGS,
                     "--max-tokens", "32", "--regex", r"[A-Z]{2}-\d{3}"))
    table = read_output(tmp_path / "out3")
    expected = reference_llm.generate(PROMPTS, GREEDY.clone(
        max_tokens=32, structured_outputs={"regex": r"[A-Z]{2}-\d{3}"}))
    assert table.column("completion").to_pylist() == [o.outputs[0].text for o in expected]
    assert all(re.fullmatch(r"[A-Z]{2}-\d{3}", c) for c in table.column("completion").to_pylist())


def test_prompt_logprobs_columns(tmp_path, run_cli, reference_llm):
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    check_ok(run_cli(tmp_path / "in.jsonl", "-o", tmp_path / "out", *SAMPLING_FLAGS,
                     "--prompt-logprobs", "1"))
    table = read_output(tmp_path / "out")
    expected = reference_llm.generate(PROMPTS, GREEDY.clone(prompt_logprobs=1))
    for row, out in zip(table.to_pylist(), expected):
        steps = row["prompt_logprobs"]
        assert steps[0] is None and len(steps) == len(out.prompt_token_ids)
        firsts = [s[0] for s in steps[1:]]  # the prompt token first, then the top 1
        assert [f["token_id"] for f in firsts] == out.prompt_token_ids[1:]
        assert row["prompt_logprob_sum"] == pytest.approx(sum(f["logprob"] for f in firsts),
                                                          abs=1e-3)
        assert row["prompt_logprob_sum"] == pytest.approx(
            sum(out.prompt_logprobs[i][t].logprob
                for i, t in enumerate(out.prompt_token_ids) if i), abs=1e-3)
    result = run_cli(tmp_path / "in.jsonl", "-o", tmp_path / "out2", "--prompt-logprobs", "-1")
    assert result.exit_code == 2 and "--prompt-logprobs" in result.output


def test_openai_batch_input_and_output(tmp_path, run_cli, reference_llm):
    lines = [
        {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "x", "messages": [{"role": "user", "content": "Hello"}],
                  "max_tokens": 3, "temperature": 0}},
        {"custom_id": "cmpl-1", "method": "POST", "url": "/v1/completions",
         "body": {"model": "x", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0,
                  "stop": ["zzzz"]}},
        {"custom_id": "bad-1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "x", "messages": [{"role": "user", "content": "Hi"}],
                  "temperature": -1}},
    ]
    (tmp_path / "batch.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    result = run_cli(tmp_path / "batch.jsonl", "-o", tmp_path / "out", "--output-format",
                     "openai", "--max-tokens", "7")
    check_ok(result)
    table = read_output(tmp_path / "out")
    by_id = {r["id"]: r for r in table.to_pylist()}
    chat = reference_llm.chat([[{"role": "user", "content": "Hello"}]],
                              SamplingParams(max_tokens=3, temperature=0))[0].outputs[0]
    cmpl = reference_llm.generate(["Once upon a time"],
                                  SamplingParams(max_tokens=4, temperature=0, stop=["zzzz"]))[0]
    assert by_id["chat-1"]["completion"] == chat.text
    assert by_id["chat-1"]["output_tokens"] == len(chat.token_ids) <= 3
    assert by_id["cmpl-1"]["completion"] == cmpl.outputs[0].text
    assert by_id["bad-1"]["finish_reason"] == "error" and "temperature" in by_id["bad-1"]["error"]
    assert by_id["chat-1"]["custom_id"] == "chat-1" and by_id["chat-1"]["url"] == lines[0]["url"]

    out_lines = [json.loads(s) for s in
                 (tmp_path / "out" / "__batchinfer__" / "openai_output.jsonl").read_text().splitlines()]
    responses = {o["custom_id"]: o["response"] for o in out_lines}
    assert set(responses) == {"chat-1", "cmpl-1", "bad-1"}
    assert responses["chat-1"]["status_code"] == 200
    body = responses["chat-1"]["body"]
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": chat.text}
    assert body["usage"]["completion_tokens"] == len(chat.token_ids)
    assert responses["cmpl-1"]["body"]["choices"][0]["text"] == cmpl.outputs[0].text
    assert responses["bad-1"]["status_code"] == 400
    assert body["choices"][0]["logprobs"] is None  # not asked for


def test_openai_batch_lines_ask_for_logprobs_themselves(tmp_path, run_cli, reference_llm):
    messages = [{"role": "user", "content": "Hello"}]
    lines = [
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": messages, "max_tokens": 3, "temperature": 0,
                  "logprobs": True, "top_logprobs": 2}},
        {"custom_id": "cmpl", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0,
                  "logprobs": 1}},
        {"custom_id": "plain", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "Once upon a time", "max_tokens": 2, "temperature": 0}},
    ]
    (tmp_path / "batch.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    check_ok(run_cli(tmp_path / "batch.jsonl", "-o", tmp_path / "out", "--output-format",
                     "openai"))  # no --logprobs flag: the lines ask
    by_id = {r["id"]: r for r in read_output(tmp_path / "out").to_pylist()}
    assert by_id["plain"]["logprobs"] is None
    ref = reference_llm.chat([messages], SamplingParams(max_tokens=3, temperature=0,
                                                         logprobs=2))[0].outputs[0]
    assert [[e["token_id"] for e in step] for step in by_id["chat"]["logprobs"]] \
        == [list(step) for step in ref.logprobs]

    out_lines = [json.loads(s) for s in
                 (tmp_path / "out" / "__batchinfer__" / "openai_output.jsonl").read_text().splitlines()]
    choices = {o["custom_id"]: o["response"]["body"]["choices"][0] for o in out_lines}
    content = choices["chat"]["logprobs"]["content"]
    assert len(content) == len(ref.token_ids)
    for item, token, step in zip(content, ref.token_ids, ref.logprobs):
        assert item["token"] == step[token].decoded_token
        assert item["logprob"] == pytest.approx(step[token].logprob, abs=1e-5)
        assert item["bytes"] == (None if "\ufffd" in item["token"]
                                 else list(item["token"].encode()))
        assert len(item["top_logprobs"]) == 2
        assert item["top_logprobs"][0]["logprob"] >= item["top_logprobs"][1]["logprob"]
    legacy = choices["cmpl"]["logprobs"]
    assert len(legacy["tokens"]) == len(legacy["token_logprobs"]) == 4
    assert all(len(top) == 1 for top in legacy["top_logprobs"])
    assert legacy["text_offset"][0] == 0 and legacy["text_offset"] == sorted(legacy["text_offset"])
    assert "".join(legacy["tokens"]) == choices["cmpl"]["text"]
    assert choices["plain"]["logprobs"] is None

    def rerun_choices():  # a finished job run again rewrites openai_output.jsonl
        check_ok(run_cli(tmp_path / "batch.jsonl", "-o", tmp_path / "out", "--output-format",
                         "openai"))
        lines = (tmp_path / "out" / "__batchinfer__" / "openai_output.jsonl").read_text()
        return {o["custom_id"]: o["response"]["body"]["choices"][0]
                for o in map(json.loads, lines.splitlines())}
    # merging keeps what the parts record about their logprobs order
    from batchinfer.job.manifest import OutputDir
    from batchinfer.job.merge import merge_parts
    merge_parts(OutputDir(tmp_path / "out"))
    assert rerun_choices()["chat"]["logprobs"] == choices["chat"]["logprobs"]
    # parts that do not record it (listed by rank: the sampled token cannot be told
    # apart) get no logprobs object rather than a wrong one
    manifest_path = tmp_path / "out" / "__batchinfer__" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for part in manifest["parts"]:
        del part["logprobs_order"]
    manifest_path.write_text(json.dumps(manifest))
    assert rerun_choices()["chat"]["logprobs"] is None


def test_openai_batch_lines_ask_for_prompt_logprobs(tmp_path, run_cli, reference_llm):
    messages = [{"role": "user", "content": "Hello"}]
    lines = [
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": messages, "max_tokens": 2, "temperature": 0,
                  "prompt_logprobs": 1}},
        {"custom_id": "cmpl", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "Once upon a time", "max_tokens": 2, "temperature": 0,
                  "prompt_logprobs": 2}},
        {"custom_id": "plain", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "Once upon a time", "max_tokens": 2, "temperature": 0}},
        {"custom_id": "bad", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "Once upon a time", "prompt_logprobs": -3}},
        {"custom_id": "cut", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "Once upon a time", "max_tokens": 2, "truncate_prompt_tokens": 2,
                  "prompt_logprobs": 0}},
    ]
    (tmp_path / "batch.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    check_ok(run_cli(tmp_path / "batch.jsonl", "-o", tmp_path / "out", "--output-format",
                     "openai", "--save-token-ids"))
    by_id = {r["id"]: r for r in read_output(tmp_path / "out").to_pylist()}
    assert by_id["plain"]["prompt_logprobs"] is None
    assert by_id["bad"]["finish_reason"] == "error" and "prompt_logprobs" in by_id["bad"]["error"]
    full_ids = reference_llm.get_tokenizer().encode("Once upon a time")
    assert by_id["cut"]["prompt_token_ids"] == full_ids[-2:]  # the last two
    assert len(by_id["cut"]["prompt_logprobs"]) == 2
    ref = reference_llm.generate(["Once upon a time"],
                                 SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2))[0]
    steps = by_id["cmpl"]["prompt_logprobs"]
    assert steps[0] is None and len(steps) == len(ref.prompt_token_ids)
    assert [s[0]["token_id"] for s in steps[1:]] == ref.prompt_token_ids[1:]

    out_lines = [json.loads(s) for s in
                 (tmp_path / "out" / "__batchinfer__" / "openai_output.jsonl").read_text().splitlines()]
    bodies = {o["custom_id"]: o["response"]["body"] for o in out_lines}
    listed = bodies["cmpl"]["choices"][0]["prompt_logprobs"]
    assert listed[0] is None and len(listed) == len(ref.prompt_token_ids)
    for i, (token, step) in enumerate(zip(ref.prompt_token_ids, ref.prompt_logprobs)):
        if i == 0:
            continue
        entry = listed[i][str(token)]
        assert entry["logprob"] == pytest.approx(step[token].logprob, abs=1e-5)
        assert entry["rank"] == step[token].rank
        assert entry["decoded_token"] == step[token].decoded_token
        assert {int(t) for t in listed[i]} == set(step)  # the prompt token and the top 2
    chat = bodies["chat"]
    assert "prompt_logprobs" not in chat["choices"][0]
    assert chat["prompt_logprobs"][0] is None
    column = by_id["chat"]["prompt_logprobs"]
    assert len(chat["prompt_logprobs"]) == len(column) == by_id["chat"]["prompt_tokens"]
    for listed_step, step in zip(chat["prompt_logprobs"][1:], column[1:]):
        assert listed_step == {str(e["token_id"]): {
            "logprob": pytest.approx(e["logprob"]), "rank": e["rank"],
            "decoded_token": e["token"]} for e in step}
    assert [s[0]["token_id"] for s in column[1:]] == by_id["chat"]["prompt_token_ids"][1:]
    assert bodies["plain"]["choices"][0]["prompt_logprobs"] is None  # null, as vLLM writes


def test_openai_output_older_than_its_prompt_logprobs_columns_resumes(tmp_path, run_cli,
                                                                      monkeypatch):
    """An OpenAI job whose output was written before the prompt_logprobs columns existed:
    resumed, lines asking for prompt logprobs still complete (what cannot be stored is not
    computed) and every part keeps the recorded schema."""
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": p, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1}}
             for i, p in enumerate(PROMPTS)]
    (tmp_path / "batch.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    out = tmp_path / "out"
    flags = ["-o", out, "--output-format", "openai"]
    check_ok(run_cli(tmp_path / "batch.jsonl", *flags, "--limit", "2"))
    dropped = ["prompt_logprobs", "prompt_logprob_sum"]
    manifest_path = out / "__batchinfer__" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    recorded = schema_from_json(manifest["output_schema"])
    assert set(dropped) <= set(recorded.names)
    older = pa.schema([f for f in recorded if f.name not in dropped], metadata=recorded.metadata)
    manifest["output_schema"] = schema_to_json(older)
    for part in manifest["parts"]:
        path = out / part["file"]
        pq.write_table(pq.read_table(path).drop_columns(dropped), path)
        part["bytes"] = path.stat().st_size
    manifest_path.write_text(json.dumps(manifest))

    from batchinfer.engine.engine import LLMEngine
    asked = []
    add_request = LLMEngine.add_request

    def recording(self, request_id, prompt, params, *args, **kwargs):
        asked.append(params.prompt_logprobs)
        return add_request(self, request_id, prompt, params, *args, **kwargs)
    monkeypatch.setattr(LLMEngine, "add_request", recording)
    check_ok(run_cli(tmp_path / "batch.jsonl", *flags))
    assert asked == [None] * (len(PROMPTS) - 2)  # not computed: nowhere to store them
    table = read_output(out)
    assert table.num_rows == len(PROMPTS) and not set(dropped) & set(table.column_names)
    assert table["error"].to_pylist() == [None] * len(PROMPTS)
    for part in json.loads(manifest_path.read_text())["parts"]:
        assert pq.read_schema(out / part["file"]).names == older.names
    bodies = [json.loads(s)["response"]["body"] for s in
              (out / "__batchinfer__" / "openai_output.jsonl").read_text().splitlines()]
    assert len(bodies) == len(PROMPTS)
    assert all(b["choices"][0]["prompt_logprobs"] is None for b in bodies)


def test_output_reads_with_datasets(tmp_path, run_cli):
    import datasets
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    check_ok(run_cli(tmp_path / "in.jsonl", "-o", tmp_path / "out", "--commit-rows", "2",
                     "--max-num-seqs", "2", *SAMPLING_FLAGS))
    loaded = datasets.load_dataset("parquet", data_dir=str(tmp_path / "out"),
                                   cache_dir=str(tmp_path / "cache"), split="train")
    assert sorted(loaded["id"]) == list(range(len(PROMPTS)))
    assert len(list((tmp_path / "out").glob("part-*.parquet"))) >= 2


def test_pandas_and_datasets_descriptions_of_input_columns_are_kept(tmp_path, run_cli):
    import datasets
    import pandas as pd
    frame = pd.DataFrame({"prompt": ["a b", "c d", "e f"],
                          "big": pd.array([2 ** 53 + 1, None, 3], dtype="Int64"),
                          "flag": pd.array([True, None, False], dtype="boolean"),
                          "size": pd.Categorical(["large", "small", "large"], ordered=True,
                                                 categories=["small", "medium", "large"])},
                         index=pd.Index([10, 20, 30], name="row"))
    frame.to_parquet(tmp_path / "frame.parquet")
    check_ok(run_cli(tmp_path / "frame.parquet", "-o", tmp_path / "out1", *SAMPLING_FLAGS))
    back = pd.read_parquet(tmp_path / "out1").sort_index()
    assert back.index.name == "row" and back.index.tolist() == [10, 20, 30]
    assert str(back["big"].dtype) == "Int64" and back["big"].tolist()[0] == 2 ** 53 + 1
    assert str(back["flag"].dtype) == "boolean"
    # an ordered Categorical keeps its categories, their order and the unused one
    assert back["size"].cat.categories.tolist() == ["small", "medium", "large"]
    assert back["size"].cat.ordered and (back["size"] > "small").tolist() == [True, False, True]

    labelled = datasets.Dataset.from_dict(
        {"prompt": ["a b", "c d"], "label": [1, 0]},
        features=datasets.Features({"prompt": datasets.Value("string"),
                                    "label": datasets.ClassLabel(names=["neg", "pos"])}))
    labelled.to_parquet(str(tmp_path / "labelled.parquet"))
    check_ok(run_cli(tmp_path / "labelled.parquet", "-o", tmp_path / "out2", *SAMPLING_FLAGS))
    loaded = datasets.load_dataset("parquet", data_dir=str(tmp_path / "out2"),
                                   cache_dir=str(tmp_path / "cache"), split="train")
    assert loaded.features["label"] == datasets.ClassLabel(names=["neg", "pos"])
    assert loaded.features["completion"] == datasets.Value("string")
