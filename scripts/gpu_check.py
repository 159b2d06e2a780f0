"""The Python part of scripts/gpu-check.sh: which bench rows it runs, and the one JSON
report it collects from what each section left in the output folder.

    python scripts/gpu_check.py rows [--dry]     one row a line: NAME<TAB>bench flags
    python scripts/gpu_check.py collect OUT      OUT/gpu-check.json, the table printed

Each section NAME of the shell script leaves OUT/NAME.log (its output) and
OUT/NAME.rc.json ({"rc", "seconds", "limit"}; rc 124 or 137: stopped by `timeout`); a bench
row also leaves OUT/bench-ROW.json (`batchinfer bench --output-json`). Nothing here
imports torch before `collect`, so `rows` answers at once.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

# Llama-3-8B's shape with random weights, 128 prompts of 512 tokens, 128 out (a few
# seconds of prefill and of decode on an H100), CUDA graphs on (bench's default).
WORKLOAD = ["--model", "llama3-8b", "--dtype", "bfloat16", "--num-prompts", "128",
            "--input-len", "512", "--output-len", "128", "--max-model-len", "1024"]
# --dry: the same rows on the `tiny` shape on a CPU, for the tests of this script.
DRY_WORKLOAD = ["--model", "tiny", "--dtype", "bfloat16", "--num-prompts", "4",
                "--input-len", "32", "--output-len", "4", "--device", "cpu"]
ROWS = {"bf16": [], "fp8": ["--quantization", "fp8"], "kv-fp8": ["--kv-cache-dtype", "fp8"],
        "bf16-async": ["--async-scheduling"]}
TEST_SECTIONS = ("gpu-tests", "kernel-tests")
TIMED_OUT = (124, 137)
REPORT = "gpu-check.json"
# what a row reports, from bench's summary
ROW_FIELDS = ("output_tokens_per_second", "decode_bandwidth_gb_per_s",
              "decode_bandwidth_fraction_of_peak", "prefill_tflops_per_s", "prefill_mfu",
              "tpot_p50_s", "ttft_p50_s", "kv_cache_dtype", "num_preemptions")


def bench_rows(dry: bool = False) -> dict[str, list[str]]:
    """Row name -> the full `batchinfer bench` flags of that row."""
    workload = DRY_WORKLOAD if dry else WORKLOAD
    return {name: workload + extra for name, extra in ROWS.items()}


def _section(out: Path, name: str) -> dict:
    """A section's exit status, time and limit; status "missing" when it never ran."""
    rc_file = out / f"{name}.rc.json"
    if not rc_file.is_file():
        return {"status": "missing", "rc": None, "seconds": None, "limit": None}
    result = json.loads(rc_file.read_text())
    rc = result["rc"]
    status = "ok" if rc == 0 else "timed out" if rc in TIMED_OUT else "failed"
    log = out / f"{name}.log"
    return {"status": status, **result, "log": log.name if log.is_file() else None}


def _pytest_counts(log: Path) -> dict[str, int]:
    """The counts of pytest's last summary line ("3 passed, 1 skipped in 4.2s")."""
    if not log.is_file():
        return {}
    lines = [line for line in log.read_text(errors="replace").splitlines()
             if re.search(r"\d+ (passed|failed|skipped|errors?|deselected)", line)]
    if not lines:
        return {}
    counts = re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)",
                        lines[-1])
    return {kind.rstrip("s") if kind == "errors" else kind: int(n) for n, kind in counts}


def _bench_row(out: Path, name: str, flags: list[str]) -> dict:
    row = {"flags": flags, **_section(out, f"bench-{name}")}
    summary_file = out / f"bench-{name}.json"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    row.update({field: summary.get(field) for field in ROW_FIELDS})
    engine = summary.get("engine", {})
    row.update({key: engine.get(key) for key in ("enforce_eager", "tensor_parallel_size")})
    row["device_name"] = summary.get("device_name")
    return row


def collect(out: Path, dry: bool = False) -> dict:
    """The report of the sections found in `out` (see the module's docstring)."""
    import torch
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = torch.cuda.is_available()
    report = {
        "dry": dry,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "capability": list(torch.cuda.get_device_capability()) if cuda else None,
        "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton_version,
        "tests": {name: {**_section(out, name), **_pytest_counts(out / f"{name}.log")}
                  for name in TEST_SECTIONS},
        "bench": {name: _bench_row(out, name, flags)
                  for name, flags in bench_rows(dry).items()},
    }
    report["table"] = table(report)
    return report


def _percent(fraction: float | None) -> str:
    return "" if fraction is None else f"{100 * fraction:.0f}%"


def table(report: dict) -> list[str]:
    """The bench rows as a Markdown table, one string a line."""
    lines = ["| row | status | output tok/s | decode bandwidth | of peak | prefill MFU |",
             "|---|---|---|---|---|---|"]
    for name, row in report["bench"].items():
        tok_s = row["output_tokens_per_second"]
        gb_s = row["decode_bandwidth_gb_per_s"]
        lines.append(f"| {name} | {row['status']} | {'' if tok_s is None else f'{tok_s:.0f}'} "
                     f"| {'' if gb_s is None else f'{gb_s:.0f} GB/s'} "
                     f"| {_percent(row['decode_bandwidth_fraction_of_peak'])} "
                     f"| {_percent(row['prefill_mfu'])} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    rows = commands.add_parser("rows", help="the bench rows, NAME<TAB>flags a line")
    rows.add_argument("--dry", action="store_true")
    collect_cmd = commands.add_parser("collect", help="write OUT/gpu-check.json")
    collect_cmd.add_argument("out", type=Path)
    collect_cmd.add_argument("--dry", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "rows":
        for name, flags in bench_rows(args.dry).items():
            print(name + "\t" + " ".join(flags))
        return
    report = collect(args.out, args.dry)
    (args.out / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    for line in report["table"]:
        print(line)
    for name, section in report["tests"].items():
        counts = ", ".join(f"{n} {k}" for k, n in section.items()
                           if k in ("passed", "failed", "skipped", "error"))
        print(f"{name}: {section['status']}" + (f" ({counts})" if counts else ""))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
