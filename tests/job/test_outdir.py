"""OUTDIR bookkeeping: orphans from a crash, the lock, merge, job files."""
from __future__ import annotations

import json

import pyarrow.dataset as ds
import pytest
from click.testing import CliRunner

from batchinfer.job.cli import merge
from batchinfer.job.config_file import load_job_file
from batchinfer.job.errors import JobError
from batchinfer.job.manifest import OutputDir
from batchinfer.flags import parse_size
from batchinfer.job.options import JobOptions
from batchinfer.job.runner import run_job
from fake_engine import FakeEngine


def fake_job(tmp_path, rows: int = 30, **kwargs) -> JobOptions:
    path = tmp_path / "in.jsonl"
    if not path.exists():
        path.write_text("".join(json.dumps({"prompt": f"row {i}"}) + "\n" for i in range(rows)))
    return JobOptions(input=str(path), model="stand-in", output=str(tmp_path / "out"),
                      max_tokens=2, progress=False, **kwargs)


def run_fake(options: JobOptions, max_num_seqs: int = 2):
    import io
    return run_job(options, lambda m, k: FakeEngine(max_num_seqs), out=io.StringIO(),
                   err=io.StringIO())


def test_orphans_and_temporaries_are_removed_on_restart(tmp_path):
    options = fake_job(tmp_path, limit=10, commit_rows=3)
    assert run_fake(options).exit_code == 0
    out = tmp_path / "out"
    (out / "part-000999-deadbeef.parquet").write_bytes(b"left by a crash")
    (out / ".part-001000-0badf00d.parquet.tmp").write_bytes(b"half written")
    (out / "__batchinfer__" / ".manifest.json.1234.tmp").write_text("{")
    assert run_fake(fake_job(tmp_path, commit_rows=3)).exit_code == 0
    assert not (out / "part-000999-deadbeef.parquet").exists()
    assert not list(out.glob(".*.tmp")) and not list((out / "__batchinfer__").glob(".*"))
    ids = ds.dataset(out).to_table().column("id").to_pylist()
    assert sorted(ids) == list(range(30))


def test_a_second_process_cannot_write_the_same_outdir(tmp_path):
    options = fake_job(tmp_path)
    outdir = OutputDir(options.output)
    assert run_fake(fake_job(tmp_path, limit=5)).exit_code == 0
    outdir.lock()
    try:
        with pytest.raises(JobError, match="another batchinfer process"):
            run_fake(options)
    finally:
        outdir.close()


def test_merge_compacts_parts_and_the_job_still_resumes(tmp_path):
    assert run_fake(fake_job(tmp_path, limit=20, commit_rows=3)).exit_code == 0
    out = tmp_path / "out"
    before = ds.dataset(out).to_table().sort_by("id")
    assert len(list(out.glob("part-*.parquet"))) > 3
    result = CliRunner().invoke(merge, [str(out)])
    assert result.exit_code == 0, result.output
    assert [p.name for p in out.glob("part-*.parquet")] == \
        [p["file"] for p in json.loads((out / "__batchinfer__" / "manifest.json").read_text())["parts"]]
    assert len(list(out.glob("part-*.parquet"))) == 1
    assert ds.dataset(out).to_table().sort_by("id").equals(before)
    assert run_fake(fake_job(tmp_path, commit_rows=3)).exit_code == 0  # the other 10 rows
    assert sorted(ds.dataset(out).to_table().column("id").to_pylist()) == list(range(30))
    result = CliRunner().invoke(merge, [str(out), "--rows-per-file", "12"])
    assert result.exit_code == 0 and len(list(out.glob("part-*.parquet"))) == 3
    assert CliRunner().invoke(merge, [str(out)]).exit_code == 0  # back to one part...
    result = CliRunner().invoke(merge, [str(out), "--rows-per-file", "7"])
    assert result.exit_code == 0 and len(list(out.glob("part-*.parquet"))) == 5  # ...split
    assert sorted(ds.dataset(out).to_table().column("id").to_pylist()) == list(range(30))
    assert CliRunner().invoke(merge, [str(tmp_path)]).exit_code == 2


def test_job_file_paths_types_and_overrides(tmp_path, monkeypatch):
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    (jobs / "system.txt").write_text("Be brief.")
    (jobs / "job.toml").write_text(
        'input = "data/in.jsonl"\noutput = "../out/job"\nmodel = "demo"\n'
        'system-prompt = "@system.txt"\nkv_cache_memory = "1GiB"\n'
        'chat-template = "chat.jinja"\nchat-template-kwargs = {enable_thinking = false}\n'
        '[sampling]\nmax-tokens = 8\ntemperature = 0.0\nstop = ["\\n"]\n')
    (jobs / "chat.jinja").write_text("{{ messages[0]['content'] }}")
    values = load_job_file(jobs / "job.toml")
    assert values["chat_template"] == str(jobs / "chat.jinja")
    assert values["input"] == str(jobs / "data" / "in.jsonl")
    assert values["output"] == str(jobs / "../out/job")
    assert values["system_prompt"] == "@" + str(jobs / "system.txt")
    assert values["max_tokens"] == 8 and values["stop"] == ["\n"]
    assert parse_size("1GiB") == 2**30 and parse_size("512MB") == 512 * 10**6

    seen = {}
    monkeypatch.setattr("batchinfer.job.runner.run_job",
                        lambda options: seen.setdefault("o", options) and None)
    from batchinfer.job.cli import run
    CliRunner().invoke(run, ["--config", str(jobs / "job.toml"), "--max-tokens", "3"])
    options = seen["o"]
    assert options.max_tokens == 3 and options.temperature == 0.0
    # an on/off setting of the file turned off by its --no- flag
    (jobs / "flags.toml").write_text('model = "demo"\nsave-token-ids = true\nignore-eos = true\n')
    seen.clear()
    CliRunner().invoke(run, ["--config", str(jobs / "flags.toml"), "--no-save-token-ids"])
    assert seen["o"].save_token_ids is False and seen["o"].ignore_eos is True
    assert options.kv_cache_memory == 2**30 and options.system_prompt_text() == "Be brief."
    assert options.chat_template_text() == "{{ messages[0]['content'] }}"
    assert options.template_kwargs() == {"enable_thinking": False}

    (jobs / "bad.toml").write_text('model = "demo"\nmax-tokens = "many"\n')
    result = CliRunner().invoke(run, ["--config", str(jobs / "bad.toml")])
    assert result.exit_code == 2 and "max_tokens" in result.stderr
    # a value of the wrong TOML type is refused, not converted (2.5 is not 2, 1 not "1")
    for line, words in (("max-tokens = 2.5", "expected an integer"),
                        ("limit = true", "expected an integer"),
                        ('stop = [1, 2]', "expected a string"),
                        ('temperature = "0.5"', "expected a number")):
        (jobs / "typed.toml").write_text(f'model = "demo"\n{line}\n')
        result = CliRunner().invoke(run, ["--config", str(jobs / "typed.toml")])
        assert result.exit_code == 2 and words in result.stderr, (line, result.stderr)
    # a tokenizer directory beside the job file, like a model directory
    (jobs / "tok").mkdir()
    (jobs / "tok.toml").write_text('model = "demo"\ntokenizer = "tok"\n')
    assert load_job_file(jobs / "tok.toml")["tokenizer"] == str(jobs / "tok")
    (jobs / "unknown.toml").write_text('modle = "demo"\n')
    result = CliRunner().invoke(run, ["--config", str(jobs / "unknown.toml")])
    assert result.exit_code == 2 and "unknown option 'modle'" in result.stderr


def test_an_outdir_without_finished_rows_is_not_held_against_a_corrected_command(tmp_path):
    assert run_fake(fake_job(tmp_path, limit=0)).exit_code == 0  # nothing committed
    corrected = fake_job(tmp_path, commit_rows=3)
    corrected.max_tokens = 3
    assert run_fake(corrected).exit_code == 0
    assert ds.dataset(tmp_path / "out").to_table().num_rows == 30


def test_progress_logs_lines_off_a_terminal():
    import io
    from batchinfer.job.progress import Progress
    stream = io.StringIO()
    progress = Progress(total=10, initial=4, stream=stream, interval=0.0)
    progress.update(2, output_tokens=20, prompt_tokens=100, cached_tokens=25)
    progress.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("batchinfer: 6/10 (60.0%) rows") and "cache hit 25.0%" in lines[0]
    assert "eta" in lines[0]
    quiet = io.StringIO()
    progress = Progress(total=None, initial=0, enabled=False, stream=quiet)
    progress.update(1, 1, 1, 1)
    progress.close()
    assert quiet.getvalue() == ""


def test_what_makes_a_job_another_one(tmp_path, monkeypatch):
    assert run_fake(fake_job(tmp_path, limit=10)).exit_code == 0

    def continues(**kwargs) -> bool:
        try:
            return run_fake(fake_job(tmp_path, **kwargs)).exit_code == 0
        except JobError as e:
            assert "holds the output of a different job" in str(e)
            return False

    # one model directory, however the path is written
    (tmp_path / "models" / "m").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    first = fake_job(tmp_path, limit=12)
    first.model = "models/m"
    first.output = str(tmp_path / "out-m")
    assert run_fake(first).exit_code == 0
    monkeypatch.chdir(tmp_path / "models")
    again = fake_job(tmp_path, limit=14)
    again.model, again.output = "./m", first.output
    assert run_fake(again).exit_code == 0
    # another dtype is another job: its rows would not match the ones written
    assert not continues(limit=12, dtype="bfloat16")
    # an input edited in place keeps its size but not its content
    path = tmp_path / "in.jsonl"
    path.write_text(path.read_text().replace("row 1", "ROW 1"))
    assert not continues(limit=12)


def test_a_job_recorded_with_fewer_settings_continues(tmp_path):
    # a manifest that records no dtype and no input digest (a description naming fewer
    # things) agrees on them
    assert run_fake(fake_job(tmp_path, limit=10)).exit_code == 0
    manifest_path = tmp_path / "out" / "__batchinfer__" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["job"]["dtype"]
    manifest["job"]["input"]["files"] = [f[:2] for f in manifest["job"]["input"]["files"]]
    manifest["fingerprint"] = "recorded-by-another-description"
    manifest_path.write_text(json.dumps(manifest))
    result = run_fake(fake_job(tmp_path, limit=12))
    assert result.exit_code == 0 and result.summary["rows"] == 12


def test_a_sampling_setting_the_record_lacks_must_be_left_unset(tmp_path):
    # a job recorded before a sampling setting existed continues while the setting stays
    # unset; given a value, it would change the rows still to come: another job
    assert run_fake(fake_job(tmp_path, limit=10)).exit_code == 0
    manifest_path = tmp_path / "out" / "__batchinfer__" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["job"]["sampling"]["truncate_prompt_tokens"]
    manifest["fingerprint"] = "recorded-before-the-setting"
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(JobError, match="sampling.truncate_prompt_tokens"):
        run_fake(fake_job(tmp_path, limit=12, truncate_prompt_tokens=4))
    result = run_fake(fake_job(tmp_path, limit=12))
    assert result.exit_code == 0 and result.summary["rows"] == 12
