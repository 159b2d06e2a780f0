"""Benchmark prompt sources: lengths, sharing, determinism, and file errors."""
from __future__ import annotations

import json

import pytest

from batchinfer.bench.roofline import ModelShape
from batchinfer.bench.workloads import (WORKLOADS, file_requests, prefix_repetition_requests,
                                        random_requests, workload_stats)


def test_random_lengths_follow_range_ratio_and_seed():
    reqs = random_requests(200, 100, 20, 500, random_range_ratio=0.5, seed=3)
    in_lens = [len(r.prompt_token_ids) for r in reqs]
    out_lens = [r.output_len for r in reqs]
    assert min(in_lens) >= 50 and max(in_lens) <= 150 and len(set(in_lens)) > 20
    assert min(out_lens) >= 10 and max(out_lens) <= 30
    assert all(0 <= t < 500 for r in reqs for t in r.prompt_token_ids)
    assert reqs == random_requests(200, 100, 20, 500, random_range_ratio=0.5, seed=3)
    assert reqs != random_requests(200, 100, 20, 500, random_range_ratio=0.5, seed=4)


def test_shared_prefix_preset_shape():
    w = WORKLOADS["shared-prefix"]
    reqs = random_requests(300, w.input_len, w.output_len, 8192, prefix_len=w.prefix_len,
                           random_range_ratio=w.random_range_ratio, output_range_ratio=0.0)
    prefix = reqs[0].prompt_token_ids[:256]
    assert all(r.prompt_token_ids[:256] == prefix for r in reqs)
    suffix_lens = [len(r.prompt_token_ids) - 256 for r in reqs]
    assert min(suffix_lens) == 32 and max(suffix_lens) == 160
    assert {r.output_len for r in reqs} == {64}
    # the unique parts differ from each other
    assert len({tuple(r.prompt_token_ids[256:]) for r in reqs}) == 300


def test_no_shared_prefix_preset_matches_lengths():
    w = WORKLOADS["no-shared-prefix"]
    reqs = random_requests(300, w.input_len, w.output_len, 8192, prefix_len=w.prefix_len,
                           random_range_ratio=w.random_range_ratio, output_range_ratio=0.0)
    lens = [len(r.prompt_token_ids) for r in reqs]
    assert min(lens) == 288 and max(lens) == 416
    assert len({tuple(r.prompt_token_ids[:16]) for r in reqs}) == 300


def test_prefix_repetition_shares_each_prefix():
    reqs = prefix_repetition_requests(12, prefix_len=20, suffix_len=5, num_prefixes=3,
                                      output_len=7, vocab_size=1000, seed=1)
    prefixes = {tuple(r.prompt_token_ids[:20]) for r in reqs}
    assert len(prefixes) == 3
    assert all(len(r.prompt_token_ids) == 25 and r.output_len == 7 for r in reqs)
    stats = workload_stats(reqs)
    assert stats["prompt_tokens"] == 300 and stats["output_tokens"] == 84


def test_file_dataset(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "hello world"}, {"prompt_token_ids": [5, 6, 7], "output_len": 3}, {}]
    path.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n")
    reqs = file_requests(path, None, 9, lambda text: [len(w) for w in text.split()])
    assert [(r.prompt_token_ids, r.output_len) for r in reqs] == [([5, 5], 9), ([5, 6, 7], 3)]
    assert len(file_requests(path, 1, 9, lambda text: [1])) == 1

    path.write_text(json.dumps(rows[2]) + "\n")
    with pytest.raises(ValueError, match=r"prompts.jsonl:1: needs a \"prompt\""):
        file_requests(path, None, 9, lambda text: [1])
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match="not valid JSON"):
        file_requests(path, None, 9, lambda text: [1])
    with pytest.raises(ValueError, match="--dataset-path .* is not a file"):
        file_requests(tmp_path / "missing.jsonl", None, 9, lambda text: [1])


def test_prefill_flops_count_only_uncached_positions():
    shape = ModelShape(num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4,
                       intermediate_size=16, vocab_size=10)
    full = shape.prefill_flops(32, 0)
    assert full == 32 * shape.linear_flops_per_token() + 4 * 2 * 2 * 4 * (32 * 33 // 2) \
        + shape.logits_flops()
    cached = shape.prefill_flops(32, 16)
    assert cached == 16 * shape.linear_flops_per_token() + 4 * 2 * 2 * 4 * (32 * 33 // 2 - 16 * 17 // 2) \
        + shape.logits_flops()
    assert shape.prefill_flops(32, 32) == 0
    assert shape.kv_bytes_per_token(2) == 2 * 2 * 1 * 4 * 2
