"""One engine over several nodes: where each node's processes meet.

`batchinfer run ... --nnodes N --node-rank R --master-addr HOST --master-port P` on every
node (slurm/batchinfer.sbatch starts them with srun) makes one engine of
tensor_parallel_size x pipeline_parallel_size ranks, the same number on each node: node R
holds global ranks R*L .. R*L+L-1 (L ranks a node), so with tensor parallelism inside a
node the pipeline stages fall on the nodes. Node 0 runs the job (input, scheduling,
output); the others serve its steps.

Node 0 serves the meeting point (batchinfer.engine.node_store) at HOST:P from its start,
to processes holding the job's secret alone; the others connect to it (waiting for node 0
to come up), say hello, and wait for its word: "engine" once node 0 loads the model,
"done" when the job needs no engine (it was finished), anything else when node 0 failed
before loading. Before the group forms, every node says which engine it would run
(engine_identity) and node 0 compares them: nodes started with another model, dtype or
sizes are all refused with one line naming the difference. Every process of the engine
then joins the process group through the same store. A node that goes away closes its
connection, which node 0 sees at once; its group connections break too, so the others
fail instead of waiting.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from batchinfer.engine.node_store import MeetingPoint, MeetingStore, node_secret

WAIT_FOR_NODE0 = timedelta(hours=2)   # for node 0 to start and to decide (it may queue)
WAIT_FOR_NODES_S = 120.0  # for the nodes that said hello to read a "done" or "failed"
LATE_NODES_S = 10.0       # ... and for nodes that have not connected yet
WAIT_FOR_IDENTITIES_S = 300.0  # for every node to say which engine it runs, after "engine"
START = "batchinfer/start"
SEEN = "batchinfer/seen"
IDENTITY = "batchinfer/identity/"
VERDICT = "batchinfer/verdict"
VERDICT_SEEN = "batchinfer/verdict-seen"
SAME = "same"


class NodeMismatch(ValueError):
    """The nodes were started for different engines (another model, dtype or size)."""


class NodesInterrupted(Exception):
    """A signal ended node 0's wait for the other nodes (nothing ran yet)."""

    def __init__(self, signum: int, what: str):
        super().__init__(f"stopped by {signal.Signals(signum).name} while {what}")
        self.signum = signum


@contextlib.contextmanager
def _interruptible(what: str) -> Iterator[None]:
    """In the main thread: SIGTERM, SIGINT or SIGHUP ends the wait with NodesInterrupted
    (whatever handler the caller has, which is back afterwards)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise NodesInterrupted(signum, what)

    previous = {sig: signal.signal(sig, interrupt)
                for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@dataclass(frozen=True)
class NodeGroup:
    count: int
    rank: int
    master_addr: str
    master_port: int
    secret: bytes = field(repr=False)

    @classmethod
    def of(cls, config) -> "NodeGroup | None":
        """The group an EngineConfig describes; None on one node. ValueError without a
        secret."""
        if config.nnodes <= 1:
            return None
        return cls(config.nnodes, config.node_rank, config.master_addr, config.master_port,
                   node_secret(config.node_secret_file))

    def ranks_per_node(self, world: int) -> int:
        if world % self.count:
            raise ValueError(f"tensor_parallel_size x pipeline_parallel_size ({world}) does "
                             f"not split evenly over nnodes {self.count}")
        return world // self.count

    def store(self) -> MeetingStore:
        """This process's connection to node 0's meeting point (node 0's first call serves
        it; another node's says hello as that node)."""
        if self.rank == 0:
            _serve(self.master_addr, self.master_port, self.secret)
        return _connect(self.master_addr, self.master_port, self.secret, self.rank or None)

    def worker_store(self) -> MeetingStore:
        """A connection for another process of this node (a local worker rank)."""
        return _connect(self.master_addr, self.master_port, self.secret, None)

    def left(self) -> set[int]:
        """Node 0: the nodes that said hello and have gone since; empty elsewhere."""
        if self.rank != 0:
            return set()
        return _serve(self.master_addr, self.master_port, self.secret).nodes_left()

    def announce(self, word: str) -> None:
        """Node 0: tell the other nodes what comes ("engine", "done", "failed"); the first
        word stands. Node 0's meeting point must outlive their reading a word that ends the
        run, so for those this waits until every node that said hello has read it (up to
        WAIT_FOR_NODES_S), and up to LATE_NODES_S for nodes not connected yet."""
        store = self.store()
        if store.check([START]):
            return
        store.set(START, word)
        if word == "engine":  # the group's forming waits for every node
            return
        point = _serve(self.master_addr, self.master_port, self.secret)
        start = time.monotonic()
        while (seen := store.add(SEEN, 0)) < self.count - 1:
            waited = time.monotonic() - start
            if waited > WAIT_FOR_NODES_S or (waited > LATE_NODES_S
                                             and seen >= len(point.nodes_seen())):
                return
            time.sleep(0.1)

    def announced(self) -> bool:
        """Node 0: whether a word was announced."""
        return self.store().check([START])

    def wait_for_word(self) -> str:
        """Another node: node 0's word; ConnectionError when node 0 is gone or refuses this
        node (another secret)."""
        try:
            store = self.store()
            word = store.get_within(START, WAIT_FOR_NODE0.total_seconds()).decode()
            store.add(SEEN, 1)
            return word
        except (OSError, TimeoutError) as e:
            raise ConnectionError(f"node 0 ({self.master_addr}:{self.master_port}) went away "
                                  f"before it started the engine: {e}") from None

    def agree(self, identity: dict) -> None:
        """Every node: check that all nodes run the same engine, before the group forms.
        Node 0 waits for every node's identity and says whether they match; NodeMismatch
        (on every node) names what differs."""
        store = self.store()
        if self.rank != 0:
            try:
                store.set(f"{IDENTITY}{self.rank}", json.dumps(identity, sort_keys=True))
                verdict = store.get_within(VERDICT, WAIT_FOR_IDENTITIES_S + 60).decode()
                store.add(VERDICT_SEEN, 1)
            except (OSError, TimeoutError) as e:
                raise ConnectionError(f"node 0 went away while the nodes compared their "
                                      f"engines: {e}") from None
            if verdict != SAME:
                raise NodeMismatch(verdict)
            return
        keys = [f"{IDENTITY}{r}" for r in range(1, self.count)]

        def missing() -> str:
            return ", ".join(str(r) for r, key in enumerate(keys, 1) if not store.check([key]))

        start, said = time.monotonic(), False
        with _interruptible("waiting for the other nodes to say which engine they run"):
            while not store.check(keys):
                waited = time.monotonic() - start
                if waited > 2 and not said:
                    print(f"batchinfer: waiting for node(s) {missing()} to join (up to "
                          f"{WAIT_FOR_IDENTITIES_S:.0f} s)", file=sys.stderr, flush=True)
                    said = True
                if left := self.left():
                    raise ConnectionError(f"node {min(left)} left before the engine started")
                if waited > WAIT_FOR_IDENTITIES_S:
                    raise TimeoutError(f"node(s) {missing()} did not say which engine they "
                                       f"run within {WAIT_FOR_IDENTITIES_S:.0f} s")
                time.sleep(0.05)
        differences = []
        for r, key in enumerate(keys, 1):
            theirs = json.loads(store.get(key))
            for name in sorted(set(identity) | set(theirs)):
                if identity.get(name) != theirs.get(name):
                    differences.append(f"node {r} has {name} {_short(theirs.get(name))} where "
                                       f"node 0 has {_short(identity.get(name))}")
        verdict = SAME
        if differences:
            verdict = ("the nodes were started for different engines: "
                       f"{'; '.join(differences)}; start every node with the same command "
                       "and the same model files")
        store.set(VERDICT, verdict)
        if differences:  # the nodes read it before node 0 ends (they are all connected)
            deadline = time.monotonic() + LATE_NODES_S
            while (store.add(VERDICT_SEEN, 0) < self.count - 1 and not self.left()
                   and time.monotonic() < deadline):
                time.sleep(0.05)
            raise NodeMismatch(verdict)


def engine_identity(config, model_path: Path, dtype, max_model_len: int) -> dict:
    """What every node of one engine must share: the engine's settings, the model files'
    names and sizes and its config's hash, batchinfer's version. Paths, addresses and the
    node's own rank may differ."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        release = version("batchinfer")
    except PackageNotFoundError:
        release = "unknown"
    local = {"model", "tokenizer", "node_rank", "master_addr", "master_port",
             "node_secret_file", "device"}
    identity = {name: value for name, value in vars(config).items() if name not in local}
    path = Path(model_path)
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.suffix in (".safetensors", ".gguf", ".bin", ".pt"))
    identity["model files"] = {p.name: p.stat().st_size for p in files}
    config_file = path / "config.json"
    if config_file.is_file():
        identity["model config.json"] = hashlib.sha256(config_file.read_bytes()).hexdigest()[:16]
    identity.update({"the model's dtype": str(dtype).removeprefix("torch."),
                     "the context length": max_model_len,
                     "batchinfer": release})
    return identity


def _short(value) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 120 else text[:117] + "..."


@functools.cache
def _serve(addr: str, port: int, secret: bytes) -> MeetingPoint:
    return MeetingPoint(addr, port, secret)


@functools.cache
def _connect(addr: str, port: int, secret: bytes, node_rank: int | None) -> MeetingStore:
    store = MeetingStore(addr, port, secret, connect_timeout=WAIT_FOR_NODE0,
                         timeout=WAIT_FOR_NODE0)
    if node_rank is not None:
        store.hello(node_rank)
    return store
