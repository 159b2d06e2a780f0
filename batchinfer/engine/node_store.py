"""The nodes' meeting point: a small key-value store that node 0 serves to its own
processes and the other nodes' over TCP, bound to --master-addr alone and open only to
processes that prove they hold the job's secret. On one node, rank 0 of a parallel engine
serves one on loopback to its workers alone, under a secret of that engine's own.

torch.distributed's groups rendezvous through it (MeetingStore is a
torch.distributed.Store), and node 0's word, each node's identity and which nodes are
still connected go through it. Nothing received is unpickled: a request and its answer
are lists of byte strings, each framed by its length, and a frame longer than MAX_FRAME
closes the connection.

A connection starts with a mutual challenge: node 0 sends a random nonce, the client
answers with its own nonce and an HMAC-SHA256 of both under the secret, and node 0 proves
the same back. The secret itself never crosses the network. A client that fails (or
stalls past HANDSHAKE_S) is dropped with a warning naming its address. The meeting point
authenticates; it does not encrypt (see docs/scaling.md).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import stat
import struct
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

SECRET_ENV = "BATCHINFER_NODE_SECRET"
MIN_SECRET_CHARS = 16
HANDSHAKE_S = 10.0          # for a client to prove itself
MAX_FRAME = 16 << 20        # bytes of one request or answer
MAX_HANDSHAKES = 64         # connections proving themselves at once; more are dropped
MAGIC = b"batchinfer-meet/1"
NONCE = 32

# request codes
SET, GET, ADD, CHECK, WAIT, DELETE, NUM_KEYS, COMPARE_SET, HELLO, LEFT = range(10)
OK, TIMED_OUT = b"\0", b"\1"


class MeetingRefused(ConnectionError):
    """Node 0's meeting point closed the connection during the challenge: the secrets
    differ (or what listens there is not node 0's meeting point)."""


def node_secret(path: str | None) -> bytes:
    """The job's secret: the file at `path` (readable by its owner alone), else
    $BATCHINFER_NODE_SECRET. ValueError (one line, what to do) when there is none."""
    if path is not None:
        try:
            info = os.stat(path)
            if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise ValueError(f"--node-secret-file {path} may be read by other users "
                                 f"(mode {stat.S_IMODE(info.st_mode):o}); chmod 600 it")
            with open(path, "rb") as f:
                secret = f.read(4096).strip()
        except OSError as e:
            raise ValueError(f"--node-secret-file {path}: {e.strerror or e}") from None
        where = f"--node-secret-file {path}"
    else:
        secret = os.environ.get(SECRET_ENV, "").strip().encode()
        where = f"${SECRET_ENV}"
        if not secret:
            raise ValueError(f"nodes meet only with a secret that every node of the job "
                             f"holds: set {SECRET_ENV} (e.g. to `python -c 'import secrets; "
                             f"print(secrets.token_hex(32))'`) in every node's environment or "
                             f"pass --node-secret-file (slurm/batchinfer.sbatch makes one)")
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"{where} is {len(secret)} characters; a node secret needs at least "
                         f"{MIN_SECRET_CHARS} (e.g. secrets.token_hex(32))")
    return secret


def new_secret() -> str:
    return secrets.token_hex(32)


def _mac(secret: bytes, side: bytes, nonces: bytes) -> bytes:
    return hmac.new(secret, side + nonces, hashlib.sha256).digest()


def _read_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the connection closed")
        data += chunk
    return bytes(data)


def _send(sock: socket.socket, fields: list[bytes]) -> None:
    body = b"".join(struct.pack("!I", len(f)) + f for f in fields)
    sock.sendall(struct.pack("!II", len(body), len(fields)) + body)


def _receive(sock: socket.socket) -> list[bytes]:
    size, count = struct.unpack("!II", _read_exact(sock, 8))
    if size > MAX_FRAME or count > size // 4:
        raise ConnectionError(f"a frame of {size} bytes in {count} parts is out of bounds")
    body, fields, at = _read_exact(sock, size), [], 0
    for _ in range(count):
        (n,) = struct.unpack_from("!I", body, at)
        at += 4
        if at + n > size:
            raise ConnectionError("a frame's parts run past its end")
        fields.append(body[at:at + n])
        at += n
    return fields


def _as_bytes(value) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class MeetingPoint:
    """Node 0's side: serves the store at (addr, port) until close(); port 0 takes a free
    one, which `port` tells."""

    def __init__(self, addr: str, port: int, secret: bytes, log=None):
        self._secret = secret
        self._log = log or sys.stderr
        self._data: dict[str, bytes] = {}
        self._changed = threading.Condition()
        self._nodes: dict[int, int] = {}   # node rank -> its open connections that said hello
        self._left: set[int] = set()        # nodes that said hello and whose connections all closed
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self._connections: set[socket.socket] = set()
        self._closed = False
        try:
            family, kind, proto, _, address = socket.getaddrinfo(
                addr, port, type=socket.SOCK_STREAM)[0]
            self._listener = socket.socket(family, kind, proto)
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind(address)
            self._listener.listen(128)
            self.port = self._listener.getsockname()[1]
        except OSError as e:
            raise ConnectionError(f"cannot serve the nodes' meeting point {addr}:{port} "
                                  f"(--master-addr/--master-port): {e.strerror or e}") from None
        threading.Thread(target=self._accept, name="batchinfer-meet", daemon=True).start()

    def nodes_left(self) -> set[int]:
        """The nodes that said hello and whose connections have all closed since."""
        with self._changed:
            return set(self._left)

    def nodes_seen(self) -> set[int]:
        """The nodes that said hello, gone or not."""
        with self._changed:
            return set(self._nodes)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return
            if not self._handshakes.acquire(blocking=False):
                conn.close()  # a flood of connections that never prove themselves
                continue
            threading.Thread(target=self._serve, args=(conn, peer), daemon=True,
                             name="batchinfer-meet-conn").start()

    def _serve(self, conn: socket.socket, peer) -> None:
        rank = None
        try:
            try:
                conn.settimeout(HANDSHAKE_S)
                nonce = os.urandom(NONCE)
                conn.sendall(MAGIC + nonce)
                answer = _read_exact(conn, NONCE + 32)
                nonces = nonce + answer[:NONCE]
                if not hmac.compare_digest(answer[NONCE:], _mac(self._secret, b"client", nonces)):
                    raise PermissionError
                conn.sendall(_mac(self._secret, b"server", nonces))
                conn.settimeout(None)
            except (OSError, ConnectionError, PermissionError) as e:
                # (a rank killed while it connects ends here too, by a closed connection)
                why = "it did not prove it holds this job's secret" if isinstance(
                    e, PermissionError) else f"its handshake ended unfinished ({e or 'closed'})"
                print(f"batchinfer: warning: refused a connection to the nodes' meeting point "
                      f"from {peer[0]}:{peer[1]}: {why}", file=self._log, flush=True)
                return
            finally:
                self._handshakes.release()
            with self._changed:
                if self._closed:
                    return
                self._connections.add(conn)
            while True:
                fields = _receive(conn)
                if fields and fields[0] == bytes([HELLO]) and rank is None:
                    rank = int(fields[1])
                    with self._changed:
                        self._nodes[rank] = self._nodes.get(rank, 0) + 1
                        self._left.discard(rank)
                        self._changed.notify_all()
                    _send(conn, [OK])
                    continue
                _send(conn, self._answer(fields))
        except (OSError, ConnectionError, ValueError, IndexError, struct.error):
            pass  # a closed or broken connection, or a malformed request: drop it
        finally:
            conn.close()
            with self._changed:
                self._connections.discard(conn)
                if rank is not None:
                    self._nodes[rank] -= 1
                    if not self._nodes[rank]:
                        self._left.add(rank)
                self._changed.notify_all()

    def _answer(self, fields: list[bytes]) -> list[bytes]:
        op, args = fields[0][0], fields[1:]
        data = self._data
        with self._changed:
            if op == SET:
                data[args[0].decode()] = args[1]
                self._changed.notify_all()
                return [OK]
            if op == GET or op == WAIT:
                keys = [k.decode() for k in args[1:]]
                ready = self._changed.wait_for(lambda: all(k in data for k in keys),
                                               timeout=int(args[0]) / 1000)
                if not ready:
                    return [TIMED_OUT]
                return [OK, data[keys[0]]] if op == GET else [OK]
            if op == ADD:
                key = args[0].decode()
                value = int(data.get(key, b"0")) + int(args[1])
                data[key] = str(value).encode()
                self._changed.notify_all()
                return [OK, str(value).encode()]
            if op == CHECK:
                return [OK, b"1" if all(k.decode() in data for k in args) else b"0"]
            if op == DELETE:
                return [OK, b"1" if data.pop(args[0].decode(), None) is not None else b"0"]
            if op == NUM_KEYS:
                return [OK, str(len(data)).encode()]
            if op == COMPARE_SET:
                key, expected, desired = args[0].decode(), args[1], args[2]
                current = data.get(key)
                if (current is None and not expected) or current == expected:
                    data[key] = desired
                    self._changed.notify_all()
                    return [OK, desired]
                return [OK, expected if current is None else current]
            if op == LEFT:
                return [OK, *(str(r).encode() for r in sorted(self._left))]
        raise ValueError(f"unknown request {op}")

    def close(self) -> None:
        with self._changed:
            self._closed = True
            connections = list(self._connections)
        try:
            self._listener.close()
        except OSError:
            pass
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class MeetingStore(dist.Store):
    """A process's connection to node 0's meeting point. Connecting retries while nothing
    listens (node 0 may start later) up to `connect_timeout`; a wait for a key gives up
    after `timeout` with a TimeoutError. One request at a time per connection."""

    def __init__(self, addr: str, port: int, secret: bytes, connect_timeout: timedelta,
                 timeout: timedelta):
        super().__init__()
        self.address = f"{addr}:{port}"
        self._wait_s = timeout.total_seconds()
        self._lock = threading.Lock()
        deadline = time.monotonic() + connect_timeout.total_seconds()
        try:
            infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            raise ConnectionError(f"cannot resolve --master-addr {addr}: {e.strerror}") from None
        while True:  # until node 0 listens and sends its challenge
            try:
                self._sock = socket.create_connection(infos[0][4][:2], timeout=HANDSHAKE_S)
                try:
                    head = _read_exact(self._sock, len(MAGIC) + NONCE)
                except (OSError, ConnectionError):
                    self._sock.close()  # dropped unchallenged (node 0 busy): try again
                    raise
                break
            except (OSError, ConnectionError) as e:
                if time.monotonic() >= deadline:
                    raise ConnectionError(f"nothing answered at the nodes' meeting point "
                                          f"{self.address} within "
                                          f"{connect_timeout.total_seconds():.0f} s: "
                                          f"{getattr(e, 'strerror', None) or e}") from None
                time.sleep(0.5)
        try:
            if not head.startswith(MAGIC):
                raise MeetingRefused(f"{self.address} is not a batchinfer meeting point")
            mine = os.urandom(NONCE)
            nonces = head[len(MAGIC):] + mine
            self._sock.sendall(mine + _mac(secret, b"client", nonces))
            proof = _read_exact(self._sock, 32)
            if not hmac.compare_digest(proof, _mac(secret, b"server", nonces)):
                raise MeetingRefused(f"the meeting point at {self.address} does not hold this "
                                     "node's secret")
        except (OSError, ConnectionError) as e:
            self._sock.close()
            if isinstance(e, MeetingRefused):
                raise
            raise MeetingRefused(f"node 0's meeting point at {self.address} refused this "
                                 "node: its secret differs from this node's "
                                 "($BATCHINFER_NODE_SECRET or --node-secret-file)") from None
        self._sock.settimeout(None)

    def _request(self, op: int, *args, wait_s: float | None = None) -> list[bytes]:
        with self._lock:
            self._sock.settimeout(None if wait_s is None else wait_s + 30.0)
            _send(self._sock, [bytes([op]), *(_as_bytes(a) for a in args)])
            answer = _receive(self._sock)
        if answer[0] == TIMED_OUT:
            raise TimeoutError(f"waited {wait_s:.0f} s for the nodes' meeting point "
                               f"{self.address} to hold {args[1:] if op != GET else args[1]}")
        return answer[1:]

    # torch.distributed.Store
    def set(self, key, value) -> None:
        self._request(SET, key, value)

    def get(self, key) -> bytes:
        return self.get_within(key, self._wait_s)

    def add(self, key, amount) -> int:
        return int(self._request(ADD, key, str(int(amount)))[0])

    def check(self, keys) -> bool:
        return self._request(CHECK, *keys)[0] == b"1"

    def wait(self, keys, timeout=None) -> None:
        wait_s = self._wait_s if timeout is None else timeout.total_seconds()
        self._request(WAIT, str(int(wait_s * 1000)), *keys, wait_s=wait_s)

    def delete_key(self, key) -> bool:
        return self._request(DELETE, key)[0] == b"1"

    def num_keys(self) -> int:
        return int(self._request(NUM_KEYS)[0])

    def compare_set(self, key, expected, desired) -> bytes:
        return self._request(COMPARE_SET, key, expected, desired)[0]

    # the nodes
    def get_within(self, key: str, wait_s: float) -> bytes:
        """The key's value, waiting up to wait_s for it to be set (TimeoutError past it)."""
        return self._request(GET, str(int(wait_s * 1000)), key, wait_s=wait_s)[0]

    def hello(self, node_rank: int) -> None:
        """Say this connection is node `node_rank`'s: node 0 sees the node leave when the
        connection closes (its process exits or dies)."""
        self._request(HELLO, str(node_rank))

    def nodes_left(self) -> set[int]:
        """The nodes whose hello connection has closed since they said hello."""
        return {int(r) for r in self._request(LEFT)}

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass
