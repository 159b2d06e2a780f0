"""Prompts rendered from a row's columns: --prompt-template, --messages-template (or a job
file's [messages]), --system-prompt over columns, --keep-prompt; a missing column exits 2
before the model loads; a row whose render fails is an error row; rendering is bounded."""
from __future__ import annotations

import json
import time

import pyarrow.dataset as ds
import pytest
from transformers import AutoTokenizer

from batchinfer import SamplingParams
from batchinfer.job.templates import MAX_RENDER_CHARS, RenderError, RowTemplates

ROWS = [
    {"title": "Rivers", "tags": ["water", "maps"], "lang": "en"},
    {"title": "Hills", "tags": [], "lang": "fr"},
    {"title": None, "tags": ["x"], "lang": "en"},
]
TEMPLATE = ("Write about {{ title | upper }}{% if tags %} ({{ tags | join(', ') }})"
            "{% endif %}{% for t in tags %} #{{ loop.index }}={{ t }}{% endfor %}")


def expected(row: dict) -> str:
    """TEMPLATE rendered by hand."""
    text = f"Write about {row['title'].upper()}"
    if row["tags"]:
        text += f" ({', '.join(row['tags'])})"
    return text + "".join(f" #{i}={t}" for i, t in enumerate(row["tags"], 1))


def write_rows(path, rows=ROWS):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_rows(out) -> dict:
    return {r["id"]: r for r in ds.dataset(out).to_table().to_pylist()}


def test_prompt_template_over_columns_with_loops_and_kept_prompts(tmp_path, run_cli,
                                                                  reference_llm):
    data = write_rows(tmp_path / "in.jsonl")
    result = run_cli(data, "-o", tmp_path / "out", "--prompt-template", TEMPLATE,
                     "--keep-prompt", "--max-tokens", "4", "--temperature", "0")
    assert result.exit_code == 0, result.output
    rows = read_rows(tmp_path / "out")
    texts = [expected(ROWS[0]), expected(ROWS[1])]
    refs = reference_llm.generate(texts, SamplingParams(max_tokens=4, temperature=0))
    for i, (text, ref) in enumerate(zip(texts, refs)):
        assert rows[i]["prompt"] == text
        assert rows[i]["completion"] == ref.outputs[0].text
        assert rows[i]["prompt_tokens"] == len(ref.prompt_token_ids)
        assert rows[i]["error"] is None
    # the null title: this row alone fails, naming the flag, the variable and why
    assert rows[2]["finish_reason"] == "error" and rows[2]["prompt"] is None
    assert "--prompt-template" in rows[2]["error"] and "'title' is undefined" in rows[2]["error"]
    assert "null in this row" in rows[2]["error"]


def test_the_prompt_is_not_stored_without_keep_prompt(tmp_path, run_cli):
    data = write_rows(tmp_path / "in.jsonl", ROWS[:1])
    result = run_cli(data, "-o", tmp_path / "out", "--prompt-template", "@" + str(
        _file(tmp_path / "t.j2", TEMPLATE)), "--max-tokens", "2")
    assert result.exit_code == 0, result.output
    table = ds.dataset(tmp_path / "out").to_table()
    assert "prompt" not in table.column_names
    assert expected(ROWS[0]) not in json.dumps(table.to_pylist())


def _file(path, text):
    path.write_text(text)
    return path


@pytest.mark.parametrize("flag, value", [
    ("--prompt-template", "About {{ title }} and {{ summary }}"),
    ("--system-prompt", "You write in {{ language }}."),
])
def test_a_template_naming_a_missing_column_exits_2_naming_it(tmp_path, run_cli, flag, value,
                                                             monkeypatch):
    data = write_rows(tmp_path / "in.jsonl")
    args = ["--prompt-template", "{{ title }}"] if flag == "--system-prompt" else []
    monkeypatch.setattr("batchinfer.job.runner.load_engine", model_must_not_load)
    result = run_cli(data, "-o", tmp_path / "out", flag, value, *args)
    assert result.exit_code == 2
    missing = "summary" if flag == "--prompt-template" else "language"
    message = result.output.strip().splitlines()
    assert len(message) == 1 and flag in message[0]
    assert f"no column '{missing}'" in message[0]
    assert "columns: title, tags, lang" in message[0]
    assert not (tmp_path / "out").exists()


def model_must_not_load(*args):
    raise AssertionError("the model was loaded")


def test_a_column_named_like_a_jinja_global_is_the_column():
    templates = RowTemplates("{{ namespace }}, {{ range | upper }}", None, None,
                             ["namespace", "range"])
    assert templates.render_prompt({"namespace": "ns", "range": "wide"}) == "ns, WIDE"
    # and without such a column, the global
    templates = RowTemplates("{% for i in range(3) %}{{ i }}{% endfor %}", None, None, ["x"])
    assert templates.render_prompt({"x": 1}) == "012"


def test_template_syntax_errors_and_conflicting_flags_exit_2(tmp_path, run_cli):
    data = write_rows(tmp_path / "in.jsonl")
    result = run_cli(data, "-o", tmp_path / "out", "--prompt-template", "{% for x in tags %}")
    assert result.exit_code == 2 and "--prompt-template: line 1" in result.output
    result = run_cli(data, "-o", tmp_path / "out", "--prompt-template", " ")
    assert result.exit_code == 2 and "the template is empty" in result.output
    result = run_cli(data, "-o", tmp_path / "out", "--prompt-template", "{{ title }}",
                     "--prompt-column", "title")
    assert result.exit_code == 2
    assert "--prompt-column and --prompt-template cannot be combined" in result.output


def test_messages_template_file_and_a_system_prompt_over_columns(tmp_path, run_cli,
                                                                 job_model_dir):
    turns = [{"role": "user", "content": "Translate 'hello' to {{ lang }}."},
             {"role": "assistant", "content": "{% if lang == 'fr' %}bonjour{% endif %}"},
             {"role": "user", "content": "Now: {{ title }}"}]
    template = _file(tmp_path / "turns.json", json.dumps(turns))
    data = write_rows(tmp_path / "in.jsonl", ROWS[:2])
    result = run_cli(data, "-o", tmp_path / "out", "--messages-template", f"@{template}",
                     "--system-prompt", "Answer about {{ title }}.", "--keep-prompt",
                     "--max-tokens", "2")
    assert result.exit_code == 0, result.output
    rows = read_rows(tmp_path / "out")
    tokenizer = AutoTokenizer.from_pretrained(job_model_dir)
    for i, row in enumerate(ROWS[:2]):
        messages = [{"role": "system", "content": f"Answer about {row['title']}."},
                    {"role": "user", "content": f"Translate 'hello' to {row['lang']}."}]
        if row["lang"] == "fr":  # a turn rendering blank is left out
            messages.append({"role": "assistant", "content": "bonjour"})
        messages.append({"role": "user", "content": f"Now: {row['title']}"})
        want = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True)
        assert rows[i]["prompt"] == want
        assert rows[i]["error"] is None


def test_messages_table_of_a_job_file(tmp_path, run_cli, job_model_dir):
    data = write_rows(tmp_path / "in.jsonl", ROWS[:1])
    job = tmp_path / "job.toml"
    job.write_text(f'input = "{data.name}"\noutput = "out"\nkeep-prompt = true\n'
                   'max-tokens = 2\n\n[messages]\nsystem = "You like {{ lang }}."\n'
                   'user = "Tell me about {{ title }}."\n')
    result = run_cli("--config", job)
    assert result.exit_code == 0, result.output
    row = read_rows(tmp_path / "out")[0]
    tokenizer = AutoTokenizer.from_pretrained(job_model_dir)
    want = tokenizer.apply_chat_template(
        [{"role": "system", "content": "You like en."},
         {"role": "user", "content": "Tell me about Rivers."}],
        tokenize=False, add_generation_prompt=True)
    assert row["prompt"] == want


def test_a_changed_template_is_another_job(tmp_path, run_cli):
    data = write_rows(tmp_path / "in.jsonl", ROWS[:2])
    out = tmp_path / "out"
    assert run_cli(data, "-o", out, "--prompt-template", TEMPLATE, "--max-tokens",
                   "2").exit_code == 0
    again = run_cli(data, "-o", out, "--prompt-template", TEMPLATE, "--max-tokens", "2")
    assert again.exit_code == 0, again.output  # the same job: nothing left to do
    changed = run_cli(data, "-o", out, "--prompt-template", TEMPLATE + "!", "--max-tokens", "2")
    assert changed.exit_code == 2
    assert "different job" in changed.output and "rows.prompt_template" in changed.output


@pytest.mark.parametrize("template, reason", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "took over"),
    ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "over the limit"),
    ("{{ 'x' * 100000000 }}", "over the limit"),
    ("{{ 'x' | center(10000000000) }}", "over the limit"),
    ("{% set s = 'x' * 4000000 %}{{ s.replace('x', s) }}", "over the limit"),
    ("{{ 9 ** 99999999 }}", "over the limit"),
    ("{% set s = 'x' * 4000000 %}{% for i in range(40) %}{% set s = s ~ s %}{% endfor %}",
     "over the limit"),
    ("{% set ns = namespace(s='x' * 4000000) %}{% for i in range(40) %}"
     "{% set ns.s = ns.s + ns.s %}{% endfor %}", "over the limit"),
    ("{% set l = [1] * 4000000 %}{% for i in range(40) %}{% set l = l + l %}{% endfor %}",
     "over the limit"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
    ("{{ title.__class__.__mro__ }}", "SecurityError"),
])
def test_rendering_is_bounded_in_time_output_and_reach(template, reason):
    templates = RowTemplates(template, None, None, ["title"])
    start = time.monotonic()
    with pytest.raises(RenderError, match=reason) as e:
        templates.render_prompt({"title": "t"})
    assert str(e.value).startswith("--prompt-template")
    assert time.monotonic() - start < 5
    assert MAX_RENDER_CHARS < 10 ** 8


def test_a_runaway_row_fails_alone(tmp_path, run_cli):
    rows = [{"n": 1}, {"n": 10 ** 8}, {"n": 2}]
    data = write_rows(tmp_path / "in.jsonl", rows)
    result = run_cli(data, "-o", tmp_path / "out", "--max-tokens", "2", "--prompt-template",
                     "{{ 'ab ' * n }}go")
    assert result.exit_code == 0, result.output
    out = read_rows(tmp_path / "out")
    assert out[0]["error"] is None and out[2]["error"] is None
    assert "over the limit" in out[1]["error"]


def test_messages_template_files_in_their_forms(tmp_path):
    from batchinfer.job.errors import JobError
    from batchinfer.job.templates import parse_messages
    turns = [{"role": "system", "content": "S {{ a }}"}, {"role": "user", "content": "U"}]
    listed = _file(tmp_path / "m.toml", '[[messages]]\nrole = "system"\ncontent = "S {{ a }}"\n'
                   '[[messages]]\nrole = "user"\ncontent = "U"\n')
    table = _file(tmp_path / "t.toml", '[messages]\nsystem = "S {{ a }}"\nuser = "U"\n')
    as_json = _file(tmp_path / "m.json", json.dumps(turns))
    for path in (listed, table, as_json):
        assert parse_messages(f"@{path}") == turns
    assert parse_messages(json.dumps(turns)) == turns
    for text, why in (("[]", "non-empty list"), ('[{"role": "user"}]', "message 0 must be"),
                      ("{not json", "cannot parse")):
        with pytest.raises(JobError, match=why):
            parse_messages(text)
    with pytest.raises(JobError, match="cannot read"):
        parse_messages(f"@{tmp_path / 'missing.json'}")


def test_keep_prompt_with_a_prompt_column_is_refused(tmp_path, run_cli):
    data = write_rows(tmp_path / "in.jsonl", [{"prompt": "Hello there"}])
    result = run_cli(data, "-o", tmp_path / "out", "--keep-prompt")
    assert result.exit_code == 2 and "--keep-prompt adds a `prompt` column" in result.output
