"""Settings and rows a hostile or careless user can give: each costs one row or one line
before the model loads, never the job."""
from __future__ import annotations

import io
import json

import pyarrow.dataset as ds
import pytest
import torch

from batchinfer.job.errors import JobError
from batchinfer.flags import engine_flags_in
from batchinfer.job.options import JobOptions
from batchinfer.job.runner import run_job
from fake_engine import FakeEngine


def options(tmp_path, **kwargs) -> JobOptions:
    path = tmp_path / "in.jsonl"
    if not path.exists():
        tmp_path.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps({"prompt": f"row {i}"}) + "\n" for i in range(4)))
    return JobOptions(input=str(path), model="stand-in", output=str(tmp_path / "out"),
                      max_tokens=2, progress=False, **kwargs)


def run_fake(options: JobOptions) -> int:
    return run_job(options, lambda m, k: FakeEngine(4), out=io.StringIO(),
                   err=io.StringIO()).exit_code


def test_transformers_template_tags_are_accepted(tmp_path):
    """{% break %}, {% continue %} and {% generation %} are valid in transformers' chat
    templates; a real syntax error is still refused."""
    template = tmp_path / "t.jinja"
    template.write_text(
        "{% for m in messages %}{% if m['role'] == 'stop' %}{% break %}{% endif %}"
        "{% if not m['content'] %}{% continue %}{% endif %}"
        "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}"
        "{% else %}{{ m['content'] }}{% endif %}{% endfor %}")
    options(tmp_path, chat_template=str(template)).validate()
    template.write_text("{% for m in messages %}{{ m['content'] }}")
    with pytest.raises(JobError, match="--chat-template .*line 1"):
        options(tmp_path, chat_template=str(template)).validate()


def test_the_pickle_refusal_names_the_flag_once(tmp_path):
    from batchinfer.model.loader import iter_weights
    torch.save({"w": torch.zeros(1)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError) as caught:
        next(iter_weights(tmp_path, allow_pickle=False))
    message = engine_flags_in(str(caught.value))
    assert "set --allow-pickle-weights to load them" in message
    assert message.count("allow-pickle-weights") == 1 and "weights=True" not in message


@pytest.mark.parametrize("port, size, ok", [(65535, 1, True), (65535, 2, False),
                                            (65534, 2, True), (65530, 8, False),
                                            (65536, 1, False), (-1, 1, False)])
def test_every_data_parallel_metrics_port_is_checked_up_front(tmp_path, port, size, ok):
    job = options(tmp_path, metrics_port=port, data_parallel_size=size)
    if ok:
        job.validate()
    else:
        with pytest.raises(JobError, match="--metrics-port must be in"):
            job.validate()


def test_n_is_bounded_per_row_and_per_job(tmp_path):
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": f"row {i}", "max_tokens": 2, "n": n}}
             for i, n in enumerate([1, 200000, 3, 128])]
    (tmp_path / "batch.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    job = JobOptions(input=str(tmp_path / "batch.jsonl"), model="stand-in",
                     output=str(tmp_path / "out"), progress=False)
    assert run_fake(job) == 0
    rows = ds.dataset(tmp_path / "out").to_table().to_pylist()
    by_id = {}
    for row in rows:
        by_id.setdefault(row["id"], []).append(row)
    assert [len(by_id[f"r{i}"]) for i in range(4)] == [1, 1, 3, 128]
    assert "limit of 128 completions per row (--max-n)" in by_id["r1"][0]["error"]
    with pytest.raises(JobError, match="--n 200 is over --max-n 128"):
        options(tmp_path / "job", n=200).validate()
    options(tmp_path / "job", n=200, max_n=256).validate()


def test_a_system_prompt_file_is_recorded_by_digest(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the contents of some local file")
    assert run_fake(options(tmp_path, system_prompt=f"@{secret}")) == 0
    manifest = (tmp_path / "out" / "__batchinfer__" / "manifest.json").read_text()
    assert "the contents of some local file" not in manifest
    assert json.loads(manifest)["job"]["system_prompt"].startswith("sha256:")
    assert run_fake(options(tmp_path, system_prompt=f"@{secret}")) == 0  # resumes
    secret.write_text("another text")
    with pytest.raises(JobError, match="system_prompt differ"):
        run_fake(options(tmp_path, system_prompt=f"@{secret}"))


def test_random_weights_do_not_continue_a_job_of_real_ones(tmp_path):
    """--load-format changes every row: a job is not continued under another one."""
    assert run_fake(options(tmp_path, limit=2)) == 0
    with pytest.raises(JobError, match="load_format differ"):
        run_fake(options(tmp_path, load_format="dummy"))


def test_an_fp8_kv_cache_does_not_continue_a_job_of_the_models_dtype(tmp_path):
    """--kv-cache-dtype changes what attention reads: a job is continued only under the same
    cache (fp8 and fp8_e4m3 name one), and a job recorded before the setting existed is
    taken as the model dtype's."""
    assert run_fake(options(tmp_path, limit=2)) == 0
    with pytest.raises(JobError, match="kv_cache_dtype differ"):
        run_fake(options(tmp_path, kv_cache_dtype="fp8"))
    assert run_fake(options(tmp_path, limit=3, kv_cache_dtype="auto")) == 0
    fp8 = tmp_path / "fp8"
    assert run_fake(options(fp8, limit=2, kv_cache_dtype="fp8")) == 0
    assert run_fake(options(fp8, limit=3, kv_cache_dtype="fp8_e4m3")) == 0
    with pytest.raises(JobError, match="kv_cache_dtype differ"):
        run_fake(options(fp8))
    manifest_path = tmp_path / "out" / "__batchinfer__" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["job"]["kv_cache_dtype"]
    manifest["fingerprint"] = "recorded-before-the-setting"
    manifest_path.write_text(json.dumps(manifest))
    assert run_fake(options(tmp_path)) == 0
