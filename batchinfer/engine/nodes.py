"""One engine over several nodes: where each node's processes meet.

`batchinfer run ... --nnodes N --node-rank R --master-addr HOST --master-port P` on every
node (slurm/batchinfer.sbatch starts them with srun) makes one engine of
tensor_parallel_size x pipeline_parallel_size ranks, the same number on each node: node R
holds global ranks R*L .. R*L+L-1 (L ranks a node), so with tensor parallelism inside a
node the pipeline stages fall on the nodes. Node 0 runs the job (input, scheduling,
output); the others serve its steps.

Node 0 serves a TCP store at HOST:P from its start; the others connect to it (waiting for
node 0 to come up) and wait for its word: "engine" once node 0 loads the model (every rank
then joins the process group through the same store), "done" when the job needs no engine
(it was finished), anything else when node 0 failed before loading. A node that goes away
breaks the store's and the group's connections, so the others fail instead of waiting.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

WAIT_FOR_NODE0 = timedelta(hours=2)   # for node 0 to start and to decide (it may queue)
WAIT_FOR_NODES_S = 120.0  # for the other nodes to read a "done" or "failed" (they may start late)
START = "batchinfer/start"
SEEN = "batchinfer/seen"


@dataclass(frozen=True)
class NodeGroup:
    count: int
    rank: int
    master_addr: str
    master_port: int

    @classmethod
    def of(cls, config) -> "NodeGroup | None":
        """The group an EngineConfig describes; None on one node."""
        if config.nnodes <= 1:
            return None
        return cls(config.nnodes, config.node_rank, config.master_addr, config.master_port)

    def ranks_per_node(self, world: int) -> int:
        if world % self.count:
            raise ValueError(f"tensor_parallel_size x pipeline_parallel_size ({world}) does "
                             f"not split evenly over nnodes {self.count}")
        return world // self.count

    def store(self) -> dist.TCPStore:
        """This process's connection to node 0's store (node 0's first call serves it)."""
        return _store(self.master_addr, self.master_port, self.rank == 0)

    def worker_store(self) -> dist.TCPStore:
        """A connection for a process that node 0's store already serves (a local worker)."""
        return _store(self.master_addr, self.master_port, False)

    def announce(self, word: str) -> None:
        """Node 0: tell the other nodes what comes ("engine", "done", "failed"); the first
        word stands. Node 0's store must outlive their reading a word that ends the run,
        so for those this waits (up to WAIT_FOR_NODES_S) until every node has read it."""
        store = self.store()
        if store.check([START]):
            return
        store.set(START, word)
        if word == "engine":  # the group's forming waits for every node
            return
        deadline = time.monotonic() + WAIT_FOR_NODES_S
        while store.add(SEEN, 0) < self.count - 1 and time.monotonic() < deadline:
            time.sleep(0.1)

    def wait_for_word(self) -> str:
        """Another node: node 0's word; ConnectionError when node 0 is gone."""
        try:
            store = self.store()
            word = store.get(START).decode()
            store.add(SEEN, 1)
            return word
        except (dist.DistNetworkError, RuntimeError) as e:
            raise ConnectionError(f"node 0 ({self.master_addr}:{self.master_port}) went away "
                                  f"before it started the engine: {str(e).splitlines()[0]}") from None


@functools.cache
def _store(addr: str, port: int, serve: bool) -> dist.TCPStore:
    try:
        return dist.TCPStore(addr, port, is_master=serve, wait_for_workers=False,
                             timeout=WAIT_FOR_NODE0)
    except (dist.DistNetworkError, RuntimeError) as e:
        what = "serve" if serve else "reach"
        raise ConnectionError(f"cannot {what} the nodes' meeting point {addr}:{port} "
                              f"(--master-addr/--master-port): {str(e).splitlines()[0]}") from None
