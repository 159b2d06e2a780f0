"""Tensor and pipeline parallelism across processes: rank 0 is the engine's own process,
ranks 1..N-1 are worker processes started here, N = tensor_parallel_size x
pipeline_parallel_size. Rank r is tensor-parallel rank r % T of pipeline stage r // T.
Every rank builds a model runner over its stage's layers and its shard of their weights
and KV heads (batchinfer.model.parallel cuts them); rank 0 schedules and sends each step's
plan to the workers, and all ranks execute it together, meeting in the all-reduces of the
forward pass and, between stages, in the sends of batchinfer.engine.pipeline.

Plans travel over a pipe to each worker of the node rather than a collective: a worker
waits for its next plan as long as rank 0 is idle (a collective would time out), and a
pipe closes when either end dies. Only a node's own processes read that pipe, so it
carries pickles; to the other nodes' first ranks node 0 broadcasts the plan encoded by
batchinfer.engine.wire, which runs no code when read.

Rank 0 alone samples, from the logits every rank all-gathers, and the tokens it sampled in
a step travel with the next plan: a worker needs them only as that step's inputs, so they
cost a few bytes a row and no wait. Everything that picks a token therefore lives in one
process, as without parallelism: generators, penalties, and the structured outputs' tries
and regex automata, with their limits. An automaton that passes its size or its time
limit per step (timed by rank 0's clock alone) ends its completion on rank 0, and the
workers only see it finished in the next plan: no rank can pick another token or wait in
another collective. The alternatives cost more a step: each rank building its own
automata repeats that host work on every rank and needs the ranks to agree each step on
a time limit that one of them passed (a collective), and rank 0 shipping allowed-token
masks sends up to a vocabulary's ids per row and step. A regex's guide is rank 0's and is
left out of the plans (_for_workers).

Process groups: NCCL on CUDA (rank r on device index + r), gloo on CPU. On CUDA every rank
captures its decode steps in CUDA graphs, as one process does (batchinfer.engine.cuda_graphs):
the same sizes in the same order, after a warm-up all-reduce creates NCCL's communicator,
so the all-reduces inside the graphs pair up across ranks; enforce_eager keeps every rank
eager.
"""
from __future__ import annotations

import copy
import multiprocessing
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from batchinfer.config import EngineConfig
from batchinfer.engine.scheduler import SchedulerOutput
from batchinfer.model.config import ModelConfig
from batchinfer.engine import wire
from batchinfer.engine.node_store import MeetingPoint, MeetingStore, new_secret
from batchinfer.engine.nodes import WAIT_FOR_NODE0, NodeGroup, engine_identity
from batchinfer.model.parallel import PipelineParallel, TensorParallel

STARTUP_TIMEOUT_S = 600.0       # for every worker to start and import torch
# a collective that waits this long has lost a rank: the job fails rather than hangs (long
# enough for ranks whose checkpoint loads finish far apart, as on a busy shared filesystem)
GROUP_TIMEOUT = timedelta(minutes=30)
JOIN_TIMEOUT_S = 30.0           # for a worker to exit after shutdown
GIVEN_UP_JOIN_S = 5.0           # for a join rank 0 gave up to fail once its store is gone
LOOPBACK = "127.0.0.1"


# rank 0's join of a start that failed, still waiting out its rendezvous in the background
_stranded_join: threading.Thread | None = None
# the store the group met through: torch calls back into this Python object, which must
# live as long as the group does
_group_store: MeetingStore | None = None


class WorkerError(RuntimeError):
    """A worker rank failed or is gone; the message carries what it reported."""


@dataclass
class RunnerArgs:
    """What a worker needs to build the same ModelRunner as rank 0 (for its own rank)."""
    config: EngineConfig
    model_config: ModelConfig
    model_path: Path
    device: torch.device        # rank 0's
    dtype: torch.dtype
    max_model_len: int
    eos_token_ids: frozenset[int]


def check_divisible(config: ModelConfig, size: int) -> None:
    """A clear error before any process starts when the model cannot be split size ways.
    KV heads may be fewer than the ranks: each is then replicated on size // heads ranks."""
    sizes = {"num_attention_heads": config.num_attention_heads,
             "intermediate_size": config.intermediate_size}
    if config.moe is not None:
        sizes["moe_intermediate_size"] = config.moe.intermediate_size
    for name, n in sizes.items():
        if n % size:
            raise ValueError(f"tensor_parallel_size {size} does not divide the model's {name} "
                             f"({n}); use a divisor of it")
    kv = config.num_key_value_heads
    if kv % size and size % kv:
        raise ValueError(f"tensor_parallel_size {size} neither divides nor is a multiple of "
                         f"the model's num_key_value_heads ({kv}); use a divisor or a "
                         "multiple of it")


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """The device of this node's local_rank-th rank (rank 0 on `device`)."""
    if device.type == "cuda":
        return torch.device("cuda", (device.index or 0) + local_rank)
    return device


@dataclass(frozen=True)
class Rendezvous:
    """Where a group's ranks meet: on one node, the meeting point rank 0 serves on loopback
    (port) under a secret of this engine's own; across nodes, node 0's.

    Not a file (torch's FileStore): a rank killed between the write() calls of one record
    leaves the file torn, and FileStore then reads it forever, in its constructor holding
    the GIL, so rank 0 could neither finish joining nor notice that the worker died."""
    port: int = 0
    secret: bytes = field(default=b"", repr=False)
    nodes: NodeGroup | None = None

    def store(self, leader: bool) -> MeetingStore:
        if self.nodes is not None:
            return self.nodes.store() if leader else self.nodes.worker_store()
        return MeetingStore(LOOPBACK, self.port, self.secret, connect_timeout=GROUP_TIMEOUT,
                            timeout=GROUP_TIMEOUT)


def _join(rank: int, size: int, meet: Rendezvous, device: torch.device, tp_size: int,
          leader: bool):
    """Join the group (size ranks: pipeline stages of tp_size ranks each) and point the
    parallel layers at it. Across nodes: the gloo group of the nodes' first ranks, which
    node 0 sends its plans over (None elsewhere)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    previous = os.environ.get("GLOO_SOCKET_IFNAME")
    if sys.platform == "linux" and previous is None and meet.nodes is None:
        # every rank is on this machine: gloo over loopback, whatever the hostname resolves to
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    global _group_store
    leaders = None
    try:
        _group_store = store = meet.store(leader)
        dist.init_process_group(backend, store=dist.PrefixStore("group", store), rank=rank,
                                world_size=size, timeout=GROUP_TIMEOUT)
        # host-side agreements (KV block counts) go over gloo whatever the device backend
        cpu_group = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo")
        # every rank makes every stage's group, in the same order
        stages = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size)))
                  for s in range(size // tp_size)] if tp_size < size else [dist.group.WORLD]
        if meet.nodes is not None:  # node 0's plans may be a long time coming
            per_node = meet.nodes.ranks_per_node(size)
            leaders = dist.new_group(list(range(0, size, per_node)), backend="gloo",
                                     timeout=WAIT_FOR_NODE0)
    finally:
        if previous is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
    TensorParallel.rank, TensorParallel.size = rank % tp_size, tp_size
    TensorParallel.group, TensorParallel.cpu_group = stages[rank // tp_size], cpu_group
    PipelineParallel.rank, PipelineParallel.size = rank // tp_size, size // tp_size
    return leaders


def _leave() -> None:
    global _group_store
    if dist.is_initialized():
        dist.destroy_process_group()
    _group_store = None
    TensorParallel.rank, TensorParallel.size = 0, 1
    TensorParallel.group = TensorParallel.cpu_group = None
    PipelineParallel.rank, PipelineParallel.size = 0, 1


def _die_with_parent() -> None:
    """Linux: the kernel kills this worker when rank 0's process dies, even while it is
    blocked in a collective."""
    if sys.platform != "linux":
        return
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _worker_main(rank: int, size: int, meet: Rendezvous, args: RunnerArgs, threads: int,
                 local_rank: int, plans, reports) -> None:
    # Ctrl-C, SIGTERM from Slurm or `timeout` reach the whole process group: rank 0 finishes
    # its step and shuts the workers down, so they must not die first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()
    from batchinfer.engine.model_runner import ModelRunner
    try:
        torch.set_num_threads(threads)
        device = rank_device(args.device, local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        reports.put(("joining", rank, ""))
        _join(rank, size, meet, args.device, args.config.tensor_parallel_size, leader=False)
        runner = ModelRunner(args.config, args.model_config, args.model_path, device, args.dtype,
                             args.max_model_len, args.eos_token_ids)
        reports.put(("built", rank, ""))
        while True:
            try:
                data = plans.recv_bytes()
            except EOFError:  # rank 0 is gone
                break
            if not data:      # shutdown
                break
            runner.execute(*pickle.loads(data))
    except BaseException:
        reports.put(("error", rank, traceback.format_exc()))
        raise
    finally:
        _leave()


def _for_workers(plan: SchedulerOutput) -> SchedulerOutput:
    """The plan without the compiled grammars of its new requests' params: a compiled
    grammar holds llguidance's tokenizer and lexer, which only the sampling rank uses."""
    if all(new.params.compiled_grammar is None for new in plan.new_requests):
        return plan
    new_requests = []
    for new in plan.new_requests:
        if new.params.compiled_grammar is not None:
            params = copy.copy(new.params)
            params.compiled_grammar = None
            new = replace(new, params=params)
        new_requests.append(new)
    return replace(plan, new_requests=new_requests)


class TensorParallelGroup:
    """A node's first rank's side (rank 0's on one node): starts this node's workers, joins
    the group, sends plans (node 0) or serves node 0's (the other nodes), shuts down."""

    def __init__(self, size: int, args: RunnerArgs, nodes: NodeGroup | None = None):
        if dist.is_initialized():
            raise RuntimeError("a tensor-parallel engine is already running in this process "
                               "(or torch.distributed is in use); call shutdown() on it first")
        if _stranded_join is not None and _stranded_join.is_alive():
            raise RuntimeError("an earlier tensor-parallel start in this process failed while "
                               "its rank 0 was joining the group, and that join has not timed "
                               "out yet; start the engine in a new process")
        device = args.device
        self.nodes = nodes
        local = nodes.ranks_per_node(size) if nodes is not None else size
        self.first_rank = nodes.rank * local if nodes is not None else 0
        if device.type == "cuda" and (device.index or 0) + local > torch.cuda.device_count():
            raise ValueError(f"{local} ranks on this node from {device} need devices up to "
                             f"cuda:{(device.index or 0) + local - 1}, but "
                             f"{torch.cuda.device_count()} are visible")
        self._closed = False
        self._broken: str | None = None
        self._leaders = None  # across nodes: the gloo group node 0's plans go over
        self._built = False   # every rank's runner is built: the nodes serve plans
        self._joining: threading.Thread | None = None  # rank 0's join
        self._point = None  # one node: where this node's ranks meet
        if nodes is None:
            secret = new_secret().encode()
            self._point = MeetingPoint(LOOPBACK, 0, secret)
            meet = Rendezvous(self._point.port, secret)
        else:
            meet = Rendezvous(nodes=nodes)
        ctx = multiprocessing.get_context("spawn")
        self._reports = ctx.Queue()
        self._errors: list[str] = []
        # on CPU the ranks share the cores: each gets its part of torch's threads
        self._threads = torch.get_num_threads()
        threads = max(1, self._threads // local) if device.type == "cpu" else self._threads
        if device.type == "cpu":
            torch.set_num_threads(threads)
        self._pipes, self.workers = [], []
        try:
            if nodes is not None:
                if nodes.rank == 0:
                    nodes.announce("engine")
                nodes.agree(engine_identity(args.config, args.model_path, args.dtype,
                                            args.max_model_len))
            for local_rank in range(1, local):
                rank = self.first_rank + local_rank
                recv, send = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_worker_main, name=f"batchinfer-tp{rank}", daemon=True,
                                   args=(rank, size, meet, args, threads, local_rank, recv,
                                         self._reports))
                self._pipes.append(send)
                proc.start()
                recv.close()
                self.workers.append(proc)
            self._wait_for("joining")
            if device.type == "cuda":  # NCCL binds each rank to its current device
                torch.cuda.set_device(rank_device(device, 0))
            self._join_watching_workers(size, meet, device, args.config.tensor_parallel_size)
        except BaseException:
            self.shutdown()
            raise

    def serve(self, runner) -> None:
        """A node other than node 0: run the plans node 0 sends until it shuts the group
        down (ConnectionError when it goes away instead)."""
        while True:
            try:
                data = wire.broadcast_bytes(None, 0, self._leaders)
            except (dist.DistNetworkError, RuntimeError) as e:
                raise ConnectionError(f"node 0 went away: {str(e).splitlines()[0]}") from None
            if not data:
                return
            runner.execute(*wire.decode_plan(data))

    def _join_watching_workers(self, size: int, meet: Rendezvous, device: torch.device,
                               tp_size: int) -> None:
        """Join the group as rank 0 while watching the workers. The join blocks until every
        rank has joined, so a worker that dies inside its own join would otherwise leave
        rank 0 waiting out the rendezvous timeout (30 minutes of a GPU node) before failing."""
        global _stranded_join
        errors: list[BaseException] = []

        def join() -> None:
            try:
                if device.type == "cuda":  # the current device is per thread
                    torch.cuda.set_device(rank_device(device, 0))
                self._leaders = _join(self.first_rank, size, meet, device, tp_size, leader=True)
            except BaseException as e:
                errors.append(e)

        thread = self._joining = threading.Thread(target=join, name="batchinfer-tp-join",
                                                  daemon=True)
        thread.start()
        try:
            while thread.is_alive():
                thread.join(0.5)
                failed = self.failure("while the group formed")
                if thread.is_alive() and failed:
                    raise WorkerError(failed)
        finally:
            if thread.is_alive():  # given up (or Ctrl-C): blocked in the rendezvous until
                _stranded_join = thread  # it times out, so no new join may start meanwhile
        if errors:
            # a join broken by a worker's death (a reset connection) is explained by it
            if failed := self.failure("while the group formed", grace_s=5.0):
                raise WorkerError(failed) from errors[0]
            raise errors[0]

    def failed_worker(self, when: str, grace_s: float = 0.0) -> str | None:
        """Once a worker is gone, what happened (its traceback, or its exit code), as an
        error message; None while all run (after waiting up to grace_s for one to end). A
        failing worker reports, then exits; the report queue is read only then, so no stage
        report is consumed."""
        deadline = time.monotonic() + grace_s
        while not (dead := [p for p in self.workers if not p.is_alive()]):
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)
        error = self.worker_error()
        if error is not None:
            return f"tensor-parallel worker failed {when}: {error}"
        return f"tensor-parallel worker {dead[0].name} exited (exit code {dead[0].exitcode}) {when}"

    def failure(self, when: str, grace_s: float = 0.0) -> str | None:
        """What broke the group, as an error message: a worker of this node that is gone
        (failed_worker), or on node 0 another node whose connection closed; None while
        all are there (after waiting up to grace_s for one to go)."""
        deadline = time.monotonic() + grace_s
        while True:
            if failed := self.failed_worker(when):
                return failed
            if self.nodes is not None and (left := self.nodes.left()):
                return (f"node {min(left)} of the engine went away {when} (its connection "
                        "to node 0 closed: the node's process ended or its host is gone)")
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _wait_for(self, stage: str) -> None:
        """Every worker reports `stage`, or the first failure is raised with its traceback."""
        reached, deadline = set(), time.monotonic() + STARTUP_TIMEOUT_S
        while len(reached) < len(self.workers):
            try:
                kind, rank, text = self._reports.get(timeout=0.5)
            except queue.Empty:
                failed = self.failed_worker("while starting")
                if failed:
                    raise WorkerError(failed) from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tensor-parallel workers did not reach '{stage}' within "
                                       f"{STARTUP_TIMEOUT_S:.0f} s") from None
                continue
            if kind == "error":
                raise WorkerError(f"tensor-parallel rank {rank} failed:\n{text}")
            if kind == stage:
                reached.add(rank)

    def wait_until_built(self) -> None:
        """After rank 0 built its runner: every worker built its own."""
        self._wait_for("built")
        self._built = True

    def worker_error(self) -> str | None:
        """The first error a worker reported, if any."""
        try:
            while True:
                kind, rank, text = self._reports.get(timeout=0.1)
                if kind == "error":
                    self._errors.append(f"rank {rank}: {text}")
        except (queue.Empty, OSError, ValueError):
            pass
        return self._errors[0] if self._errors else None

    def mark_broken(self, why: str) -> None:
        """Rank 0 left a step part way: the workers may be inside its collectives."""
        self._broken = why

    def send_plan(self, plan: SchedulerOutput, sampled: tuple[list[str], list[int]]) -> None:
        """Hand every worker the plan and the (request ids, tokens) sampled in the step
        before it."""
        if self._closed:
            raise RuntimeError("this engine was shut down")
        if self._broken is not None:
            raise RuntimeError(f"an earlier step failed part way ({self._broken}), so the "
                               "tensor-parallel ranks are out of step; shut this engine down "
                               "and start a new one")
        data = pickle.dumps((_for_workers(plan), sampled), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for pipe in self._pipes:
                pipe.send_bytes(data)
        except OSError as e:
            error = self.worker_error() or str(e)
            self._broken = "a worker is gone"
            raise WorkerError(f"a tensor-parallel worker is gone: {error}") from None
        if self._sends_to_nodes:
            self._to_nodes(wire.encode_plan(plan, sampled))

    @property
    def _sends_to_nodes(self) -> bool:
        return self._leaders is not None and self.first_rank == 0

    def _to_nodes(self, plan: bytes) -> None:
        """Node 0: an encoded plan (empty: shut down) to the other nodes' first ranks."""
        try:
            wire.broadcast_bytes(plan, 0, self._leaders)
        except (dist.DistNetworkError, RuntimeError) as e:
            self._broken = "a node is gone"
            raise WorkerError(self.failure("during a step", grace_s=5.0) or
                              f"a node of the group is gone: {str(e).splitlines()[0]}") from None

    def shutdown(self) -> None:
        """Stop the workers and leave the group; the engine cannot step after this."""
        if self._closed:
            return
        self._closed = True
        # the other nodes take a shutdown word once they serve plans; before that (a start
        # that failed) they are in the start's collectives, which leaving the group breaks
        if self._sends_to_nodes and self._broken is None and self._built:
            try:
                self._to_nodes(b"")
            except WorkerError:
                pass
        for pipe in self._pipes:
            try:
                pipe.send_bytes(b"")
                pipe.close()
            except OSError:
                pass
        self._pipes = []
        _leave()  # before joining: NCCL's teardown may wait for every rank
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for proc in self.workers:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():  # stuck in a collective of a step rank 0 left
                proc.kill()
                proc.join(5)
        self.workers = []
        self._reports.close()
        torch.set_num_threads(self._threads)
        if self._point is not None:
            self._point.close()
            # a join given up fails now that its store is gone: wait for it, since a thread
            # that needs the GIL back while the interpreter exits aborts the process
            if self._joining is not None:
                self._joining.join(GIVEN_UP_JOIN_S)
