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


SECRET = "a-secret-for-these-tests-only-0123456789"


def _start(source: Path, flags: list[str], rank: int, port: int, log: Path,
           secret: str = SECRET) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BATCHINFER_NODE_SECRET": secret}
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
    assert code == 1, log
    assert time.monotonic() - lost < 60, log
    assert "node 1 of the engine went away during a step" in log and "Traceback" not in log
    committed = json.loads(manifest.read_text())["done"]
    assert committed and sum(b - a for a, b in committed) < rows

    node0, node1 = _pair(source, flags, tmp_path, "b")
    assert node0.wait(300) == 0, (tmp_path / "node0-b.log").read_text()
    assert node1.wait(60) == 0, (tmp_path / "node1-b.log").read_text()
    ids = ds.dataset(out).to_table().column("id").to_pylist()
    assert sorted(ids) == list(range(rows))  # every row once: none lost, none repeated


def test_a_node_0_that_fails_to_load_lets_the_others_go(tmp_path, llama_dir):
    """The model fails while loading (a damaged weights file, the same on both nodes):
    both nodes exit non-zero within a bounded time, none waits on the other."""
    import shutil
    model = shutil.copytree(llama_dir, tmp_path / "model")
    weights = model / "model.safetensors"
    source = _input(tmp_path / "in.jsonl", 4, 1)
    port = _port()
    weights.write_bytes(weights.read_bytes()[:len(weights.read_bytes()) // 2])
    node1 = _start(source, _flags(model, tmp_path / "out"), 1, port, tmp_path / "node1.log")
    node0 = _start(source, _flags(model, tmp_path / "out"), 0, port, tmp_path / "node0.log")
    start = time.monotonic()
    assert node0.wait(120) not in (0, None), (tmp_path / "node0.log").read_text()
    assert node1.wait(60) not in (0, None), (tmp_path / "node1.log").read_text()
    assert time.monotonic() - start < 90
    assert "damaged or incomplete" in (tmp_path / "node0.log").read_text()


def test_node_flags_are_checked_before_anything_starts(tmp_path, llama_dir, run_cli,
                                                       monkeypatch):
    source = _input(tmp_path / "in.jsonl", 2, 1)
    monkeypatch.delenv("BATCHINFER_NODE_SECRET", raising=False)
    bad = run_cli(source, "-o", tmp_path / "out", "--nnodes", "2", "--node-rank", "1")
    assert bad.exit_code == 2 and "--nnodes 2: nodes meet only with a secret" in bad.output
    assert "BATCHINFER_NODE_SECRET" in bad.output and len(bad.output.splitlines()) == 1
    monkeypatch.setenv("BATCHINFER_NODE_SECRET", SECRET)
    bad = run_cli(source, "-o", tmp_path / "out", "--nnodes", "2",
                  "--master-addr", "no-such-host.invalid")
    assert bad.exit_code == 2 and "--master-addr no-such-host.invalid: cannot resolve" \
        in bad.output
    bad = run_cli(source, "-o", tmp_path / "out", "--nnodes", "2", "--node-rank", "2")
    assert bad.exit_code == 2 and "--node-rank must be in [0, --nnodes) = [0, 2)" in bad.output
    bad = run_cli(source, "-o", tmp_path / "out", "--nnodes", "2", "--data-parallel-size", "2")
    assert bad.exit_code == 2 and "--data-parallel-size cannot be combined with --nnodes" \
        in bad.output


def _wait_for_text(log: Path, text: str, proc: subprocess.Popen, within: float = 120) -> None:
    deadline = time.monotonic() + within
    while text not in (log.read_text() if log.exists() else ""):
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text() if log.exists() else "no log"
        time.sleep(0.1)


def test_a_node_without_the_secret_is_refused_and_the_job_goes_on(tmp_path, llama_dir):
    """A process without the job's secret (another secret, or a torch.distributed client
    joining as a rank) gets nothing from node 0 and is named in its log; the real node
    then joins and the job finishes."""
    from datetime import timedelta

    import torch.distributed as dist
    source = _input(tmp_path / "in.jsonl", 4, 1)
    flags = _flags(llama_dir, tmp_path / "out")
    port = _port()
    node0 = _start(source, flags, 0, port, tmp_path / "node0.log")
    _wait_for_text(tmp_path / "node0.log", "", node0, 5)
    rogue = _start(source, flags, 1, port, tmp_path / "rogue.log",
                   secret="another-secret-entirely-0123456789")
    assert rogue.wait(120) == 1, (tmp_path / "rogue.log").read_text()
    assert "refused this node: its secret differs" in (tmp_path / "rogue.log").read_text()
    with pytest.raises(Exception):
        dist.TCPStore("127.0.0.1", port, is_master=False,
                      timeout=timedelta(seconds=3)).get("batchinfer/start")
    node1 = _start(source, flags, 1, port, tmp_path / "node1.log")
    assert node0.wait(180) == 0, (tmp_path / "node0.log").read_text()
    assert node1.wait(60) == 0, (tmp_path / "node1.log").read_text()
    assert len(_rows(tmp_path / "out")) == 4
    assert (tmp_path / "node0.log").read_text().count("refused a connection") >= 2


def test_nodes_started_for_different_engines_both_exit_2(tmp_path, llama_dir):
    source = _input(tmp_path / "in.jsonl", 4, 1)
    flags = _flags(llama_dir, tmp_path / "out")
    port = _port()
    node1 = _start(source, ["bfloat16" if a == "float32" else a for a in flags], 1, port,
                   tmp_path / "node1.log")
    node0 = _start(source, flags, 0, port, tmp_path / "node0.log")
    assert node0.wait(120) == 2, (tmp_path / "node0.log").read_text()
    assert node1.wait(60) == 2, (tmp_path / "node1.log").read_text()
    for log in ("node0.log", "node1.log"):
        text = (tmp_path / log).read_text()
        assert 'dtype "bfloat16" where node 0 has "float32"' in text, text
        assert "Traceback" not in text
    assert not list((tmp_path / "out").glob("*.parquet"))


def test_waits_for_another_node_end_on_a_signal(tmp_path, llama_dir):
    """Node 0 waiting for a node that never comes, and a node waiting for a node 0 that
    never comes, each say so and end at the first SIGTERM (nothing ran yet)."""
    source = _input(tmp_path / "in.jsonl", 4, 1)
    flags = _flags(llama_dir, tmp_path / "out")
    node0 = _start(source, flags, 0, _port(), tmp_path / "node0.log")
    node1 = _start(source, flags, 1, _port(), tmp_path / "node1.log")
    _wait_for_text(tmp_path / "node0.log", "waiting for node(s) 1 to join", node0)
    _wait_for_text(tmp_path / "node1.log", "node 1: waiting for node 0", node1)
    for proc in (node0, node1):
        os.killpg(proc.pid, signal.SIGTERM)
    stopped = time.monotonic()
    assert node0.wait(30) == 128 + signal.SIGTERM, (tmp_path / "node0.log").read_text()
    assert node1.wait(30) != 0
    assert time.monotonic() - stopped < 20
    text = (tmp_path / "node0.log").read_text()
    assert "stopped by SIGTERM while waiting for the other nodes" in text, text
    assert "Traceback" not in text, text


def test_a_node_0_with_a_bad_flag_says_so_at_once(tmp_path, llama_dir):
    """Node 0 fails before its engine while no other node has come: it says why and exits
    within seconds rather than waiting minutes for nodes to read its word."""
    source = _input(tmp_path / "in.jsonl", 2, 1)
    start = time.monotonic()
    node0 = _start(source, _flags(tmp_path / "no-model", tmp_path / "out"), 0, _port(),
                   tmp_path / "node0.log")
    assert node0.wait(60) == 2
    assert time.monotonic() - start < 30
    assert "no-model" in (tmp_path / "node0.log").read_text()
