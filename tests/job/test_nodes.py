"""A job whose engine spans two "nodes" (two `batchinfer run` processes on this machine,
--nnodes 2, pipeline stages one per node): the rows equal one process's; a node killed
mid-run ends node 0's run non-zero within a bounded time, and the same two commands then
finish the job with every row once; a finished job lets the other node go at once."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.dataset as ds
import pytest

pytestmark = pytest.mark.slow

BATCHINFER = [sys.executable, "-m", "batchinfer", "run"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _flags(model: Path, out: Path, *extra: str) -> list[str]:
    return ["--model", str(model), "-o", str(out), "--device", "cpu", "--dtype", "float32",
            "--num-kv-blocks", "256", "--max-num-seqs", "32", "--max-tokens", "6",
            "--ignore-eos", "--no-progress", *extra]


def _start(source: Path, flags: list[str], rank: int, port: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [*BATCHINFER, str(source), *flags, "--nnodes", "2", "--node-rank", str(rank),
         "--master-addr", "127.0.0.1", "--master-port", str(port),
         "--pipeline-parallel-size", "2"],
        stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _pair(source: Path, flags: list[str], tmp: Path, tag: str) -> tuple[subprocess.Popen, ...]:
    port = _port()
    node1 = _start(source, flags, 1, port, tmp / f"node1-{tag}.log")
    node0 = _start(source, flags, 0, port, tmp / f"node0-{tag}.log")
    return node0, node1


def _rows(out: Path) -> list[tuple]:
    return sorted((r["id"], r["completion"]) for r in ds.dataset(out).to_table().to_pylist())


def _input(path: Path, rows: int, words: int) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"row {i} says " * words}) + "\n"
                            for i in range(rows)))
    return path


def test_two_nodes_write_what_one_process_writes(tmp_path, llama_dir):
    source = _input(tmp_path / "in.jsonl", 9, 2)
    one = subprocess.run([*BATCHINFER, str(source), *_flags(llama_dir, tmp_path / "one")],
                         capture_output=True, text=True, timeout=120)
    assert one.returncode == 0, one.stderr
    node0, node1 = _pair(source, _flags(llama_dir, tmp_path / "two"), tmp_path, "a")
    assert node0.wait(180) == 0, (tmp_path / "node0-a.log").read_text()
    assert node1.wait(60) == 0, (tmp_path / "node1-a.log").read_text()
    assert _rows(tmp_path / "two") == _rows(tmp_path / "one")
    assert "node 0 shut the engine down" in (tmp_path / "node1-a.log").read_text()
    # finished: node 0 needs no engine, and says so
    node0, node1 = _pair(source, _flags(llama_dir, tmp_path / "two"), tmp_path, "b")
    assert node0.wait(120) == 0 and node1.wait(60) == 0
    assert "needs no engine" in (tmp_path / "node1-b.log").read_text()


def test_a_node_lost_mid_run_fails_the_job_and_a_rerun_finishes_it(tmp_path, llama_dir):
    rows = 3000
    source = _input(tmp_path / "in.jsonl", rows, 8)
    out = tmp_path / "out"
    flags = _flags(llama_dir, out, "--commit-rows", "100")
    node0, node1 = _pair(source, flags, tmp_path, "a")
    manifest = out / "__batchinfer__" / "manifest.json"
    deadline = time.monotonic() + 180
    while not (manifest.is_file() and json.loads(manifest.read_text())["parts"]):
        assert node0.poll() is None, (tmp_path / "node0-a.log").read_text()
        assert time.monotonic() < deadline, (tmp_path / "node0-a.log").read_text()
        time.sleep(0.1)
    os.killpg(node1.pid, signal.SIGKILL)  # the node and its processes are gone at once
    lost = time.monotonic()
    code = node0.wait(120)
    log = (tmp_path / "node0-a.log").read_text()
    assert code not in (0, None), log
    assert time.monotonic() - lost < 60, log
    committed = json.loads(manifest.read_text())["done"]
    assert committed and sum(b - a for a, b in committed) < rows

    node0, node1 = _pair(source, flags, tmp_path, "b")
    assert node0.wait(300) == 0, (tmp_path / "node0-b.log").read_text()
    assert node1.wait(60) == 0, (tmp_path / "node1-b.log").read_text()
    ids = ds.dataset(out).to_table().column("id").to_pylist()
    assert sorted(ids) == list(range(rows))  # every row once: none lost, none repeated


def test_a_node_0_that_fails_to_load_lets_the_others_go(tmp_path, llama_dir):
    """Node 0's model fails while loading (a damaged weights file): both nodes exit
    non-zero within a bounded time, none waits on the other."""
    import shutil
    model = shutil.copytree(llama_dir, tmp_path / "model")
    weights = model / "model.safetensors"
    source = _input(tmp_path / "in.jsonl", 4, 1)
    port = _port()
    node1 = _start(source, _flags(llama_dir, tmp_path / "out"), 1, port, tmp_path / "node1.log")
    weights.write_bytes(weights.read_bytes()[:len(weights.read_bytes()) // 2])
    node0 = _start(source, _flags(model, tmp_path / "out"), 0, port, tmp_path / "node0.log")
    start = time.monotonic()
    assert node0.wait(120) not in (0, None), (tmp_path / "node0.log").read_text()
    assert node1.wait(60) not in (0, None), (tmp_path / "node1.log").read_text()
    assert time.monotonic() - start < 90
    assert "damaged or incomplete" in (tmp_path / "node0.log").read_text()


def test_node_flags_are_checked_before_anything_starts(tmp_path, llama_dir, run_cli):
    source = _input(tmp_path / "in.jsonl", 2, 1)
    bad = run_cli(source, "-o", tmp_path / "out", "--nnodes", "2", "--node-rank", "2")
    assert bad.exit_code == 2 and "--node-rank must be in [0, --nnodes) = [0, 2)" in bad.output
    bad = run_cli(source, "-o", tmp_path / "out", "--nnodes", "2", "--data-parallel-size", "2")
    assert bad.exit_code == 2 and "--data-parallel-size cannot be combined with --nnodes" \
        in bad.output
