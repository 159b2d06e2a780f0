"""Prometheus metrics: scraped over HTTP while a job runs, and written to a textfile."""
from __future__ import annotations

import io
import json
import re
import shutil
import threading
import time
import urllib.request

import pyarrow.dataset as ds
from prometheus_client.parser import text_string_to_metric_families

from batchinfer.job.options import JobOptions
from batchinfer.job.runner import run_job
from jobtools import ENGINE_KWARGS

NUM_ROWS = 40


def samples(text: str) -> dict[str, float]:
    """name{labels} -> value of every sample in a Prometheus exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def write_input(path) -> None:
    with open(path, "w") as f:
        for i in range(NUM_ROWS):
            f.write(json.dumps({"prompt": "Shared header for everyone, long enough to fill whole KV blocks. " * 3 + f"Row {i} asks"}) + "\n")


def test_http_endpoint_scraped_during_a_run(tmp_path, job_model_dir):
    write_input(tmp_path / "in.jsonl")
    engine = {k: v for k, v in ENGINE_KWARGS.items() if k != "max_num_seqs"}
    options = JobOptions(input=str(tmp_path / "in.jsonl"), model=str(job_model_dir),
                         output=str(tmp_path / "out"), max_tokens=8, ignore_eos=True,
                         max_num_seqs=2, metrics_port=0, progress=False, **engine)
    err = io.StringIO()
    result = {}
    job = threading.Thread(target=lambda: result.update(r=run_job(options, out=io.StringIO(),
                                                                   err=err)))
    job.start()
    try:
        deadline = time.monotonic() + 60
        while not (m := re.search(r"metrics on http://([\d.]+):(\d+)/metrics", err.getvalue())):
            assert job.is_alive() and time.monotonic() < deadline, err.getvalue()
            time.sleep(0.01)
        host, port = m.group(1), int(m.group(2))
        assert host == "127.0.0.1" and port > 0
        url = f"http://{host}:{port}/metrics"
        mid = None
        while job.is_alive():
            scraped = samples(urllib.request.urlopen(url, timeout=10).read().decode())
            if 0 < scraped["batchinfer:job_rows_done_total"] < NUM_ROWS:
                mid = scraped
                break
            time.sleep(0.02)
    finally:
        job.join(timeout=120)
    assert result["r"].exit_code == 0
    assert mid is not None, "the job ended before a scrape saw it part way"
    for name in ("batchinfer:num_requests_running", "batchinfer:num_requests_waiting",
                 "batchinfer:kv_cache_usage_perc", "batchinfer:prefix_cache_queries_total",
                 "batchinfer:prefix_cache_hits_total", "batchinfer:prompt_tokens_total",
                 "batchinfer:generation_tokens_total", "batchinfer:job_rows_failed_total",
                 "batchinfer:time_to_first_token_seconds_count",
                 "batchinfer:time_per_output_token_seconds_count",
                 "batchinfer:e2e_request_latency_seconds_count",
                 "batchinfer:request_queue_time_seconds_count"):
        assert name in mid, name
    done = mid["batchinfer:job_rows_done_total"]
    assert mid["batchinfer:generation_tokens_total"] == 8 * done
    assert mid["batchinfer:e2e_request_latency_seconds_count"] == done
    assert mid["batchinfer:job_rows"] == NUM_ROWS
    assert mid["batchinfer:prefix_cache_queries_total"] > 0
    assert 0 <= mid["batchinfer:kv_cache_usage_perc"] <= 1


def test_textfile_written_atomically_with_final_values(tmp_path, run_cli):
    write_input(tmp_path / "in.jsonl")
    textfile = tmp_path / "metrics" / "batchinfer.prom"
    textfile.parent.mkdir()
    result = run_cli(tmp_path / "in.jsonl", "-o", tmp_path / "out", "--max-tokens", "4",
                     "--metrics-textfile", textfile, "--metrics-interval", "0.01")
    assert result.exit_code == 0, result.output
    assert [p.name for p in textfile.parent.iterdir()] == ["batchinfer.prom"]
    values = samples(textfile.read_text())
    table = ds.dataset(tmp_path / "out").to_table()
    assert values["batchinfer:job_rows_done_total"] == NUM_ROWS
    assert values["batchinfer:job_rows_failed_total"] == 0
    assert values["batchinfer:generation_tokens_total"] == sum(
        table.column("output_tokens").to_pylist())
    assert values["batchinfer:prompt_tokens_total"] == sum(table.column("prompt_tokens").to_pylist())
    assert values["batchinfer:prefix_cache_hits_total"] > 0  # the shared header
    assert values['batchinfer:e2e_request_latency_seconds_bucket{le=+Inf}'] == NUM_ROWS
    assert values["batchinfer:e2e_request_latency_seconds_sum"] > 0
    assert values["batchinfer:num_requests_running"] == 0


def test_a_busy_metrics_port_is_a_fatal_mistake(tmp_path, run_cli, monkeypatch):
    import socket
    monkeypatch.setattr("batchinfer.job.runner.load_engine", lambda model, kwargs: 1 / 0)
    write_input(tmp_path / "in.jsonl")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_cli(tmp_path / "in.jsonl", "-o", tmp_path / "out", "--metrics-port", port)
    assert result.exit_code == 2
    assert result.stderr.startswith(f"Error: --metrics-port {port}: cannot listen")


def test_a_textfile_that_cannot_be_written_does_not_stop_the_job(tmp_path, caplog):
    from batchinfer.job.metrics import JobMetrics
    directory = tmp_path / "textfiles"
    directory.mkdir()
    metrics = JobMetrics(str(directory / "job.prom"), interval=0.0)
    metrics.tick(force=True)
    assert (directory / "job.prom").is_file()
    shutil.rmtree(directory)  # the directory goes away under a running job
    metrics.tick(force=True)
    metrics.tick(force=True)
    warnings = [r for r in caplog.records if "--metrics-textfile" in r.getMessage()]
    assert len(warnings) == 1  # said once, then the job goes on


def test_a_textfile_in_outdirs_own_directory_on_a_fresh_job(tmp_path, run_cli):
    write_input(tmp_path / "in.jsonl")
    textfile = tmp_path / "out" / "__batchinfer__" / "job.prom"  # made by the job itself
    result = run_cli(tmp_path / "in.jsonl", "-o", tmp_path / "out", "--max-tokens", "2",
                     "--metrics-textfile", textfile)
    assert result.exit_code == 0, result.output
    assert samples(textfile.read_text())["batchinfer:job_rows_done_total"] == NUM_ROWS
    assert ds.dataset(tmp_path / "out").to_table().num_rows == NUM_ROWS
