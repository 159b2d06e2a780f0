"""The reorder window: requests sharing a prefix go to the engine together, so a shuffled
input gets nearly the prefix-cache hits of a sorted one (and input order does not)."""
from __future__ import annotations

import json
import random

import pyarrow.dataset as ds

from batchinfer.job.ordering import ReorderWindow

GROUPS = 8
ROWS_PER_GROUP = 12
WORDS = ("river mountain garden window letter morning silver harbor candle meadow "
         "thunder forest lantern orchard pebble").split()


def test_window_hands_out_groups_in_sweeps():
    window: ReorderWindow[int] = ReorderWindow(6)
    for i, key in enumerate(["b1", "a1", "c1", "a2", "b2", "c2"]):
        window.push(key, i)
    assert not window.has_room()
    order = [window.pop() for _ in range(3)]
    assert order == [1, 3, 0]  # a1 a2 b1
    window.push("a3", 6)  # behind the cursor: waits for the next sweep
    window.push("b3", 7)
    assert [window.pop() for _ in range(len(window))] == [4, 7, 2, 5, 6]


def test_window_of_one_keeps_input_order():
    window: ReorderWindow[int] = ReorderWindow(0)
    for i, key in enumerate(["c", "a", "b"]):
        window.push(key, i)
    assert [window.pop() for _ in range(3)] == [0, 1, 2]


def prompts() -> list[str]:
    rng = random.Random(7)
    out = []
    for g in range(GROUPS):
        prefix = f"Instructions for team {g}: " + " ".join(rng.choice(WORDS) for _ in range(40))
        out += [f"{prefix}. Question {i}: what about the {WORDS[i]}?"
                for i in range(ROWS_PER_GROUP)]
    return out


def hit_rate(tmp_path, run_cli, name: str, rows: list[str], *flags: str) -> float:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in rows))
    result = run_cli(path, "-o", tmp_path / name, "--max-tokens", "2", "--temperature", "0",
                     "--max-num-seqs", "4", "--num-kv-blocks", "28", *flags)
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / name / "__batchinfer__" / "summary.json").read_text())
    table = ds.dataset(tmp_path / name).to_table().sort_by("id")
    assert table.column("prompt").to_pylist() == rows  # ids and rows unaffected by ordering
    return summary["prefix_cache_hit_rate"]


def test_shuffled_input_with_window_hits_the_cache_like_sorted(tmp_path, run_cli):
    rows = prompts()
    shuffled = rows[:]
    random.Random(0).shuffle(shuffled)
    sorted_rate = hit_rate(tmp_path, run_cli, "sorted", rows, "--reorder-window", "0")
    windowed = hit_rate(tmp_path, run_cli, "windowed", shuffled)
    unordered = hit_rate(tmp_path, run_cli, "unordered", shuffled, "--reorder-window", "0")
    print(f"prefix-cache hit rate: sorted {sorted_rate:.1%}, shuffled with window "
          f"{windowed:.1%}, shuffled in input order {unordered:.1%}")
    assert sorted_rate > 0.5
    assert windowed >= sorted_rate - 0.10
    assert unordered < windowed - 0.20
