"""`batchinfer bench` end to end on the tiny shape: the Throughput line, the JSON summary,
prefix-cache hits, the transformers baseline and the model-stub overhead mode."""
from __future__ import annotations

import json
import re
import time

import pytest
import torch
from click.testing import CliRunner

from batchinfer.bench.cli import bench
from batchinfer.bench.overhead import TimedSampler, ZeroModel

THROUGHPUT = re.compile(r"^Throughput: ([\d.]+) requests/s, ([\d.]+) total tokens/s, "
                        r"([\d.]+) output tokens/s$", re.M)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("bench-cache")


def run_bench(cache_dir, *args: str) -> tuple[str, dict]:
    result = CliRunner().invoke(bench, ["--model", "tiny", "--cache-dir", str(cache_dir),
                                        "--num-kv-blocks", "96", "--device", "cpu", *args])
    assert result.exit_code == 0, result.output + repr(result.exception)
    out = result.stdout
    return out, json.loads(out[out.index("\n{\n") + 1:])


@pytest.mark.slow
def test_throughput_line_and_summary(cache_dir, tmp_path):
    out_json = tmp_path / "res" / "bench.json"
    out, summary = run_bench(cache_dir, "--num-prompts", "6", "--input-len", "24",
                             "--output-len", "5", "--output-json", str(out_json))
    m = THROUGHPUT.search(out)
    assert m, out
    assert json.loads(out_json.read_text()) == summary
    assert summary["num_requests"] == 6
    assert summary["output_tokens"] == 6 * 5
    assert summary["prompt_tokens"] == 6 * 24
    assert summary["total_num_tokens"] == 6 * 29
    elapsed = summary["elapsed_time"]
    assert 0 < elapsed < 60
    assert float(m.group(1)) == pytest.approx(6 / elapsed, rel=0.01, abs=0.01)
    assert float(m.group(3)) == pytest.approx(30 / elapsed, rel=0.01, abs=0.01)
    assert summary["prefix_cache_hit_rate"] == 0.0
    assert summary["prefill_tokens_computed"] == 6 * 24
    assert summary["num_preemptions"] == 0
    assert 0 < summary["ttft_p50_s"] <= summary["ttft_p99_s"] <= elapsed
    assert 0 < summary["tpot_p50_s"] <= summary["tpot_p99_s"] <= elapsed
    # 24-token prompts in 16-slot blocks: at peak every block but the last of each is full
    assert 0.5 < summary["peak_kv_slot_utilization"] <= 1.0
    assert 6 <= summary["peak_kv_blocks_in_use"] <= 96
    assert summary["num_steps"] >= 5
    assert summary["device"] == "cpu" and summary["prefill_mfu"] is None
    assert summary["workload"]["name"] == "random"


def test_prefix_repetition_hits_cache_only_with_caching_on(cache_dir):
    out, summary = run_bench(
        cache_dir, "--num-prompts", "6", "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", "48", "--prefix-repetition-suffix-len", "8",
        "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "3",
        "--compare-prefix-caching")
    off = summary["prefix_caching_off"]
    assert summary["prefix_caching"] is True and off["prefix_caching"] is False
    assert summary["prefix_cache_hit_rate"] > 0
    assert off["prefix_cache_hit_rate"] == 0
    assert off["prefill_tokens_computed"] == summary["prompt_tokens"] == 6 * 56
    # at most two prompts per prefix reuse its 3 full blocks
    cached = summary["cached_prompt_tokens"]
    assert 0 < cached <= 4 * 48 and cached % 16 == 0
    assert summary["prefill_tokens_computed"] == 6 * 56 - cached
    assert summary["output_tokens"] == off["output_tokens"] == 18
    assert summary["prefill_tokens_saved_fraction"] == pytest.approx(cached / (6 * 56))
    assert "Throughput (prefix caching off): " in out

    _, no_cache = run_bench(
        cache_dir, "--num-prompts", "6", "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", "48", "--prefix-repetition-suffix-len", "8",
        "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "3",
        "--no-prefix-caching")
    assert no_cache["prefix_cache_hit_rate"] == 0 and no_cache["prefix_caching"] is False


def test_fp8_weights_are_recorded_with_their_bytes(cache_dir):
    args = ("--num-prompts", "2", "--input-len", "8", "--output-len", "2")
    _, full = run_bench(cache_dir, *args)
    _, fp8 = run_bench(cache_dir, *args, "--quantization", "fp8")
    assert full["engine"]["quantization"] is None and fp8["engine"]["quantization"] == "fp8"
    assert 0 < fp8["weight_bytes"] < full["weight_bytes"]
    assert fp8["num_kv_blocks"] == full["num_kv_blocks"] == 96


def test_scoring_runs_read_the_prompt_logprobs_cached_blocks_keep(cache_dir, monkeypatch):
    """--prompt-logprobs / --logprobs reach every request; with a budget that admits the
    prompts over several steps, later prompts of a prefix read its blocks (but the last)."""
    from batchinfer.engine.engine import LLMEngine
    params = []
    add_request = LLMEngine.add_request
    monkeypatch.setattr(LLMEngine, "add_request", lambda self, request_id, prompt, sampling,
                        **kw: params.append((request_id, sampling))
                        or add_request(self, request_id, prompt, sampling, **kw))
    _, summary = run_bench(
        cache_dir, "--num-prompts", "6", "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", "48", "--prefix-repetition-suffix-len", "8",
        "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "3",
        "--max-num-batched-tokens", "64", "--prompt-logprobs", "2", "--logprobs", "1",
        "--compare-prefix-caching")
    assert summary["sampling"]["prompt_logprobs"] == 2 and summary["sampling"]["logprobs"] == 1
    assert {(p.prompt_logprobs, p.logprobs) for rid, p in params if rid != "bench-warmup"} \
        == {(2, 1)}
    off = summary["prefix_caching_off"]
    assert off["prefill_tokens_computed"] == summary["prompt_tokens"] == 6 * 56
    cached = summary["cached_prompt_tokens"]
    # each later prompt of a prefix reads 2 of its 3 full blocks
    assert 0 < cached <= 4 * 32 and cached % 32 == 0
    assert summary["prefill_tokens_computed"] == 6 * 56 - cached


def test_hf_baseline_reports_ratios(cache_dir):
    out, summary = run_bench(cache_dir, "--num-prompts", "4", "--input-len", "16",
                             "--output-len", "4", "--baseline", "hf", "--hf-batch-sizes", "2,4")
    assert summary["load_format"] == "auto" and summary["baseline_weights"] == "identical"
    baselines = summary["baselines"]
    assert set(baselines) <= {"hf_static", "hf_cb"} and "hf_static" in baselines
    static = baselines["hf_static"]
    assert static["batch_size"] in (2, 4)
    assert set(static["elapsed_s_by_batch_size"]) == {"2", "4"}
    for name, base in baselines.items():
        assert base["output_tokens"] == summary["output_tokens"] == 16
        assert base["prompt_tokens"] == summary["prompt_tokens"]
        ratio = summary["ratios"][name]
        assert ratio == pytest.approx(base["elapsed_time"] / summary["elapsed_time"])
        assert ratio > 0
    assert "Ours vs transformers static batching: " in out


@pytest.mark.slow
def test_num_runs_reports_the_median_run_and_ratio(cache_dir):
    out, summary = run_bench(cache_dir, "--num-prompts", "4", "--input-len", "16",
                             "--output-len", "4", "--baseline", "hf", "--hf-batch-sizes", "2,4",
                             "--num-runs", "3")
    runs = summary["runs"]
    ours, static = runs["ours_output_tokens_per_second"], runs["hf_static_output_tokens_per_second"]
    assert len(ours) == len(static) == len(runs["hf_static_ratios"]) == 3
    for ratio, a, b in zip(runs["hf_static_ratios"], ours, static):
        assert ratio == pytest.approx(a / b)  # each run against the static run after it
    assert summary["output_tokens_per_second"] == pytest.approx(sorted(ours)[1])
    assert summary["baselines"]["hf_static"]["output_tokens_per_second"] == \
        pytest.approx(sorted(static)[1])
    assert summary["ratios"]["hf_static"] == pytest.approx(sorted(runs["hf_static_ratios"])[1])
    assert summary["output_tokens"] == 16 and "Runs (3), output tokens/s: ours " in out


@pytest.mark.slow
def test_each_system_releases_its_memory_before_the_next_runs(cache_dir, monkeypatch):
    # A system that ran after another on the pages that one faulted in (freed, but kept in
    # the heap) would skip the cost of faulting its own: every run is followed by a
    # release, and by then nothing holds the finished engine's model runner (its model and
    # KV cache).
    import weakref

    from batchinfer.bench import hf_baseline, runner
    from batchinfer.engine.model_runner import ModelRunner
    events, runners = [], []
    build = ModelRunner.__init__

    def tracked_build(self, *args, **kwargs):
        build(self, *args, **kwargs)
        runners.append(weakref.ref(self))

    def record(name, fn):
        def run(*args, **kwargs):
            events.append(name)
            return fn(*args, **kwargs)
        return run

    release = runner._release_memory

    def tracked_release():
        release()
        events.append(("release", sum(r() is not None for r in runners)))

    monkeypatch.setattr(ModelRunner, "__init__", tracked_build)
    monkeypatch.setattr(runner, "run_workload", record("ours", runner.run_workload))
    monkeypatch.setattr(hf_baseline, "run_static", record("static", hf_baseline.run_static))
    monkeypatch.setattr(hf_baseline, "run_continuous_batching",
                        record("cb", hf_baseline.run_continuous_batching))
    monkeypatch.setattr(runner, "_release_memory", tracked_release)
    run_bench(cache_dir, "--num-prompts", "4", "--input-len", "16", "--output-len", "3",
              "--baseline", "hf", "--hf-batch-sizes", "4", "--num-runs", "2",
              "--compare-prefix-caching")
    systems = [e for e in events if isinstance(e, str)]
    assert systems.count("ours") == 3 and systems.count("static") == 2, events
    for before, after in zip(events, events[1:]):
        if isinstance(before, str):
            assert after == ("release", 0), events


@pytest.mark.slow
def test_sampling_flags_reach_both_systems(cache_dir, monkeypatch):
    """--temperature / --top-p / --top-k / --min-p: every request of ours samples with
    them, transformers' generation configs are built from the same settings, and the
    summary names them; without them both decode greedily."""
    from batchinfer.bench.workloads import Sampling
    from batchinfer.engine.engine import LLMEngine
    params, hf_settings = [], []
    add_request = LLMEngine.add_request
    monkeypatch.setattr(LLMEngine, "add_request", lambda self, request_id, prompt, sampling,
                        **kw: params.append((request_id, sampling))
                        or add_request(self, request_id, prompt, sampling, **kw))
    hf_kwargs = Sampling.hf_generation_kwargs
    monkeypatch.setattr(Sampling, "hf_generation_kwargs",
                        lambda self: hf_settings.append(self) or hf_kwargs(self))
    _, summary = run_bench(cache_dir, "--num-prompts", "4", "--input-len", "16",
                           "--output-len", "4", "--baseline", "hf", "--hf-batch-sizes", "4",
                           "--temperature", "0.7", "--top-p", "0.9", "--top-k", "0")
    assert summary["sampling"] == {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "min_p": 0.0,
                                   "logprobs": None, "prompt_logprobs": None}
    ours = [p for rid, p in params if rid != "bench-warmup"]
    assert len(ours) == 4 and all((p.temperature, p.top_p, p.top_k) == (0.7, 0.9, 0)
                                  for p in ours)
    assert len(hf_settings) >= 2 and set(hf_settings) == {Sampling(0.7, 0.9, 0, 0.0)}
    assert summary["output_tokens"] == summary["baselines"]["hf_static"]["output_tokens"] == 16
    params.clear()
    hf_settings.clear()
    _, summary = run_bench(cache_dir, "--num-prompts", "2", "--input-len", "16",
                           "--output-len", "3", "--baseline", "hf", "--hf-batch-sizes", "2")
    assert summary["sampling"]["temperature"] == 0.0
    assert all(p.temperature == 0.0 for _, p in params)
    assert hf_settings and set(hf_settings) == {Sampling()}


def test_sampling_settings_as_transformers_takes_them():
    from batchinfer.bench.workloads import Sampling
    assert Sampling().hf_generation_kwargs() == {"do_sample": False}
    assert Sampling(0.8, 0.95, 0, 0.05).hf_generation_kwargs() == {
        "do_sample": True, "temperature": 0.8, "top_p": 0.95, "top_k": 0, "min_p": 0.05}
    assert Sampling(1.0, 1.0, 20, 0.0).hf_generation_kwargs()["min_p"] is None
    params = Sampling(0.8, 0.95, 20, 0.05).engine_params(7)
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.max_tokens,
            params.ignore_eos) == (0.8, 0.95, 20, 0.05, 7, True)


def test_model_stub_reports_ms_per_step(cache_dir):
    threads = torch.get_num_threads()
    out, summary = run_bench(cache_dir, "--model-stub", "--num-seqs", "3,5",
                             "--context-len", "40", "--stub-steps", "4")
    assert torch.get_num_threads() == threads  # the caller's setting is given back
    assert summary["mode"] == "model-stub"
    assert summary["torch_threads"] == 1  # the default there: CPU time is the engine's work
    sizes = [r["num_seqs"] for r in summary["overhead"]]
    assert sizes == [3, 5]
    for r in summary["overhead"]:
        assert r["context_len"] == 40 and r["steps"] == 4
        for clock in ("", "cpu_"):
            total, host, device = (r[f"{part}{clock}ms_per_step"]
                                   for part in ("wall_" if not clock else "", "host_",
                                                "device_standin_"))
            assert 0 < host < 1000 and 0 < device < 1000
            # each clock's time splits into the host's and the device stand-in's (the
            # sampler ran)
            assert host + device == pytest.approx(total)
            assert 0 < r[f"host_{clock}ms_per_step_median"] < 1000
    line = (r"^Engine overhead: \d+ seqs x 40 context \(mean \d+ at the end\): host [\d.]+ "
            r"\+ device stand-in [\d.]+ = [\d.]+ ms wall/step, host [\d.]+ \+ device stand-in "
            r"[\d.]+ = [\d.]+ ms CPU/step \(means of 4 decode steps; medians [\d.]+ \+ [\d.]+ "
            r"wall, [\d.]+ \+ [\d.]+ CPU\); a device would wait [\d.]+ ms/step$")
    assert len(re.findall(line, out, re.M)) == 2
    for r in summary["overhead"]:  # planned after the step before: the device waits it all
        assert not r["async_scheduling"]
        assert r["device_wait_ms_per_step"] == pytest.approx(r["host_ms_per_step"])


def test_model_stub_with_async_scheduling_reports_the_wait_it_leaves(cache_dir):
    out, summary = run_bench(cache_dir, "--model-stub", "--num-seqs", "4",
                             "--context-len", "40", "--stub-steps", "6", "--async-scheduling")
    (r,) = summary["overhead"]
    assert r["async_scheduling"] and r["steps"] == 6
    # what of a step's host time the device work of the step before does not cover
    assert 0 <= r["device_wait_ms_per_step"] <= r["host_ms_per_step"]
    assert re.search(r"a device would wait [\d.]+ ms/step \(async scheduling\)$", out, re.M)


def test_model_stub_times_the_device_work_apart():
    stub = ZeroModel(torch.nn.Linear(4, 4), hidden_size=8, vocab_size=32)
    calls = []

    class Inner:
        greeting = "hi"

        def __call__(self, logits):
            calls.append(logits.shape)
            time.sleep(0.01)
            return "tokens"

    sampler = TimedSampler(Inner(), stub)
    stub.compute_logits(stub(torch.zeros(3, dtype=torch.long), None, None, None))
    assert 0 < stub.device_s < 0.01 and stub.device_cpu_s >= 0
    assert sampler(torch.zeros(3, 32)) == "tokens" and calls == [(3, 32)]
    assert stub.device_s >= 0.01  # its sleep: wall time, not CPU time
    assert sampler.greeting == "hi"  # the rest is the sampler's


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_stub_logits_take_the_dtype_the_model_would(dtype):
    # the sampler's argmax reads logits in the model's dtype when it needs no float32
    stub = ZeroModel(torch.nn.Linear(4, 4).to(dtype), hidden_size=8, vocab_size=32)
    hidden = stub(torch.zeros(3, dtype=torch.long), None, None, None)
    assert hidden.shape == (3, 8) and hidden.dtype == dtype
    assert stub.compute_logits(hidden).dtype == torch.float32
    narrow = stub.compute_logits(hidden, float32=False)
    assert narrow.shape == (3, 32) and narrow.dtype == dtype and not narrow.any()


def test_file_dataset(cache_dir, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "The quick brown fox jumps over the lazy dog"}) + "\n"
                    + json.dumps({"prompt_token_ids": [11, 12, 13, 14], "output_len": 2}) + "\n")
    _, summary = run_bench(cache_dir, "--dataset-name", "file", "--dataset-path", str(path),
                           "--output-len", "3")
    assert summary["workload"]["name"] == "file"
    assert summary["num_requests"] == 2 and summary["output_tokens"] == 3 + 2
    assert summary["prompt_tokens"] > 4


def test_a_failed_request_is_a_usage_error(cache_dir, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt_token_ids": [11, 10 ** 9], "output_len": 2}) + "\n")
    result = CliRunner().invoke(bench, ["--model", "tiny", "--cache-dir", str(cache_dir),
                                        "--num-kv-blocks", "96", "--device", "cpu",
                                        "--dataset-name", "file", "--dataset-path", str(path)])
    assert result.exit_code == 2, result.output
    assert "request bench-0 failed: prompt token ids must be integers" in result.output


@pytest.mark.parametrize("args, message", [
    (["--dataset-name", "file"], "--dataset-name file needs --dataset-path"),
    (["--model", "no-such-shape"], "neither a directory nor a named shape"),
    (["--input-len", "5000"], "--max-model-len"),
    (["--hf-batch-sizes", "4,x"], "comma-separated positive integers"),
    (["--kv-cache-memory", "lots"], "4GiB"),
    (["--compare-prefix-caching", "--no-prefix-caching"], "drop --no-enable-prefix-caching"),
    (["--tensor-parallel-size", "3"], "--tensor-parallel-size 3 does not divide"),
    (["--model-stub", "--tensor-parallel-size", "2"], "drop --tensor-parallel-size"),
    (["--gpu-memory-utilization", "1.5"], "0<x<=1"),
    (["--device", "cuda:99"], "device 'cuda:99'"),
    (["--workload", "shared-prefix", "--dataset-name", "random"], "drop --dataset-name"),
    (["--model-stub", "--baseline", "hf"], "drop --baseline"),
    (["--baseline", "hf", "--prompt-logprobs", "1"], "keeps no logprobs"),
    (["--logprobs", "-1"], "--logprobs"),
    (["--num-runs", "0"], "--num-runs"),
    (["--top-p", "0"], "--top-p"),
    (["--temperature", "-1"], "--temperature"),
    # a pool of 96 blocks caps max_model_len at 1536 tokens: the fix is a bigger pool
    (["--input-len", "1600", "--max-model-len", "2048"], "give the KV cache more room"),
    (["--input-len", "1600", "--max-model-len", "1024"], "raise --max-model-len"),
])
def test_bad_flags_are_usage_errors(cache_dir, args, message):
    result = CliRunner().invoke(bench, ["--model", "tiny", "--cache-dir", str(cache_dir),
                                        "--num-prompts", "1", "--num-kv-blocks", "96",
                                        "--device", "cpu", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_an_fp8_kv_cache_holds_twice_the_blocks_in_the_same_memory(cache_dir):
    """--kv-cache-dtype reaches the engine; the summary records it and the pool's blocks."""
    summaries = {}
    for kv in ("auto", "fp8"):
        result = CliRunner().invoke(bench, [
            "--model", "tiny", "--cache-dir", str(cache_dir), "--device", "cpu",
            "--dtype", "bfloat16", "--kv-cache-memory", "2MiB", "--kv-cache-dtype", kv,
            "--num-prompts", "2", "--input-len", "8", "--output-len", "2"])
        assert result.exit_code == 0, result.output
        summaries[kv] = json.loads(result.stdout[result.stdout.index("\n{\n") + 1:])
    auto, fp8 = summaries["auto"], summaries["fp8"]
    assert auto["kv_cache_dtype"] == "bfloat16" and fp8["kv_cache_dtype"] == "float8_e4m3fn"
    assert auto["engine"]["kv_cache_dtype"] == "auto" and fp8["engine"]["kv_cache_dtype"] == "fp8"
    assert fp8["num_kv_blocks"] == 2 * auto["num_kv_blocks"] > 0
    assert fp8["output_tokens"] == 4


def test_kernels_subcommand_is_wired():
    result = CliRunner().invoke(bench, ["kernels", "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage: bench kernels" in result.output


def test_bench_is_a_batchinfer_subcommand():
    from batchinfer.cli import main
    result = CliRunner().invoke(main, ["bench", "--help"])
    assert result.exit_code == 0, result.output
    assert "--baseline" in result.output and "--model-stub" in result.output


@pytest.mark.slow
def test_engine_flags_reach_the_engine(cache_dir):
    _, summary = run_bench(cache_dir, "--num-prompts", "2", "--input-len", "8",
                           "--output-len", "2", "--gpu-memory-utilization", "0.5",
                           "--tensor-parallel-size", "2")
    engine = summary["engine"]
    assert engine["gpu_memory_utilization"] == 0.5 and engine["tensor_parallel_size"] == 2
    assert summary["output_tokens"] == 4
    from torch import distributed
    assert not distributed.is_initialized()  # the run shut its workers down
    assert engine["trust_remote_code"] is False and engine["tokenizer"] is None


@pytest.mark.slow
def test_tensor_parallel_bandwidth_and_mfu_are_the_groups(cache_dir, monkeypatch):
    # Rank 0's model holds a slice of the weights, the shape's KV bytes and FLOPs are the
    # whole model's: both are reported for the whole group, against its devices' peaks
    # together. Run on CPU as if on an H200, so that the figures are computed.
    from batchinfer.bench import report, roofline, runner
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(runner, "device_peak", lambda device, dtype, num_devices=1:
                        roofline.device_peak(torch.device("cuda"), dtype, num_devices))
    seen = []
    summary_of = report.engine_summary
    monkeypatch.setattr(report, "engine_summary",
                        lambda run, **kw: seen.append(kw) or summary_of(run, **kw))
    for tp in ("1", "2"):
        _, summary = run_bench(cache_dir, "--num-prompts", "2", "--input-len", "8",
                               "--output-len", "3", "--dtype", "bfloat16",
                               "--tensor-parallel-size", tp)
        assert summary["prefill_mfu"] == pytest.approx(
            summary["prefill_tflops_per_s"] * 1e12 / (int(tp) * 989e12))
        assert summary["decode_bandwidth_fraction_of_peak"] == pytest.approx(
            summary["decode_bandwidth_gb_per_s"] * 1e9 / (int(tp) * 4.8e12))
    whole, group = (kw["weight_bytes"].dense for kw in seen)
    # the same model's weights, counted once over the two ranks (norms are replicated)
    assert group == pytest.approx(whole, rel=0.01)
    assert [kw["peak"].name for kw in seen] == ["NVIDIA H200", "2 x NVIDIA H200"]


def test_load_format_dummy_skips_a_directorys_weights(cache_dir, tmp_path):
    # a checkpoint directory whose weights file is unreadable: only dummy can run it
    import shutil
    from batchinfer.bench.models import resolve_model
    shutil.copytree(resolve_model("tiny", need_weights=True, cache_dir=cache_dir).path,
                    tmp_path / "ckpt")
    weights = list((tmp_path / "ckpt").glob("*.safetensors"))
    assert weights
    for f in weights:
        f.write_bytes(b"not a safetensors file")
    args = ["--model", str(tmp_path / "ckpt"), "--num-prompts", "2", "--input-len", "8",
            "--output-len", "2"]
    _, summary = run_bench(cache_dir, *args, "--load-format", "dummy")
    assert summary["load_format"] == "dummy" and summary["output_tokens"] == 4
    result = CliRunner().invoke(bench, [*args, "--num-kv-blocks", "96", "--device", "cpu"])
    assert result.exit_code == 2 and "damaged or incomplete" in result.output

