"""--dry-run: the input read, prompts rendered and tokenized as the job would, the figures
printed, nothing written; the same exit 2 a run gives."""
from __future__ import annotations

import json
import re

import pyarrow.dataset as ds

SYSTEM = "You summarize documents for a busy reader in one short line. " * 3
ROWS = [{"title": f"Doc {i}", "body": "word " * (3 + 5 * i)} for i in range(6)]
ROWS.append({"title": None, "body": "no title"})
TEMPLATE = "Summarize {{ title }}: {{ body }}"


def write_rows(path, rows=ROWS):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def figures(output: str) -> dict[str, float]:
    """The numbers of the dry run's lines."""
    def number(pattern: str) -> float:
        m = re.search(pattern, output)
        assert m, (pattern, output)
        return float(m.group(1).replace(",", ""))
    return {
        "rows": number(r"dry run of ([\d,]+) rows"),
        "failed": number(r"\(([\d,]+) failed\)"),
        "total": number(r"prompt tokens +total ([\d,]+)"),
        "p50": number(r"p50 ([\d,]+)"),
        "p99": number(r"p99 ([\d,]+)"),
        "reused": number(r"of prompt tokens \(([\d,]+);"),
        "budget": number(r"output budget +([\d,]+) tokens"),
        "longest": number(r"longest row ([\d,]+) tokens"),
        "wall_s": number(r"estimated time +([\d,.]+) s"),
    }


def expected_reuse(prompts: list[list[int]], block_size: int) -> int:
    """Prefix-cache reuse by longest common prefix with any earlier prompt, in full blocks,
    the last token always computed."""
    total = 0
    for i, p in enumerate(prompts):
        best = 0
        for q in prompts[:i]:
            n = 0
            while n < min(len(p), len(q)) and p[n] == q[n]:
                n += 1
            best = max(best, n)
        total += min(best, len(p) - 1) // block_size * block_size
    return total


def test_dry_run_prints_the_jobs_figures_and_writes_nothing(tmp_path, run_cli):
    data = write_rows(tmp_path / "in.jsonl")
    args = [data, "--prompt-template", TEMPLATE, "--system-prompt", SYSTEM,
            "--max-tokens", "5", "--n", "2", "--reorder-window", "0", "--block-size", "8"]
    dry = run_cli(*args, "-o", tmp_path / "dry", "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert not (tmp_path / "dry").exists()
    got = figures(dry.output)
    # the same job run for real: its prompt token counts and ids are the reference
    real = run_cli(*args, "-o", tmp_path / "real", "--save-token-ids", "--ignore-eos")
    assert real.exit_code == 0, real.output
    rows = [r for r in ds.dataset(tmp_path / "real").to_table().to_pylist()
            if r["sample_index"] == 0]
    rows.sort(key=lambda r: r["id"])
    ok = [r for r in rows if r["error"] is None]
    lengths = sorted(r["prompt_tokens"] for r in ok)
    assert got["rows"] == len(ROWS) and got["failed"] == len(ROWS) - len(ok) == 1
    assert got["total"] == sum(lengths)
    assert got["p50"] == lengths[(len(lengths) + 1) // 2 - 1]  # nearest rank
    assert got["p99"] == lengths[-1]
    assert got["budget"] == 5 * 2 * len(ok)
    assert got["longest"] == lengths[-1] + 5
    # the shared system prompt is reused, block by block, in input order (window 0)
    prompts = [r["prompt_token_ids"] for r in ok]
    assert got["reused"] == expected_reuse(prompts, 8) > 0
    assert got["wall_s"] > 0


def test_dry_run_rows_reads_only_the_first_rows(tmp_path, run_cli):
    data = write_rows(tmp_path / "in.jsonl")
    result = run_cli(data, "-o", tmp_path / "out", "--prompt-template", TEMPLATE,
                     "--max-tokens", "3", "--dry-run", "--dry-run-rows", "2")
    assert result.exit_code == 0, result.output
    got = figures(result.output)
    assert got["rows"] == 2 and got["failed"] == 0 and got["budget"] == 6
    assert not (tmp_path / "out").exists()


def test_dry_run_exits_2_as_a_run_does(tmp_path, run_cli):
    data = write_rows(tmp_path / "in.jsonl")
    for flags in (["--prompt-template", "{{ summary }}"],
                  ["--sampling-columns", "seed"],
                  ["--prompt-template", TEMPLATE, "--max-tokens", "-3"]):
        dry = run_cli(data, "-o", tmp_path / "out", *flags, "--dry-run")
        real = run_cli(data, "-o", tmp_path / "out", *flags)
        assert dry.exit_code == real.exit_code == 2
        assert dry.output == real.output and dry.output.startswith("Error: ")
        assert not (tmp_path / "out").exists()
    # an OUTDIR holding another job's output: refused, and left as it was
    assert run_cli(data, "-o", tmp_path / "out", "--prompt-template", TEMPLATE,
                   "--max-tokens", "2").exit_code == 0
    before = sorted(p.name for p in (tmp_path / "out").rglob("*"))
    dry = run_cli(data, "-o", tmp_path / "out", "--prompt-template", TEMPLATE + "!",
                  "--max-tokens", "2", "--dry-run")
    assert dry.exit_code == 2 and "different job" in dry.output
    assert sorted(p.name for p in (tmp_path / "out").rglob("*")) == before
    result = run_cli(data, "-o", tmp_path / "x", "--dry-run-rows", "2")
    assert result.exit_code == 2 and "--dry-run-rows needs --dry-run" in result.output


def test_prefix_cache_simulation_follows_the_engines_rule():
    from batchinfer.job.dry_run import PrefixCache
    cache = PrefixCache(block_size=4, capacity=3)
    a = list(range(12))                     # 3 full blocks
    assert cache.add(a) == 0
    assert cache.add(a) == 8                # the last token is computed: 2 blocks reused
    assert cache.add(a + [99]) == 12        # all 3 full blocks before the new token
    assert cache.add([0, 1, 2, 3, 7, 7, 7, 7, 1]) == 4   # the shared first block only
    # capacity 3: the blocks of a new prompt push the least recently used out
    assert cache.add([50 + i for i in range(13)]) == 0
    assert cache.add(a + [99]) == 0
