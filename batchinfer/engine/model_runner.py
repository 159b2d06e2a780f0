"""Executes a step plan: builds the batch's tensors once, runs the model, samples.

The running requests' tokens, block tables and sampling settings are rows of the input
batch (input_batch.py), updated from the plan's deltas and the sampled tokens, so a step
gathers its inputs with array operations rather than a loop over its requests.
With tensor parallelism only rank 0's runner samples; the other ranks' take its tokens
with the next plan (batchinfer/engine/tensor_parallel.py). With pipeline parallelism the
last stage's first rank samples and shares the step's output with every rank at once
(batchinfer/engine/pipeline.py).
"""
from __future__ import annotations

import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from itertools import compress

import numpy as np
import torch

from batchinfer.attention import AttentionMetadata, get_attention_backend
from batchinfer.config import EngineConfig
from batchinfer.engine.cuda_graphs import DecodeGraphs, capture_sizes, captures_decode_graphs
from batchinfer.engine.host_memory import KVPagePopulator, keep_freed_memory
from batchinfer.engine.input_batch import InputBatch, StepInputs, query_positions
from batchinfer.engine.sampler import Sampler, SamplingBatch, logprobs
from batchinfer.engine.scheduler import RunnerOutput, SchedulerOutput
from batchinfer.kernels.cpu import build as cpu_build
from batchinfer.model import cpu_linear
from batchinfer.model.config import ModelConfig
from batchinfer.model.loader import load_model, weight_bytes
from batchinfer.engine import pipeline
from batchinfer.model.parallel import PipelineParallel, TensorParallel
from batchinfer.sampling_params import SamplingParams
from batchinfer.structured.after_reasoning import AfterReasoning
from batchinfer.structured.choice import ChoiceTrie
from batchinfer.structured.grammar import GrammarMatcher, MaskExecutor

CPU_DEFAULT_KV_BYTES = 4 << 30
# a batch row's token sampled by a deferred step, until DeferredOutput.result() brings it
PLACEHOLDER = -1


@dataclass
class RunnerRequest:
    """What the runner keeps of a request besides its input-batch row (its tokens and
    blocks): its parameters and the objects made from them."""
    params: SamplingParams
    generator: torch.Generator | None

    def __post_init__(self) -> None:
        p = self.params
        # argmax is all this request ever needs from the sampler
        self.plain_greedy = (p.greedy and not p.uses_penalties and p.logprobs is None
                             and not p.min_tokens and not p.constrained)
        self.structured = bool(p.choice_token_ids) or p.compiled_grammar is not None
        self._constraint_tensors = None

    @cached_property
    def structure(self) -> ChoiceTrie | GrammarMatcher | AfterReasoning | None:
        """What may come next in a structured output: a choice's trie or a grammar's
        matcher (made where the request is sampled), from the end of the reasoning where
        the request has one."""
        p = self.params
        inner = (ChoiceTrie(p.choice_token_ids) if p.choice_token_ids
                 else GrammarMatcher(p.compiled_grammar) if p.compiled_grammar is not None
                 else None)
        if inner is not None and p.reasoning_end_token_id is not None:
            return AfterReasoning(inner, p.reasoning_end_token_id)
        return inner

    def constraint_tensors(self, device: torch.device):
        """(allowed ids, (bias ids, bias values)) as tensors on device, made once; None
        for what the request does not set."""
        if self._constraint_tensors is None:
            p = self.params
            allowed = (torch.tensor(p.allowed_token_ids, device=device)
                       if p.allowed_token_ids is not None else None)
            bias = ((torch.tensor(list(p.logit_bias), device=device),
                     torch.tensor(list(p.logit_bias.values()), device=device))
                    if p.logit_bias else None)
            self._constraint_tensors = (allowed, bias)
        return self._constraint_tensors


def _say(message: str) -> None:
    print(f"batchinfer: {message}", file=sys.stderr, flush=True)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_path,
                 device: torch.device, dtype: torch.dtype, max_model_len: int,
                 eos_token_ids: frozenset[int], plan_sink=None):
        self.config = config
        # tensor parallelism, on rank 0: hands each plan to the other ranks before running
        # it, with the tokens sampled in the step before (unsent_tokens)
        self.plan_sink = plan_sink
        # one rank samples (the last pipeline stage's first); another rank only joins the
        # logits' all-gather
        self.samples = TensorParallel.rank == 0 and PipelineParallel.is_last()
        self.unsent_tokens: tuple[list[str], list[int]] = ([], [])
        self.device = device
        self.dtype = dtype
        self.kv_dtype = config.kv_cache_torch_dtype(dtype)
        self.block_size = config.block_size
        self.eos_token_ids = eos_token_ids
        if device.type == "cpu":
            keep_freed_memory()
        elif device.type == "cuda" and device.index is not None:
            # Triton launches, graph capture and synchronize() use the current device
            torch.cuda.set_device(device)
        backend = config.attention_backend
        if backend == "auto" and model_config.attention_sinks:
            backend = "torch"  # attention sinks (gpt-oss) are implemented there only
        self.backend = get_attention_backend(backend, device)
        # a first run on this machine builds the C kernels, while the weights load (one
        # rank builds them; the others find them built, or build what they use)
        kernels = (cpu_build.start_build_all(_say) if device.type == "cpu"
                   and TensorParallel.rank == 0 and PipelineParallel.rank == 0 else None)
        self.model = load_model(model_path, model_config, self.backend, dtype, device,
                                config.load_format, config.allow_pickle_weights, config.seed,
                                fp8_kv_cache=self.kv_dtype == torch.float8_e4m3fn,
                                max_position=max_model_len)
        self.rotary_positions = max_model_len  # the rotary tables' rows
        if device.type == "cpu":
            # decode steps multiply about max_num_seqs rows
            cpu_linear.pack_model(self.model, dtype, batch_hint=config.max_num_seqs)
        if kernels is not None:
            kernels.join()
        self.weight_bytes = weight_bytes(self.model)
        layers = self.model.model.stage_layers  # all of them but under pipeline parallelism
        # per layer: a key and a value cache, or (multi-head latent attention) one latent
        # cache, each [num_blocks, block_size, heads, dim]
        self.kv_parts, heads, dim = layers[0].self_attn.cache_layout()
        self.num_layers = len(layers)
        self.kv_shape = (self.block_size, heads, dim)
        # every rank must hold the same blocks: the smallest pool any rank can afford
        self.num_blocks = TensorParallel.min_across_ranks(self._num_kv_blocks(max_model_len))
        self.kv_caches = self._allocate_kv_cache(self.num_blocks)
        # on CPU, the cache's pages are backed ahead of the blocks' first use (host_memory)
        self.kv_pages = KVPagePopulator(
            [t.data_ptr() for pair in self.kv_caches for t in pair if t is not None],
            self.kv_caches[0][0][0].nbytes, self.num_blocks) if device.type == "cpu" else None
        self.max_model_len = min(max_model_len, self.num_blocks * self.block_size)
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        self.input_batch = InputBatch(config.max_num_seqs, self.max_model_len,
                                      self.max_blocks_per_seq, self.block_size)
        self.requests: dict[str, RunnerRequest] = {}
        self.scoring: set[str] = set()  # the requests asking prompt logprobs
        gen = torch.Generator(device=device).manual_seed(config.seed)
        self.sampler = Sampler(gen)
        self._mask_thread: ThreadPoolExecutor | None = None
        self._mask_executor = MaskExecutor()
        self._mask_buffer: np.ndarray | None = None
        self.graphs: DecodeGraphs | None = None
        self.num_graph_steps = 0
        # async scheduling: the last deferred step's sampled tokens, on the device, and the
        # index there of each batch row's token; the rows hold PLACEHOLDER until they come
        self._last_tokens: torch.Tensor | None = None
        self._sampled_index = np.zeros(config.max_num_seqs, dtype=np.int64)
        if PipelineParallel.size == 1 and captures_decode_graphs(
                device, config.enforce_eager, self.backend.name, self.model.graph_safe):
            TensorParallel.warm_up(device)  # NCCL's communicator exists before capture
            self.graphs = self.build_decode_graphs()

    def build_decode_graphs(self, capture: bool = True) -> DecodeGraphs:
        return DecodeGraphs(self.model, self.kv_caches,
                            sizes=capture_sizes(self.config.max_num_seqs),
                            max_blocks_per_seq=self.max_blocks_per_seq,
                            block_size=self.block_size, max_model_len=self.max_model_len,
                            device=self.device, capture=capture)

    # ---- KV cache sizing -------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        """One block's K and V (or latent rows) in every layer: an FP8 cache's are 1 byte an
        element, half of bfloat16's and a quarter of float32's."""
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        return self.kv_parts * self.num_layers * int(np.prod(self.kv_shape)) * elem

    def _num_kv_blocks(self, max_model_len: int) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        if cfg.kv_cache_memory_bytes is not None:
            budget = cfg.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = self._cuda_kv_budget()
        else:
            budget = CPU_DEFAULT_KV_BYTES
        useful = cfg.max_num_seqs * -(-max_model_len // self.block_size) + 1
        num = min(budget // self.block_bytes, useful) if cfg.kv_cache_memory_bytes is None \
            else budget // self.block_bytes
        if num < 1:
            raise ValueError(f"the KV cache budget ({budget} bytes) holds no block of "
                             f"{self.block_bytes} bytes; raise kv_cache_memory_bytes")
        return int(num)

    def _cuda_kv_budget(self) -> int:
        """gpu_memory_utilization of the device minus weights and the peak activation
        memory of a full-budget forward pass (measured)."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        n = min(self.config.max_num_batched_tokens, 8192)
        probe_blocks = -(-n // self.block_size)
        caches = self._allocate_kv_cache(probe_blocks)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        positions = torch.arange(n, device=self.device) % self.rotary_positions
        starts, num_new = np.array([0]), np.array([n])
        qsl, slot_positions = query_positions(starts, num_new)
        meta = self._metadata(starts, num_new, qsl, slot_positions,
                              np.arange(probe_blocks, dtype=np.int32)[None, :], 0)
        with torch.inference_mode():
            intermediate = None
            if not PipelineParallel.is_first():
                hidden_size = self.model.config.hidden_size
                intermediate = (torch.zeros(n, hidden_size, dtype=self.dtype, device=self.device),
                                torch.zeros(n, hidden_size, dtype=self.dtype, device=self.device))
            hidden = self.model(ids, positions, meta, caches, intermediate)
            if PipelineParallel.is_last():
                self.model.compute_logits(hidden[-min(n, self.config.max_num_seqs):])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del caches, hidden
        total = torch.cuda.get_device_properties(self.device).total_memory
        return int(total * self.config.gpu_memory_utilization) - peak

    def _allocate_kv_cache(self, num_blocks: int
                           ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Each layer's (k_cache, v_cache), or (latent_cache, None) with one part a layer.
        Left uninitialised: no backend reads a slot before it is written (padding reads
        are clamped to written positions or masked loads), and on CPU the pages of a
        large pool are only backed by memory as blocks come into use (kv_pages)."""
        cache = torch.empty((self.num_layers, self.kv_parts, num_blocks, *self.kv_shape),
                            dtype=self.kv_dtype, device=self.device)
        if self.kv_parts == 1:
            return [(cache[i, 0], None) for i in range(self.num_layers)]
        return [(cache[i, 0], cache[i, 1]) for i in range(self.num_layers)]

    # ---- plan bookkeeping ------------------------------------------------------------
    def update_states(self, plan: SchedulerOutput) -> np.ndarray:
        """Bring the input batch and the runner's requests up to the plan; returns the
        batch rows of the plan's requests, in num_scheduled_tokens' order. (The engine
        calls it alone for a plan that computes nothing, to tell the runner which requests
        ended or were preempted.)"""
        batch = self.input_batch
        for req_id in plan.finished_req_ids:
            self.requests.pop(req_id, None)
            self.scoring.discard(req_id)
            batch.remove(req_id)
        for req_id in plan.preempted_req_ids:
            batch.remove(req_id)
        for new in plan.new_requests:
            state = self.requests.get(new.req_id)
            if state is None:
                seed = new.params.seed
                gen = (torch.Generator(device=self.device).manual_seed(seed)
                       if seed is not None and self.samples else None)
                state = self.requests[new.req_id] = RunnerRequest(new.params, gen)
                if new.params.prompt_logprobs is not None:
                    self.scoring.add(new.req_id)
            batch.add(new.req_id, new.token_ids, new.num_prompt_tokens,
                      new.num_computed_tokens, new.block_ids, new.params,
                      needs_sampler=not state.plain_greedy, structured=state.structured)
        cached = plan.cached_requests
        rows = batch.rows(plan.num_scheduled_tokens)
        cached_rows = rows[:len(cached.req_ids)]  # the cached requests come first
        batch.num_computed_tokens[cached_rows] = cached.num_computed_tokens
        new_block_ids = cached.new_block_ids
        # the requests with new blocks (most decode steps have none)
        for i in compress(range(len(new_block_ids)), new_block_ids):
            batch.append_blocks(int(cached_rows[i]), new_block_ids[i])
        return rows

    def _slots(self, block_tables: np.ndarray, num_new: np.ndarray,
               positions: np.ndarray) -> np.ndarray:
        """The cache slot of every new token."""
        token_seq = (np.arange(len(num_new)) if len(positions) == len(num_new)
                     else np.repeat(np.arange(len(num_new)), num_new))
        bs = self.block_size
        return block_tables[token_seq, positions // bs].astype(np.int64) * bs + positions % bs

    def _metadata(self, starts: np.ndarray, num_new: np.ndarray, qsl: np.ndarray,
                  positions: np.ndarray, block_tables: np.ndarray,
                  num_decodes: int) -> AttentionMetadata:
        seq_lens = starts + num_new
        slots = self._slots(block_tables, num_new, positions)
        return AttentionMetadata(
            slot_mapping=self._to_device(slots),
            query_start_loc=self._to_device(qsl.astype(np.int32)),
            seq_lens=self._to_device(seq_lens.astype(np.int32)),
            block_tables=self._to_device(block_tables),
            max_query_len=int(num_new.max()), max_seq_len=int(seq_lens.max()),
            num_decode_seqs=num_decodes, block_size=self.block_size,
            max_decode_seq_len=int(seq_lens[:num_decodes].max()) if num_decodes else None,
            query_start_loc_cpu=qsl.tolist(), seq_lens_cpu=seq_lens.tolist(),
            block_tables_cpu=block_tables)

    # ---- the step --------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput,
                sampled: tuple[list[str], list[int]] = ((), ()),
                defer: bool = False) -> RunnerOutput | DeferredOutput:
        """Run the plan. `sampled`: on a rank that does not sample, the (request ids,
        tokens) rank 0 sampled in the step before, which are this step's inputs.
        defer (async scheduling, one process): leave the sampled tokens on the device and
        return a DeferredOutput, whose result() brings them; the next step may run before
        it, its inputs taking those tokens on the device."""
        if self.plan_sink is not None:  # (a node's first rank passes on what node 0 sent)
            self.plan_sink(plan, self.unsent_tokens if self.samples else sampled)
            self.unsent_tokens = ([], [])
        self._append_sampled(*sampled)
        rows = self.update_states(plan)
        sched = plan.num_scheduled_tokens
        step = self.input_batch.prepare(
            rows, np.fromiter(sched.values(), dtype=np.int64, count=len(sched)))
        starts, num_new, qsl, positions = (step.starts, step.num_new, step.query_start_loc,
                                           step.positions)
        block_tables = step.block_tables
        if self.kv_pages is not None:
            self.kv_pages.cover(int(block_tables.max()))
        # the structured outputs' masks, computed on a thread while the model runs
        masks = self._masks_ahead(step) if self.samples else None
        fill = self._placeholder_inputs(step)
        graphs = self.graphs
        if graphs is not None and step.num_decodes == len(num_new) <= graphs.max_size:
            hidden = graphs.run(step.input_ids, positions,
                                self._slots(block_tables, num_new, positions), starts + 1,
                                block_tables, fill)
            self.num_graph_steps += 1
        elif PipelineParallel.size > 1:
            hidden = self._stage_forward(step.input_ids, starts, num_new, qsl, positions,
                                         block_tables, step.num_decodes)
            if hidden is None:  # not the last stage: it samples, and says what
                out = pipeline.share_output(None)
                self._append_sampled(out.req_ids, out.token_ids)
                return out
        else:
            meta = self._metadata(starts, num_new, qsl, positions, block_tables,
                                  step.num_decodes)
            ids_t = self._to_device(step.input_ids)
            if fill is not None:
                ids_t[fill[0]] = fill[1]
            pos_t = self._to_device(positions)
            hidden = self.model(ids_t, pos_t, meta, self.kv_caches)
        out = self._sample(hidden, step, masks, defer)
        if defer:
            return out if isinstance(out, DeferredOutput) else DeferredOutput.ready(out)
        if PipelineParallel.size > 1:
            shared = pipeline.share_output(out if self.samples else None)
            if not self.samples:  # another rank of the last stage
                self._append_sampled(shared.req_ids, shared.token_ids)
                out = shared
        return out

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """A host array on the runner's device. On a GPU it is copied from pinned memory
        without waiting: a plain copy would first wait for every step queued before it,
        which async scheduling has not waited for."""
        tensor = torch.from_numpy(array)
        if self.device.type == "cpu":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def _placeholder_inputs(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(token indices, their ids on the device) of the step's inputs that are tokens the
        deferred step before sampled (PLACEHOLDER in the rows); None where there are none.
        Only a decode reads such a token: its sequence's one token."""
        if self._last_tokens is None:
            return None
        missing = np.flatnonzero(step.input_ids == PLACEHOLDER)
        if len(missing) == 0:
            return None
        if missing[-1] >= step.num_decodes:
            raise RuntimeError("a step's input is a token still being sampled, outside a decode")
        index = self._sampled_index[step.rows[missing]]
        return (self._to_device(missing),
                self._last_tokens[self._to_device(index)])

    def _append_sampled(self, req_ids: list[str], tokens: list[int]) -> None:
        """The tokens another rank sampled, appended to this rank's rows of the requests."""
        if req_ids:
            self.input_batch.append_tokens(self.input_batch.rows(req_ids),
                                           np.asarray(tokens, dtype=np.int32))

    def _stage_forward(self, input_ids: list[int], starts: np.ndarray, num_new: np.ndarray,
                       qsl: np.ndarray, positions: np.ndarray, block_tables: np.ndarray,
                       num_decodes: int) -> torch.Tensor | None:
        """This pipeline stage's part of the step, micro-batch by micro-batch (pipeline.py):
        the final hidden states on the last stage, None on the others (theirs were sent
        on)."""
        finals, pending = [], []
        for a, b in pipeline.micro_batches(num_new, PipelineParallel.size):
            t0, t1 = int(qsl[a]), int(qsl[b])
            seq_lens = starts[a:b] + num_new[a:b]
            tables = block_tables[a:b, :-(-int(seq_lens.max()) // self.block_size)]
            meta = self._metadata(starts[a:b], num_new[a:b], qsl[a:b + 1] - qsl[a],
                                  positions[t0:t1], tables, max(0, min(b, num_decodes) - a))
            ids_t = torch.tensor(input_ids[t0:t1], dtype=torch.long, device=self.device)
            pos_t = self._to_device(positions[t0:t1])
            intermediate = None
            if not PipelineParallel.is_first():
                intermediate = pipeline.receive(t1 - t0, self.model.config.hidden_size,
                                                self.dtype, self.device)
            result = self.model(ids_t, pos_t, meta, self.kv_caches, intermediate)
            if PipelineParallel.is_last():
                finals.append(result)
            else:
                pending += pipeline.send(*result)
        pipeline.wait(pending)
        return torch.cat(finals) if finals else None

    def _masks_ahead(self, step: StepInputs) -> Future | None:
        """The bitmask of the sequences that sample this step (structure_masks), started on
        a thread so it is computed while the model runs (llguidance lets go of the GIL);
        None where no such sequence has a structured output."""
        batch = self.input_batch
        if not batch.num_structured:
            return None
        rows = step.rows[step.sampling]
        if not batch.structured[rows].any():
            return None
        rows = rows.tolist()
        states = [self.requests[batch.req_ids[r]] for r in rows]
        outputs = [batch.output_tokens(r) for r in rows]
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="structured-masks")
        return self._mask_thread.submit(self.structure_masks, states, outputs)

    def structure_masks(self, states: list[RunnerRequest],
                        outputs: list[list[int]]) -> torch.Tensor | None:
        """[N, ceil(V / 32)] int32: what each row's structured output allows after its
        output tokens so far (`outputs`), packed (-1 where a row has none, or none yet),
        the grammar rows' computed together (MaskExecutor); None where no row is
        constrained."""
        mask = self._mask_rows(len(states))
        constrained = False
        pending = []  # (grammar matcher, row) whose masks llguidance computes together
        for i, (s, output) in enumerate(zip(states, outputs)):
            filled = False if s.structure is None else s.structure.deferred(
                output, self.eos_token_ids, mask[i])
            if filled is False:
                mask[i] = -1
                continue
            constrained = True
            if filled is not True:
                pending.append((filled, i))
        if pending:
            self._mask_executor.fill_masks(pending, mask, self.eos_token_ids)
        return torch.from_numpy(mask) if constrained else None

    def _mask_rows(self, n: int) -> np.ndarray:
        """n rows of a bitmask buffer kept between steps (grown as needed)."""
        words = -(-self.model.config.vocab_size // 32)
        if self._mask_buffer is None or self._mask_buffer.shape[0] < n:
            self._mask_buffer = np.empty((max(n, 8), words), dtype=np.int32)
        return self._mask_buffer[:n]

    def _sample(self, hidden: torch.Tensor, step: StepInputs, masks: Future | None = None,
                defer: bool = False) -> RunnerOutput | DeferredOutput:
        """The step's sampled tokens (and prompt logprobs) from its final hidden states;
        the tokens are appended to their rows (defer: PLACEHOLDERs are, and the
        DeferredOutput's result() writes the tokens over them)."""
        prompt_logprobs = None
        if self.scoring:  # a one-token prompt chunk is among the decodes: all are looked at
            prompt_logprobs = self._prompt_logprobs(hidden, step) or None
        sample_idx = step.sampling
        if len(sample_idx) == 0:
            return RunnerOutput([], [], prompt_logprobs=prompt_logprobs)
        if len(sample_idx) < hidden.shape[0]:
            hidden = hidden[self._to_device(step.query_start_loc[sample_idx + 1] - 1)]
        if not self.samples:  # this rank's part of the vocabulary, for rank 0 to sample from
            self.model.compute_logits(hidden, float32=False)
            return RunnerOutput([], [], prompt_logprobs=prompt_logprobs)
        batch = self.input_batch
        rows = step.rows[sample_idx]
        sample_ids = list(map(batch.req_ids.__getitem__, rows.tolist()))
        if batch.num_needing_sampler and batch.needs_sampler[rows].any():
            sampling = self._sampling_batch([self.requests[r] for r in sample_ids], rows)
        else:
            sampling = SamplingBatch(all_greedy=True)
        if masks is not None:
            sampling.bitmask = masks.result()
        # an argmax, or the CPU sampling kernel, needs no float32 copy of the logits
        logits = self.model.compute_logits(
            hidden, float32=not self.sampler.takes_model_dtype(sampling, hidden.device))
        sampled = self.sampler(logits, sampling)
        if defer:
            columns = batch.num_tokens[rows]
            batch.append_tokens(rows, np.full(len(rows), PLACEHOLDER, dtype=np.int32))
            self._sampled_index[rows] = np.arange(len(rows))
            self._last_tokens = sampled.token_ids
            return DeferredOutput(self, sample_ids, rows, columns, batch.row_epoch[rows],
                                  sampled, prompt_logprobs, masks)
        token_array = sampled.token_ids.cpu().numpy()
        batch.append_tokens(rows, token_array)
        return self._output(sample_ids, token_array, sampled, prompt_logprobs, masks)

    def _output(self, sample_ids: list[str], token_array: np.ndarray, sampled,
                prompt_logprobs: dict | None, masks: Future | None = None) -> RunnerOutput:
        tokens = token_array.tolist()
        if self.plan_sink is not None and PipelineParallel.size == 1:  # (else: shared)
            self.unsent_tokens = (sample_ids, tokens)
        out = RunnerOutput(sample_ids, tokens, prompt_logprobs=prompt_logprobs)
        if masks is not None:  # only a structured output can fail
            structures = ((req_id, self.requests[req_id].structure) for req_id in sample_ids)
            out.errors = {req_id: structure.error for req_id, structure in structures
                          if structure is not None and structure.error} or None
        if sampled.logprob_values is not None:
            ids, values, ranks = (sampled.logprob_ids.tolist(), sampled.logprob_values.tolist(),
                                  sampled.sampled_ranks.tolist())
            out.logprobs = list(zip(ids, values, ranks))
        return out

    # rows of prompt logits computed at once: bounds the float32 [rows, vocab] buffers
    PROMPT_LOGPROB_ROWS = 256

    def _prompt_logprobs(self, hidden: torch.Tensor,
                         step: StepInputs) -> dict[str, tuple[int, list]]:
        """For each request asking prompt_logprobs with prompt tokens in this step: the
        first prompt position it scores, and per position (top ids, top values + the
        prompt token's logprob, that token's rank). Position p's hidden state scores
        token p + 1."""
        batch = self.input_batch
        scoring_rows = [batch.row_of[r] for r in self.scoring if r in batch.row_of]
        out = {}
        for i in np.flatnonzero(np.isin(step.rows, scoring_rows)).tolist():
            row = int(step.rows[i])
            req_id = batch.req_ids[row]
            k = self.requests[req_id].params.prompt_logprobs
            start = int(step.starts[i])
            end = min(start + int(step.num_new[i]), int(batch.num_prompt_tokens[row]) - 1)
            if end <= start:
                continue
            rows = []
            for a in range(start, end, self.PROMPT_LOGPROB_ROWS):
                b = min(a + self.PROMPT_LOGPROB_ROWS, end)
                first_row = int(step.query_start_loc[i]) + a - start
                logits = self.model.compute_logits(hidden[first_row:first_row + b - a])
                if not self.samples:  # the all-gather alone: rank 0 scores
                    continue
                targets = self._to_device(batch.token_ids[row, a + 1:b + 1].astype(np.int64))
                top_ids, values, ranks = logprobs(logits, k, targets)
                rows += list(zip(top_ids.tolist(), values.tolist(), ranks.tolist()))
            out[req_id] = (start + 1, rows)
        return out

    def _constraints(self, states: list[RunnerRequest]):
        """(rows, token ids that may be sampled there, the restricted rows) and (rows, token
        ids, values) of logit biases; None where no row has one. A request's fixed lists
        become tensors once (RunnerRequest.constraint_tensors)."""
        allowed_rows, allowed_ids, bias_rows, bias_ids, bias_values = [], [], [], [], []
        restricted = []
        for i, s in enumerate(states):
            allowed, bias = s.constraint_tensors(self.device)
            if allowed is not None:
                allowed_rows.append(torch.full_like(allowed, i))
                allowed_ids.append(allowed)
                restricted.append(i)
            if bias is not None:
                bias_rows.append(torch.full_like(bias[0], i))
                bias_ids.append(bias[0])
                bias_values.append(bias[1])
        allowed_t = ((torch.cat(allowed_rows), torch.cat(allowed_ids),
                      self._to_device(np.asarray(restricted, dtype=np.int64)))
                     if allowed_rows else None)
        bias_t = ((torch.cat(bias_rows), torch.cat(bias_ids), torch.cat(bias_values))
                  if bias_rows else None)
        return allowed_t, bias_t

    def _sampling_batch(self, states: list[RunnerRequest], rows: np.ndarray) -> SamplingBatch:
        """The sampler's settings for the requests `states` in batch rows `rows`."""
        if all(s.plain_greedy for s in states):
            return SamplingBatch(all_greedy=True)
        rows_in = self.input_batch
        params = [s.params for s in states]
        need_logprobs = [p.logprobs for p in params if p.logprobs is not None]
        blocked_rows, blocked_ids = [], []
        num_output = (rows_in.num_tokens[rows] - rows_in.num_prompt_tokens[rows]).tolist()
        for i, (p, n) in enumerate(zip(params, num_output)):
            if p.min_tokens and n < p.min_tokens:
                stops = set(p.stop_token_ids or ()) | (set() if p.ignore_eos else self.eos_token_ids)
                blocked_rows += [i] * len(stops)
                blocked_ids += list(stops)
        penalties = any(p.uses_penalties for p in params)
        all_greedy = all(p.greedy for p in params)
        batch = SamplingBatch(
            all_greedy=all_greedy,
            max_num_logprobs=max(need_logprobs) if need_logprobs else None,
            blocked=(self._to_device(np.asarray(blocked_rows, dtype=np.int64)),
                     self._to_device(np.asarray(blocked_ids, dtype=np.int64)))
            if blocked_rows else None)
        if any(p.constrained for p in params):
            batch.allowed, batch.bias = self._constraints(states)
        dev = self.device
        if penalties:
            batch.repetition_penalty = torch.tensor([p.repetition_penalty for p in params], device=dev)
            batch.presence_penalty = torch.tensor([p.presence_penalty for p in params], device=dev)
            batch.frequency_penalty = torch.tensor([p.frequency_penalty for p in params], device=dev)
            row_list = rows.tolist()
            batch.prompt_token_ids = [rows_in.tokens(r, 0, int(rows_in.num_prompt_tokens[r]))
                                      for r in row_list]
            batch.output_token_ids = [rows_in.output_tokens(r) for r in row_list]
        if not all_greedy:
            batch.temperature = self._to_device(rows_in.temperature[rows])
            top_k, top_p, min_p = (rows_in.top_k[rows], rows_in.top_p[rows],
                                   rows_in.min_p[rows])
            if (top_k > 0).any():
                batch.top_k = self._to_device(top_k)
            if (top_p < 1.0).any():
                batch.top_p = self._to_device(top_p)
            if (min_p > 0).any():
                batch.min_p = self._to_device(min_p)
            gens = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
            batch.generators = gens or None
        return batch


class DeferredOutput:
    """A step's output whose sampled tokens are still on the device (async scheduling).
    result() waits for them, writes them over the PLACEHOLDERs of the rows still held by
    the requests that sampled them, and returns the RunnerOutput."""

    def __init__(self, runner: ModelRunner, sample_ids: list[str], rows: np.ndarray,
                 columns: np.ndarray, epochs: np.ndarray, sampled, prompt_logprobs,
                 masks: Future | None):
        self._runner = runner
        self._masks = masks  # the structured outputs' (their errors are read with the tokens)
        self._sample_ids = sample_ids
        self._rows, self._columns, self._epochs = rows, columns, epochs
        self._sampled = sampled
        self._prompt_logprobs = prompt_logprobs
        self._out: RunnerOutput | None = None
        self._host: torch.Tensor | None = None
        if sampled.token_ids.device.type == "cuda":  # the copy queued behind the step
            self._host = torch.empty(sampled.token_ids.shape, dtype=sampled.token_ids.dtype,
                                     pin_memory=True)
            self._host.copy_(sampled.token_ids, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    @classmethod
    def ready(cls, out: RunnerOutput) -> DeferredOutput:
        """A step that sampled nothing: its output is known already."""
        deferred = cls.__new__(cls)
        deferred._out = out
        return deferred

    def result(self) -> RunnerOutput:
        if self._out is not None:
            return self._out
        if self._host is not None:
            self._copied.synchronize()
            token_array = self._host.numpy()
        else:
            token_array = self._sampled.token_ids.numpy()
        batch = self._runner.input_batch
        held = batch.row_epoch[self._rows] == self._epochs
        batch.token_ids[self._rows[held], self._columns[held]] = token_array[held]
        self._out = self._runner._output(self._sample_ids, token_array, self._sampled,
                                         self._prompt_logprobs, self._masks)
        self._runner = self._sampled = self._masks = None
        return self._out
