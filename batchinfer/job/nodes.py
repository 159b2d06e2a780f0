"""A job whose engine spans several nodes (--nnodes, batchinfer.engine.nodes): node 0 runs
the job as usual, the other nodes only serve its engine's steps.

Node 0 opens the nodes' meeting point as it starts, and tells the other nodes whether an
engine comes: a job already finished, or one that fails before its model loads, lets them
go ("done": exit 0; else exit 1) instead of leaving them waiting.
"""
from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator
from typing import TextIO

from batchinfer.job.errors import JobError
from batchinfer.job.options import JobOptions


def node_group(options: JobOptions):
    """The NodeGroup of a job that spans nodes; None on one node."""
    if (options.nnodes or 1) <= 1:
        return None
    from batchinfer.engine.nodes import NodeGroup
    return NodeGroup.of(options.engine_config())


def serves(options: JobOptions) -> bool:
    """Whether this process serves node 0's engine rather than running the job."""
    return (options.nnodes or 1) > 1 and (options.node_rank or 0) > 0


@contextlib.contextmanager
def announcing(options: JobOptions, err: TextIO | None = None) -> Iterator[None]:
    """Node 0: serve the meeting point for the job's time; when it ends without having
    started the engine, tell the other nodes so ("done", or "failed" on an error)."""
    nodes = node_group(options)
    if nodes is None:
        yield
        return
    try:
        nodes.store()
    except ConnectionError as e:
        raise JobError(str(e)) from None
    try:
        yield
    except BaseException as e:
        if not nodes.announced():  # (else the nodes are in the engine: its end ends theirs)
            print(f"batchinfer: node 0 stopped ({_first_line(e)}); telling the other nodes",
                  file=err or sys.stderr, flush=True)
            nodes.announce("failed")
        raise
    nodes.announce("done")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def serve_node(options: JobOptions, err: TextIO | None = None) -> int:
    """A node other than node 0: wait for node 0's word, then serve its engine until it
    shuts it down. A signal ends the wait (there is nothing to save yet); once the engine
    runs, signals are left to node 0 (it commits, then shuts the engine down). Exit 2 when
    the nodes were started for different engines, 1 when node 0 goes away or refuses this
    node's secret."""
    err = err or sys.stderr
    options.validate()
    nodes = node_group(options)
    print(f"batchinfer: node {nodes.rank}: waiting for node 0 at {nodes.master_addr}:"
          f"{nodes.master_port}", file=err, flush=True)
    try:
        word = nodes.wait_for_word()
    except ConnectionError as e:
        print(f"batchinfer: node {nodes.rank}: {e}", file=err)
        return 1
    if word == "done":
        print(f"batchinfer: node {nodes.rank}: node 0 needs no engine (the job is done)",
              file=err)
        return 0
    if word != "engine":
        print(f"batchinfer: node {nodes.rank}: node 0 stopped before starting the engine",
              file=err)
        return 1
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    from batchinfer.demo import resolve_model
    from batchinfer.engine.engine import LLMEngine
    from batchinfer.engine.nodes import NodeMismatch
    try:
        engine = LLMEngine.from_kwargs(resolve_model(options.model), **options.engine_kwargs())
    except NodeMismatch as e:
        print(f"batchinfer: node {nodes.rank}: {e}", file=err)
        return 2
    except ConnectionError as e:
        print(f"batchinfer: node {nodes.rank}: {e}", file=err)
        return 1
    try:
        engine.serve()
    except (ConnectionError, ValueError) as e:
        print(f"batchinfer: node {nodes.rank}: {e}", file=err)
        return 1
    finally:
        engine.shutdown()
    print(f"batchinfer: node {nodes.rank}: node 0 shut the engine down", file=err)
    return 0
