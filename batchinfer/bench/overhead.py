"""Engine overhead: the host time an engine step costs around the model.

The real engine runs (scheduler, block pool, prefix cache, input and attention-metadata
preparation, sampler, output processing) with the model's forward replaced by ZeroModel,
which returns zero hidden states and logits of the right shapes from preallocated buffers.
With N sequences of C-token contexts decoding, each step's wall time splits in two: the
device stand-in, the work a GPU would do (the stub's forward and logits and the sampler's
kernels, argmax included, here run on the CPU), and the host time, everything else
(scheduling, input preparation, output processing): what the engine adds to every step on
top of the model. A device waits for all of it each step when the engine plans a step
after the one before has run; with async scheduling (the next step planned while one
runs), only for what exceeds the step before's device work: the result reports both.
"""
from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from batchinfer.bench.engine_run import kv_occupancy
from batchinfer.bench.workloads import Sampling
from batchinfer.engine.gc_freeze import startup_heap_frozen

FILL_TOKEN_BUDGET = 65536


class ZeroModel(torch.nn.Module):
    """The model interface (forward -> hidden [T, hidden], compute_logits -> [N, vocab])
    at no cost; any other attribute is read from the wrapped model."""

    def __init__(self, inner: torch.nn.Module, hidden_size: int, vocab_size: int):
        super().__init__()
        param = next(inner.parameters())
        self.inner = inner
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self._hidden = torch.zeros(0, hidden_size, dtype=param.dtype, device=param.device)
        # float32 logits, and the model's dtype where the model would leave them in it
        self._logits = {dtype: torch.zeros(0, vocab_size, dtype=dtype, device=param.device)
                        for dtype in {torch.float32, param.dtype}}
        self._dtype = param.dtype
        # wall and CPU time in forward, compute_logits and (TimedSampler) the sampler
        self.device_s = self.device_cpu_s = 0.0

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("inner"), name)

    @staticmethod
    def _rows(buffer: torch.Tensor, n: int) -> torch.Tensor:
        if buffer.shape[0] < n:
            buffer.resize_(max(n, 2 * buffer.shape[0]), buffer.shape[1]).zero_()
        return buffer[:n]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_meta,
                kv_caches) -> torch.Tensor:
        with self.on_device():
            return self._rows(self._hidden, input_ids.shape[0])

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        dtype = torch.float32 if float32 else self._dtype
        with self.on_device():
            return self._rows(self._logits[dtype], hidden.shape[0])

    @contextlib.contextmanager
    def on_device(self) -> Iterator[None]:
        """Count the block's wall and CPU time as device work."""
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.device_s += time.perf_counter() - wall
            self.device_cpu_s += time.process_time() - cpu


class TimedSampler:
    """The runner's sampler, its calls (the sampling kernels a GPU would run) timed as the
    clock's device work; anything else is read from the sampler."""

    def __init__(self, inner: Any, clock: ZeroModel):
        self.inner = inner
        self.clock = clock

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def __call__(self, *args, **kwargs):
        with self.clock.on_device():
            return self.inner(*args, **kwargs)


@dataclass
class OverheadResult:
    num_seqs: int
    context_len: int
    mean_context_len: float       # context at the end of the measurement (prefill + output)
    steps: int
    # Means over the steps: with every context the same length, the steps that cross a
    # block boundary (allocation, prefix-cache registration) come together, so a median
    # would leave them out.
    # wall time (time.perf_counter()), split into the host's and the device stand-in's (the
    # stub's forward and logits, and the sampler)
    wall_ms_per_step: float
    host_ms_per_step: float
    device_standin_ms_per_step: float
    # CPU time (time.process_time(), every thread of the process), split the same way: on a
    # machine shared with other work, the steadier measure of the engine's own work
    cpu_ms_per_step: float
    host_cpu_ms_per_step: float
    device_standin_cpu_ms_per_step: float
    wall_ms_per_step_median: float
    host_ms_per_step_median: float
    device_standin_ms_per_step_median: float
    cpu_ms_per_step_median: float
    host_cpu_ms_per_step_median: float
    device_standin_cpu_ms_per_step_median: float
    async_scheduling: bool = False
    # how long a device would wait for the host each step (mean): the host time, or with
    # async scheduling what of it exceeds the device work of the step before
    device_wait_ms_per_step: float = 0.0

    def line(self) -> str:
        return (f"Engine overhead: {self.num_seqs} seqs x {self.context_len} context "
                f"(mean {self.mean_context_len:.0f} at the end): "
                f"host {self.host_ms_per_step:.3f} + device stand-in "
                f"{self.device_standin_ms_per_step:.3f} = {self.wall_ms_per_step:.3f} ms "
                f"wall/step, host {self.host_cpu_ms_per_step:.3f} + device stand-in "
                f"{self.device_standin_cpu_ms_per_step:.3f} = {self.cpu_ms_per_step:.3f} ms "
                f"CPU/step (means of {self.steps} decode steps; medians "
                f"{self.host_ms_per_step_median:.3f} + {self.device_standin_ms_per_step_median:.3f}"
                f" wall, {self.host_cpu_ms_per_step_median:.3f} + "
                f"{self.device_standin_cpu_ms_per_step_median:.3f} CPU); a device would "
                f"wait {self.device_wait_ms_per_step:.3f} ms/step"
                + (" (async scheduling)" if self.async_scheduling else ""))


def _fill(engine) -> None:
    """Step until every request is running with its prompt computed."""
    computed = engine.stats().get("num_prompt_tokens_computed", 0)
    while True:
        engine.step()
        stats = engine.stats()
        now = stats.get("num_prompt_tokens_computed", 0)
        if stats["num_waiting"] == 0 and now == computed:
            return
        computed = now


def measure_overhead(model_path: str, num_seqs: int, context_len: int, steps: int, *,
                     warmup_steps: int = 3, block_size: int = 16, dtype: str = "auto",
                     seed: int = 0, attention_backend: str = "auto",
                     enable_prefix_caching: bool = True, device: str | None = None,
                     sampling: Sampling = Sampling(),
                     async_scheduling: bool = False) -> OverheadResult:
    """Per-step engine time with num_seqs sequences decoding at context_len tokens
    (greedy, or drawing as sampling says)."""
    from batchinfer.engine.engine import LLMEngine
    # A large token budget keeps the fill short, so that sequences whose prefill ends early
    # decode only a few tokens before the measurement starts. Each sequence generates at
    # most one token per fill step, then the warm-up and measured steps; plus slack.
    budget = max(num_seqs, min(num_seqs * context_len, FILL_TOKEN_BUDGET))
    fill_steps = -(-num_seqs * context_len // budget) + 1
    max_new = fill_steps + warmup_steps + steps + 4
    max_len = context_len + max_new + 1
    blocks_per_seq = -(-max_len // block_size)
    engine = LLMEngine.from_kwargs(
        model=model_path, load_format="dummy", dtype=dtype, seed=seed, block_size=block_size,
        enable_prefix_caching=enable_prefix_caching, max_num_seqs=num_seqs,
        max_num_batched_tokens=budget, max_model_len=max_len,
        num_kv_blocks=num_seqs * blocks_per_seq + 1, attention_backend=attention_backend,
        device=device, async_scheduling=async_scheduling,
        enforce_eager=True)  # graphs would replay the real model, not the stub
    try:
        config = engine.model_config
        runner = engine.model_runner
        runner.model = clock = ZeroModel(runner.model, config.hidden_size, config.vocab_size)
        runner.sampler = TimedSampler(runner.sampler, clock)
        # the stub writes no KV: its cache needs no memory backing it (which a real model's
        # writes would claim, and which is no engine work)
        runner.kv_pages = None
        rng = np.random.default_rng(seed)
        params = sampling.engine_params(max_new)
        wall, device, cpu, device_cpu = [], [], [], []
        with startup_heap_frozen():  # as `batchinfer run` and LLM.generate run
            for i in range(num_seqs):
                engine.add_request(f"overhead-{i}", rng.integers(
                    0, config.vocab_size, size=context_len).tolist(), params)
            _fill(engine)
            for _ in range(warmup_steps):
                engine.step()
            for _ in range(steps):
                d0, dc0 = clock.device_s, clock.device_cpu_s
                c0, w0 = time.process_time(), time.perf_counter()
                finished = engine.step()
                cpu.append(time.process_time() - c0)
                wall.append(time.perf_counter() - w0)
                device.append(clock.device_s - d0)
                device_cpu.append(clock.device_cpu_s - dc0)
                if finished:
                    raise RuntimeError("a sequence finished during the overhead measurement")
        running, context, _, _ = kv_occupancy(engine)
        if running != num_seqs:
            raise RuntimeError(f"only {running} of {num_seqs} sequences were running; the KV "
                               "pool or max_num_seqs is too small")
    finally:
        del engine
        gc.collect()
    host = [w - d for w, d in zip(wall, device)]
    host_cpu = [c - d for c, d in zip(cpu, device_cpu)]
    series = (wall, host, device, cpu, host_cpu, device_cpu)
    # an async step's host work runs beside the device work of the step started before it
    # (the first measured step's is not known: counted as waited for)
    wait = ([host[0]] + [max(0.0, h - d) for h, d in zip(host[1:], device)]
            if async_scheduling else host)
    return OverheadResult(num_seqs, context_len, context / num_seqs, steps,
                          *(statistics.fmean(x) * 1e3 for x in series),
                          *(statistics.median(x) * 1e3 for x in series),
                          async_scheduling, statistics.fmean(wait) * 1e3)
