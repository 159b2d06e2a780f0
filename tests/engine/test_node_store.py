"""The nodes' meeting point: open only to processes holding the job's secret, bound to the
address it is given, and reading nothing but framed bytes."""
from __future__ import annotations

import io
import os
import socket
import struct
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from batchinfer.engine import node_store
from batchinfer.engine.node_store import MeetingPoint, MeetingRefused, MeetingStore, node_secret

SECRET = b"0123456789abcdef-the-job-secret"
QUICK = timedelta(seconds=5)


@pytest.fixture
def point():
    log = io.StringIO()
    p = MeetingPoint("127.0.0.1", 0, SECRET, log=log)
    p.log = log
    yield p
    p.close()


def _client(point, secret: bytes = SECRET) -> MeetingStore:
    return MeetingStore("127.0.0.1", point.port, secret, connect_timeout=QUICK, timeout=QUICK)


def test_a_client_with_the_secret_uses_the_store(point):
    a, b = _client(point), _client(point)
    a.set("k", b"v")
    assert b.get("k") == b"v" and b.check(["k"]) and not b.check(["k", "missing"])
    assert a.add("n", 2) == 2 and b.add("n", 3) == 5
    assert a.compare_set("c", b"", b"first") == b"first"
    assert b.compare_set("c", b"other", b"second") == b"first"
    b.wait(["k"], timedelta(seconds=1))
    with pytest.raises(TimeoutError):
        b.get_within("never", 0.2)
    assert a.num_keys() == 3 and a.delete_key("k") and not a.check(["k"])


def test_a_client_with_another_secret_is_refused_and_named(point):
    with pytest.raises(MeetingRefused, match="secret differs"):
        _client(point, b"not-the-secret-of-this-job")
    time.sleep(0.2)
    assert "refused a connection to the nodes' meeting point from 127.0.0.1:" in point.log.getvalue()
    assert "did not prove it holds this job's secret" in point.log.getvalue()
    _client(point).set("still", b"serving")  # the refusal broke nothing


def test_a_client_gone_in_the_handshake_is_not_called_a_stranger(point):
    """(a rank killed while it connects)"""
    with socket.create_connection(("127.0.0.1", point.port)) as conn:
        conn.recv(4)
    time.sleep(0.2)
    assert "its handshake ended unfinished (" in point.log.getvalue()
    assert "secret" not in point.log.getvalue()
    _client(point).set("still", b"serving")


def test_torch_tcpstore_client_gets_nothing(point):
    """The client a torch.distributed rank would use without the secret (the rogue rank
    of a probe) reads no key and writes none."""
    _client(point).set("batchinfer/start", b"engine")
    with pytest.raises(Exception):
        rogue = dist.TCPStore("127.0.0.1", point.port, is_master=False,
                              timeout=timedelta(seconds=3))
        rogue.get("batchinfer/start")
    assert _client(point).get("batchinfer/start") == b"engine"


def test_a_client_that_stalls_in_the_challenge_is_dropped(point, monkeypatch):
    monkeypatch.setattr(node_store, "HANDSHAKE_S", 0.3)
    stalled = socket.create_connection(("127.0.0.1", point.port))
    stalled.settimeout(5)
    time.sleep(0.8)
    assert stalled.recv(4096).startswith(node_store.MAGIC)  # the challenge, then ...
    assert stalled.recv(4096) == b""  # ... closed
    stalled.close()
    _client(point).set("k", b"v")


def test_a_frame_past_the_bound_closes_that_connection_only(point):
    c = _client(point)
    c._sock.sendall(struct.pack("!II", node_store.MAX_FRAME + 1, 1))
    c._sock.settimeout(5)
    assert c._sock.recv(16) == b""
    _client(point).set("k", b"v")


def test_a_client_killed_part_way_through_a_request_leaves_the_store_whole(point):
    # what a rank killed while it joins does: a torn request is dropped with its connection
    # (a FileStore's file would keep the torn record, and its readers spin on it forever)
    a, b = _client(point), _client(point)
    a.set("k", b"v")
    a._sock.sendall(struct.pack("!II", 64, 2) + struct.pack("!I", 1) + bytes([node_store.SET]))
    a.close()
    assert b.get("k") == b"v"
    b.set("k2", b"w")
    assert _client(point).get("k2") == b"w"


def test_it_listens_on_the_address_given_alone(point):
    """Bound to 127.0.0.1, not to every interface: 127.0.0.2 (also this host) finds no one."""
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", point.port), timeout=2).close()


def test_a_node_that_says_hello_is_seen_leaving(point):
    c = _client(point)
    c.hello(1)
    assert point.nodes_seen() == {1} and point.nodes_left() == set()
    c.close()
    deadline = time.monotonic() + 5
    while point.nodes_left() != {1} and time.monotonic() < deadline:
        time.sleep(0.02)
    assert point.nodes_left() == {1} and _client(point).nodes_left() == {1}


def test_a_port_in_use_is_one_line(point):
    with pytest.raises(ConnectionError, match=r"cannot serve the nodes' meeting point "
                                              r"127.0.0.1:\d+ \(--master-addr/--master-port\)"):
        MeetingPoint("127.0.0.1", point.port, SECRET)


def test_the_secret_comes_from_the_environment_or_a_private_file(tmp_path, monkeypatch):
    monkeypatch.delenv(node_store.SECRET_ENV, raising=False)
    with pytest.raises(ValueError, match="set BATCHINFER_NODE_SECRET"):
        node_secret(None)
    monkeypatch.setenv(node_store.SECRET_ENV, "short")
    with pytest.raises(ValueError, match="at least 16"):
        node_secret(None)
    monkeypatch.setenv(node_store.SECRET_ENV, "x" * 32)
    assert node_secret(None) == b"x" * 32
    path = tmp_path / "secret"
    path.write_text("y" * 40 + "\n")
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="may be read by other users .*chmod 600"):
        node_secret(str(path))
    os.chmod(path, 0o600)
    assert node_secret(str(path)) == b"y" * 40  # the file wins over the environment
    with pytest.raises(ValueError, match="--node-secret-file .*missing"):
        node_secret(str(tmp_path / "missing"))


def test_a_flood_of_silent_connections_delays_a_node_but_does_not_stop_it(monkeypatch):
    monkeypatch.setattr(node_store, "MAX_HANDSHAKES", 2)
    monkeypatch.setattr(node_store, "HANDSHAKE_S", 0.5)
    point = MeetingPoint("127.0.0.1", 0, SECRET, log=io.StringIO())
    port = point.port
    try:
        flood = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
        time.sleep(0.1)
        store = MeetingStore("127.0.0.1", port, SECRET, connect_timeout=QUICK, timeout=QUICK)
        store.set("k", b"v")
        assert store.get("k") == b"v"
        for s in flood:
            s.close()
    finally:
        point.close()
