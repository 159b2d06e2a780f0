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
def announcing(options: JobOptions) -> Iterator[None]:
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
    except BaseException:
        nodes.announce("failed")
        raise
    nodes.announce("done")


def serve_node(options: JobOptions, err: TextIO | None = None) -> int:
    """A node other than node 0: wait for node 0's word, then serve its engine until it
    shuts it down. Signals are left to node 0 (it commits, then shuts the engine down);
    a node 0 that goes away ends this one with exit 1."""
    err = err or sys.stderr
    options.validate()
    nodes = node_group(options)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
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
    from batchinfer.demo import resolve_model
    from batchinfer.engine.engine import LLMEngine
    engine = LLMEngine.from_kwargs(resolve_model(options.model), **options.engine_kwargs())
    try:
        engine.serve()
    except ConnectionError as e:
        print(f"batchinfer: node {nodes.rank}: {e}", file=err)
        return 1
    finally:
        engine.shutdown()
    print(f"batchinfer: node {nodes.rank}: node 0 shut the engine down", file=err)
    return 0
