"""Summary arithmetic on a hand-made run: slot utilisation, decode bandwidth, prefill MFU,
and the device peaks they are measured against."""
from __future__ import annotations

import pytest
import torch

from batchinfer.bench.engine_run import EngineRun, StepSample
from batchinfer.bench.report import engine_summary, summary_lines
from batchinfer.bench.roofline import DevicePeak, ModelShape, WeightBytes, device_peak
from batchinfer.model.config import ModelConfig

SHAPE = ModelShape(num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4,
                   intermediate_size=16, vocab_size=10)


def make_run() -> EngineRun:
    steps = [
        # a prefill step: two 20-token prompts, the second with 16 tokens cached
        StepSample(0.5, prefill_tokens=24, num_running=2, context_tokens=40, tokens_held=24,
                   blocks_in_use=2),
        # two decode steps reading the previous step's contexts plus one new token each
        StepSample(0.25, prefill_tokens=0, num_running=2, context_tokens=42, tokens_held=26,
                   blocks_in_use=3),
        StepSample(0.25, prefill_tokens=0, num_running=0, context_tokens=0, tokens_held=0,
                   blocks_in_use=0),
    ]
    return EngineRun(elapsed_s=1.0, prompt_tokens=40, output_tokens=6, ttft_s=[0.5, 0.5],
                     tpot_s=[0.25, 0.25], num_cached_tokens=[0, 16], prompt_lens=[20, 20],
                     stats_delta={"prefix_cache_queried_tokens": 40,
                                  "prefix_cache_hit_tokens": 16, "num_preemptions": 0,
                                  "num_prompt_tokens_computed": 24},
                     steps=steps)


def test_summary_without_a_known_device():
    s = engine_summary(make_run(), block_size=16, num_kv_blocks=8, shape=SHAPE,
                       weight_bytes=WeightBytes(1000), dtype=torch.float32, peak=None)
    assert s["tokens_per_second"] == 46 and s["output_tokens_per_second"] == 6
    assert s["prefix_cache_hit_rate"] == pytest.approx(0.4)
    assert s["prefill_tokens_computed"] == 24 and s["cached_prompt_tokens"] == 16
    # the peak is the step with 3 blocks: 26 tokens in 48 slots
    assert s["peak_kv_blocks_in_use"] == 3
    assert s["peak_kv_slot_utilization"] == pytest.approx(26 / 48)
    assert s["decode_bandwidth_gb_per_s"] is None and s["prefill_mfu"] is None
    assert summary_lines(s)[0] == ("Throughput: 2.00 requests/s, 46.00 total tokens/s, "
                                   "6.00 output tokens/s")


def test_bandwidth_and_mfu_against_a_peak():
    peak = DevicePeak("test", flops_per_s=1e6, bytes_per_s=1e4)
    s = engine_summary(make_run(), block_size=16, num_kv_blocks=8, shape=SHAPE,
                       weight_bytes=WeightBytes(1000), dtype=torch.float32, peak=peak)
    kv = SHAPE.kv_bytes_per_token(4)
    read = (1000 + kv * (40 + 2)) + (1000 + kv * (42 + 2))
    assert s["decode_bandwidth_gb_per_s"] == pytest.approx(read / 0.5 / 1e9)
    assert s["decode_bandwidth_fraction_of_peak"] == pytest.approx(read / 0.5 / 1e4)
    flops = SHAPE.prefill_flops(20, 0) + SHAPE.prefill_flops(20, 16)
    assert s["prefill_mfu"] == pytest.approx(flops / 0.5 / 1e6)
    lines = summary_lines(s)
    assert any(line.startswith("Decode bandwidth: ") and "of peak" in line for line in lines)
    assert any(line.startswith("Prefill: ") and "MFU" in line for line in lines)


def test_an_fp8_cache_is_recorded_and_read_at_a_byte_an_element():
    peak = DevicePeak("test", flops_per_s=1e6, bytes_per_s=1e4)
    s = engine_summary(make_run(), block_size=16, num_kv_blocks=8, shape=SHAPE,
                       weight_bytes=WeightBytes(1000), dtype=torch.bfloat16, peak=peak,
                       kv_cache_dtype=torch.float8_e4m3fn)
    kv = SHAPE.kv_bytes_per_token(1)
    read = (1000 + kv * (40 + 2)) + (1000 + kv * (42 + 2))
    assert s["decode_bandwidth_gb_per_s"] == pytest.approx(read / 0.5 / 1e9)
    assert s["kv_cache_dtype"] == "float8_e4m3fn" and s["num_kv_blocks"] == 8
    plain = engine_summary(make_run(), block_size=16, num_kv_blocks=8, shape=SHAPE,
                           weight_bytes=WeightBytes(1000), dtype=torch.bfloat16, peak=None)
    assert plain["kv_cache_dtype"] == "bfloat16"


def test_a_failed_baseline_is_reported_not_raised():
    s = engine_summary(make_run(), block_size=16, num_kv_blocks=8, shape=SHAPE,
                       weight_bytes=WeightBytes(1000), dtype=torch.float32, peak=None)
    s["baselines"] = {"hf_cb": {"error": "AttributeError: no page_size"}}
    lines = summary_lines(s)
    assert lines[-1].endswith("failed, left out (AttributeError: no page_size)")
    assert not any(line.startswith(("Decode bandwidth", "Prefill:")) for line in lines)


def test_moe_shapes_count_the_experts_a_token_runs_through():
    from transformers import MixtralConfig, Qwen3MoeConfig
    mixtral = MixtralConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=96, num_local_experts=8, num_experts_per_tok=2)
    qwen = Qwen3MoeConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=192, moe_intermediate_size=48, num_experts=8,
                          num_experts_per_tok=3)
    assert ModelShape.from_config(ModelConfig.from_hf(mixtral)).intermediate_size == 2 * 96
    assert ModelShape.from_config(ModelConfig.from_hf(qwen)).intermediate_size == 3 * 48


def test_moe_decode_reads_the_share_of_experts_a_batch_hits():
    w = WeightBytes(dense=100, experts=1600, num_experts=16, top_k=2)
    assert w.read_by(1) == pytest.approx(100 + 1600 * 2 / 16)
    assert w.read_by(0) == 100
    assert 100 + 1600 * 0.99 < w.read_by(64) < 1700     # a large batch reaches every expert
    assert WeightBytes(dense=100).read_by(64) == 100


@pytest.mark.parametrize("name, bandwidth, half", [
    ("NVIDIA GH200 480GB", 4.0e12, 989e12), ("NVIDIA H200", 4.8e12, 989e12),
    ("NVIDIA H100 NVL", 3.9e12, 835e12), ("NVIDIA H100 80GB HBM3", 3.35e12, 989e12),
    ("NVIDIA L40", 0.864e12, 181e12), ("NVIDIA L40S", 0.864e12, 362e12),
    ("NVIDIA L4", 0.3e12, 121e12)])
def test_device_peaks_match_the_most_specific_name(monkeypatch, name, bandwidth, half):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    peak = device_peak(torch.device("cuda"), torch.bfloat16)
    assert (peak.name, peak.bytes_per_s, peak.flops_per_s) == (name, bandwidth, half)
    # a tensor-parallel group: its devices' peaks together
    group = device_peak(torch.device("cuda"), torch.bfloat16, num_devices=4)
    assert (group.name, group.bytes_per_s, group.flops_per_s) == \
        (f"4 x {name}", 4 * bandwidth, 4 * half)
    assert device_peak(torch.device("cpu"), torch.bfloat16) is None


def test_weights_across_ranks_add_up():
    per_rank = WeightBytes(1000, experts=400, num_experts=8, top_k=2)
    group = per_rank.across(4)
    assert (group.dense, group.experts, group.num_experts, group.top_k) == (4000, 1600, 8, 2)
    assert group.read_by(3) == pytest.approx(4 * per_rank.read_by(3))
