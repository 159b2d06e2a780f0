"""Turns the logits of the rows that sample into tokens, batched on tensors.

Order, as in vLLM: raw logprobs (if asked) -> logit bias and allowed tokens (structured
outputs) -> min_tokens suppression -> penalties ->
greedy rows take argmax -> temperature -> min_p / top_k / top_p -> sample. Sampling draws
exponential noise per row (argmax(p / q) is a sample from p); a seeded request draws its
noise from its own generator, so its output does not depend on what shares the batch.
On CPU a C kernel does temperature, the filters and the draw in a few passes per row with
no sort (kernels/cpu/sample.py), from one seed per row drawn the same way, and another the
logprobs without writing the whole log-softmax (kernels/cpu/logprobs.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from batchinfer.kernels import cpu

_SEED_BOUND = 2 ** 62  # per-row seeds for the CPU kernel are drawn below this


@dataclass
class SamplingBatch:
    """Per-row sampling settings for one step; optional parts are None when unused."""
    all_greedy: bool
    temperature: torch.Tensor | None = None        # [N] float, 0 for greedy rows
    top_k: torch.Tensor | None = None              # [N] long, 0 = off
    top_p: torch.Tensor | None = None              # [N] float, 1 = off
    min_p: torch.Tensor | None = None              # [N] float, 0 = off
    generators: dict[int, torch.Generator] | None = None  # row -> its own generator
    # penalties: [N] tensors and per-row token histories
    repetition_penalty: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    prompt_token_ids: list[list[int]] | None = None
    output_token_ids: list[list[int]] | None = None
    # (rows, token ids) whose logits are -inf this step (min_tokens not yet reached)
    blocked: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids), int64
    # (rows, token ids): in these rows only the listed tokens may be sampled
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None
    # (rows, token ids, values) added to the logits (logit_bias)
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # [N, ceil(V / 32)] int32, bit t % 32 of word t // 32 set where token t may be sampled
    # (structured outputs; -1: a row with no constraint)
    bitmask: torch.Tensor | None = None
    max_num_logprobs: int | None = None

    @property
    def argmax_only(self) -> bool:
        """Every row greedy with nothing else to apply: the logits may stay in the model's
        dtype."""
        return self.all_greedy and self.draws_only

    @property
    def draws_only(self) -> bool:
        """Nothing to apply but temperature and the filters (no logprobs, blocked tokens,
        penalties, constraints or biases)."""
        return self.max_num_logprobs is None and self.draws_only_but_logprobs

    @property
    def draws_only_but_logprobs(self) -> bool:
        """draws_only, logprobs aside: nothing changes the logits before the draw."""
        return (self.blocked is None and self.repetition_penalty is None
                and self.allowed is None and self.bias is None and self.bitmask is None)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor                 # [N] long
    logprob_ids: torch.Tensor | None = None     # [N, k] top-k token ids
    logprob_values: torch.Tensor | None = None  # [N, k + 1]: top-k then the sampled token's
    sampled_ranks: torch.Tensor | None = None   # [N] rank of the sampled token (1 = best)


class Sampler:
    def __init__(self, generator: torch.Generator | None = None):
        self.generator = generator

    @staticmethod
    def takes_model_dtype(batch: SamplingBatch, device: torch.device) -> bool:
        """Whether this batch's logits may stay in the model's dtype (no float32 copy): an
        argmax, or draws and logprobs with nothing else to apply on a CPU with the sampling
        and logprobs kernels, which widen bfloat16 exactly themselves."""
        if batch.argmax_only:
            return True
        if device.type != "cpu" or not batch.draws_only_but_logprobs:
            return False
        k = batch.max_num_logprobs
        return ((batch.all_greedy or cpu.sample.available())
                and (k is None or (cpu.logprobs.available() and k <= cpu.logprobs.max_k())))

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        raw = logits  # logprobs are of the logits as the model gave them (never modified here)
        if batch.allowed is not None or batch.bias is not None or batch.bitmask is not None:
            logits = _constrain(logits, batch.allowed, batch.bias, batch.bitmask)
        if batch.blocked is not None:
            logits = logits.clone()
            logits[batch.blocked[0], batch.blocked[1]] = float("-inf")
        if batch.repetition_penalty is not None:
            logits = self._apply_penalties(logits, batch)
        if batch.all_greedy:
            tokens = greedy_argmax(logits)
        else:
            tokens = self._sample(logits, batch)
        out = SamplerOutput(tokens)
        if batch.max_num_logprobs is not None:
            out.logprob_ids, out.logprob_values, out.sampled_ranks = logprobs(
                raw, batch.max_num_logprobs, tokens)
        return out

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        temperature = batch.temperature
        greedy_rows = temperature < 1e-5
        greedy_tokens = greedy_argmax(logits)
        if cpu.sample.supports(logits):
            try:
                tokens = cpu.sample.sample(logits, *self._kernel_params(logits.shape[0], batch))
                return torch.where(greedy_rows | (tokens < 0), greedy_tokens, tokens)
            except MemoryError:  # no scratch for a row's weights: torch's way below
                pass
        logits = logits.float() / torch.where(greedy_rows, 1.0, temperature)[:, None]
        if batch.min_p is not None:
            probs = logits.softmax(dim=-1)
            threshold = probs.amax(dim=-1, keepdim=True) * batch.min_p[:, None]
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        if batch.top_k is not None or batch.top_p is not None:
            logits = _top_k_top_p(logits, batch.top_k, batch.top_p)
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs)
        noise.exponential_(generator=self.generator)
        for row, gen in (batch.generators or {}).items():
            noise[row].exponential_(generator=gen)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy_rows, greedy_tokens, sampled)

    def _kernel_params(self, rows: int, batch: SamplingBatch) -> tuple[torch.Tensor, ...]:
        """cpu.sample's per-row temperature (0 for greedy rows: the kernel leaves them to
        argmax), top_k, top_p, min_p, and a seed from the row's generator (the engine's
        unless seeded)."""
        def per_row(value: torch.Tensor | None, off: float, dtype: torch.dtype) -> torch.Tensor:
            if value is None:
                return torch.full((rows,), off, dtype=dtype)
            return value.to(dtype).contiguous()

        temperature = batch.temperature.float()
        temperature = torch.where(temperature < 1e-5, 0.0, temperature).contiguous()
        seeds = torch.randint(_SEED_BOUND, (rows,), generator=self.generator)
        for row, gen in (batch.generators or {}).items():
            seeds[row] = torch.randint(_SEED_BOUND, (1,), generator=gen)
        return (temperature, per_row(batch.top_k, 0, torch.int64),
                per_row(batch.top_p, 1.0, torch.float32),
                per_row(batch.min_p, 0.0, torch.float32), seeds)

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        n, vocab = logits.shape
        device = logits.device

        def counts(histories: list[list[int]]) -> torch.Tensor:
            lengths = [len(h) for h in histories]
            flat = torch.tensor([t for h in histories for t in h], dtype=torch.long, device=device)
            rows = torch.repeat_interleave(torch.arange(n, device=device),
                                           torch.tensor(lengths, device=device))
            c = torch.zeros(n, vocab, dtype=logits.dtype, device=device)
            c.index_put_((rows, flat), torch.ones_like(flat, dtype=logits.dtype), accumulate=True)
            return c

        output_counts = counts(batch.output_token_ids)
        seen = (counts(batch.prompt_token_ids) > 0) | (output_counts > 0)
        rep = batch.repetition_penalty[:, None].expand_as(logits)
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
        logits = logits - batch.frequency_penalty[:, None] * output_counts
        logits = logits - batch.presence_penalty[:, None] * (output_counts > 0).to(logits.dtype)
        return logits


def logprobs(logits: torch.Tensor, k: int, tokens: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(top-k ids [N, k], values [N, k + 1]: the top k of each row's log-softmax and then
    tokens' own, ranks of tokens [N], 1 = largest) of logits [N, V]. On CPU the C kernel's
    where it applies; a row it leaves (no finite maximum) and every other case in torch,
    on float32."""
    if not cpu.logprobs.supports(logits, k):
        return _torch_logprobs(logits, k, tokens)
    ids, values, ranks, bad = cpu.logprobs.logprobs(logits, k, tokens.to(torch.int64).contiguous())
    if bad.any():
        rows = bad.nonzero().squeeze(1)
        ids[rows], values[rows], ranks[rows] = _torch_logprobs(logits[rows], k, tokens[rows])
    return ids, values, ranks


def _torch_logprobs(logits: torch.Tensor, k: int, tokens: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    raw = torch.log_softmax(logits.float(), dim=-1)
    top_values, top_ids = raw.topk(k, dim=-1) if k else (raw[:, :0], tokens[:, None][:, :0])
    chosen = raw.gather(1, tokens[:, None])
    return top_ids, torch.cat([top_values, chosen], dim=1), (raw > chosen).sum(dim=1) + 1


def _constrain(logits: torch.Tensor, allowed, bias, bitmask=None) -> torch.Tensor:
    """A copy of logits with the logit biases added and, in restricted rows, every token
    but the allowed ones at -inf; where the packed bitmask clears a token's bit, -inf."""
    logits = logits.clone()
    if bitmask is not None:
        logits.masked_fill_(~unpack_bitmask(bitmask.to(logits.device, non_blocking=True),
                                            logits.shape[1]), float("-inf"))
    if bias is not None:
        rows, ids, values = bias
        logits.index_put_((rows, ids), values.to(logits.dtype), accumulate=True)
    if allowed is not None:
        rows, ids, restricted = allowed  # restricted: each restricted row once
        keep = logits[rows, ids]
        logits[restricted] = float("-inf")
        logits[rows, ids] = keep
    return logits


_BITS = {}


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, W] int32 words -> [N, vocab] bool, token t's bit being bit t % 32 of word t // 32
    (llguidance's and xgrammar's layout), in one tensor op on the words' device."""
    bits = _BITS.get(bitmask.device)
    if bits is None:
        bits = _BITS[bitmask.device] = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    unpacked = ((bitmask.unsqueeze(-1) >> bits) & 1).view(bitmask.shape[0], -1)
    return unpacked[:, :vocab].bool()


_ARGMAX_CHUNK = 128


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax (first index of the maximum, as torch.argmax) of [N, V] logits.

    On CPU the C ops (kernels/cpu/ops.c) do it in one pass where they can be built.
    Otherwise: torch's reduction that also tracks indices is several times slower than one
    that only finds the value, so this takes the maximum of each 128-wide chunk (value
    only), picks each row's first chunk holding the row maximum, and searches only that
    chunk. (max(dim).indices, like argmax, gives the first maximum and is faster on CPU.)
    """
    n, vocab = logits.shape
    if logits.device.type != "cpu":
        return logits.argmax(dim=-1)
    if cpu.ops.supports_argmax(logits):  # one C pass (bfloat16 logits need no float32 copy)
        return cpu.ops.argmax(logits)
    if logits.dtype != torch.float32:  # torch's reductions in 16-bit types are slow on CPU
        logits = logits.float()
    if vocab < 8 * _ARGMAX_CHUNK or not logits.is_contiguous():
        return logits.argmax(dim=-1)
    c = _ARGMAX_CHUNK
    full = vocab // c
    chunks = logits.as_strided((n, full, c), (vocab, c, 1))
    chunk_max = chunks.amax(dim=-1)
    rows = torch.arange(n, device=logits.device)
    if full * c == vocab:
        best_chunk = chunk_max.max(dim=-1).indices
        values = chunks[rows, best_chunk]
    else:
        chunk_max = torch.cat([chunk_max, logits[:, full * c:].amax(dim=-1, keepdim=True)], dim=1)
        best_chunk = chunk_max.max(dim=-1).indices
        # the short last chunk reads its final column again past the end; those repeats
        # come after the real column, so the first maximum is still a real index
        cols = best_chunk[:, None] * c + torch.arange(c, device=logits.device)
        values = logits.gather(1, cols.clamp_(max=vocab - 1))
    return best_chunk * c + values.max(dim=-1).indices


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                 top_p: torch.Tensor | None) -> torch.Tensor:
    """Keep each row's top_k largest logits (and any tied with the k-th) and the smallest
    set whose probability reaches top_p, ties taken in index order (always at least one
    token)."""
    # stable: ties in index order, the order top_p cuts them in (as the CPU kernel does)
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:  # every logit at least the k-th largest (ties kept)
        k = torch.where(top_k > 0, top_k, logits.shape[-1]).clamp(max=logits.shape[-1])
        kth = sorted_logits.gather(1, (k - 1)[:, None])
        remove |= sorted_logits < kth
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # probability mass strictly before each token
        remove |= before >= top_p[:, None]
    remove[:, 0] = False
    return logits.scatter(1, order, sorted_logits.masked_fill(remove, float("-inf")))
