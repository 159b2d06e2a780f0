"""Paged attention in plain PyTorch: the CPU path and the reference for the kernels.

Once per step (not per layer) it turns block tables into gather indices and masks; per
layer it writes the new K/V into the cache, gathers each sequence's context and runs SDPA.
Decodes on CPU go to a C kernel that reads the blocks in place (kernels/cpu/decode.py)
where it can be built, and so do prefill chunks of sequences no longer than the sliding
window, if any (kernels/cpu/prefill.py), all of a step's chunks in one call (but for long
bfloat16 ones on CPUs with AMX, which torch's flash kernel runs faster). Otherwise decodes
are batched in a few groups of similar length (the runner sorts them) with the query heads
of each KV head folded into the query axis, so GQA needs no K/V expansion, and prefill
chunks run one flash call each (under a window, one per run of `window` queries).

Cascade: when sequences share leading blocks (a common system prompt) that lie wholly
before all of their queries, those blocks are attended once for the whole batch — one
dense product of every query row against the shared K/V (on CPU a C kernel where it
applies: kernels/cpu/shared_prefix.py) — and only each sequence's own tail is gathered. The
two partial results are merged by their log-sum-exp (the C decode kernels take the shared
result as their starting point and merge as they go). That removes the shared part from
every per-sequence copy, which on CPU is most of the cost.

Soft-capped scores (Gemma 2: cap * tanh(scores / cap), before the mask) are not in the C
kernels nor in torch's flash kernel: such layers run every part in plain tensor ops
(_math_attention_with_lse), still planned, gathered and merged as above.

Attention sinks (gpt-oss: a logit per query head added to the softmax's denominator) take
the same plain-ops path, without the cascade: each query row's keys are then attended in
one call, whose result over the keys is scaled by sigmoid(lse - sink), the share of the
denominator that the keys hold.

An FP8 cache (kernels/fp8.py) is written as E4M3 codes of k / k_scale and v / v_scale; the
C kernels read it as it is, and what torch reads is gathered as codes (uint8: index ops on
float8 are not implemented everywhere) and widened times the scale to the query's dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchinfer.kernels import cpu, fp8

from .metadata import AttentionMetadata


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
             v_scale: float = 1.0) -> None:
    """Store new K/V ([num_tokens, num_kv_heads, head_dim]) at their cache slots; in an FP8
    cache as E4M3 codes of key / k_scale and value / v_scale."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    for x, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        if fp8.is_fp8(cache):
            cache, x = cache.view(torch.uint8), fp8.quantize(x, scale).view(torch.uint8)
        cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, x.to(cache.dtype))


def _slots(block_tables: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """Cache slot of each position; block_tables [B, max_blocks], positions [B, S] -> [B, S]."""
    blocks = np.take_along_axis(block_tables, positions // block_size, axis=1)
    return blocks.astype(np.int64) * block_size + positions % block_size


# torch's CPU flash kernel takes fewer KV heads than query heads from 2.5 on
_CPU_FLASH_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def _attention_with_lse(q, k, v, mask, scale, causal=False, softcap=None, sink=None):
    """(out, logsumexp) of attention; q [B, H, L, D], k/v [B, Hkv, S, D] with H a multiple
    of Hkv (query head h reads KV head h // (H / Hkv)), mask additive or None; causal (with
    L == S and no mask): query i sees keys [0, i]; softcap: scores capped by it (tanh);
    sink: a logit added to each softmax's denominator, broadcast to [B, H, L] (the
    logsumexp returned is the keys' alone)."""
    if q.device.type == "cpu" and softcap is None and sink is None \
            and (k.shape[1] == q.shape[1] or _CPU_FLASH_GQA):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=mask, scale=scale)[:2]
        return out, lse
    if causal:
        mask = torch.full((q.shape[2], k.shape[2]), float("-inf"), device=q.device).triu(1)
    return _math_attention_with_lse(q, k, v, mask, scale, softcap, sink)


def _math_attention_with_lse(q, k, v, mask, scale, softcap=None, sink=None):
    """_attention_with_lse in plain tensor ops, for devices without the CPU flash kernel,
    for soft-capped scores and for sinks."""
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores + mask
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse[..., None]), v.float())
    if sink is not None:  # e^lse / (e^lse + e^sink): the keys' share of the denominator
        out = out * torch.sigmoid(lse - sink.float())[..., None]
    return out.to(q.dtype), lse


def _length_groups(n: int, max_groups: int, min_size: int = 16) -> list[tuple[int, int]]:
    """Split [0, n) into up to max_groups contiguous ranges of equal count."""
    if n == 0:
        return []
    g = max(1, min(max_groups, n // min_size))
    bounds = [round(i * n / g) for i in range(g + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(g)]


@dataclass
class _StepPlan:
    """Gather indices and masks for one step (and one window / dtype)."""
    shared_slots: torch.Tensor | None     # [P] slots every cascade member sees in full
    token_not_member: torch.Tensor | None  # [num_tokens] bool: token's sequence skips it
    decode_groups: list[tuple[int, int, torch.Tensor, int, torch.Tensor]]  # a, b, slots, S, mask
    decode_bounds: tuple[torch.Tensor, torch.Tensor] | None  # kernel path: int32 lo, hi per decode
    # prefill chunks (or, under a sliding window, runs of a chunk's queries) in gather
    # groups: (the group's keys, one chunk after another; its chunks as start, end
    # (tokens), k0, k1 (keys in the group), [tokens, keys] additive mask or None, seen):
    # without a mask, every token sees the first `seen` keys (earlier context) and the rest
    # (its own tokens) causally; with one, seen is 0
    prefill_groups: list[tuple[torch.Tensor,
                               list[tuple[int, int, int, int, torch.Tensor | None, int]]]]
    # kernel path: [chunks, 5] int32 (sequence, start, end, first key, seq len) per chunk
    prefill_chunks: torch.Tensor | None = None


class TorchAttention:
    name = "torch"
    # Below this many shared tokens the extra call costs more than the copying it saves.
    min_cascade_tokens = 64
    # Decodes are padded to the longest context of their group.
    max_decode_groups = 4
    # Prefill chunks' keys are gathered together up to this many rows (a chunk with more
    # is gathered alone), which bounds the scratch buffers with long chunked contexts.
    max_gather_rows = 16384

    def __init__(self, use_cpu_kernel: bool = True) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._use_cpu_kernel = use_cpu_kernel

    def _uses(self, kernel, query: torch.Tensor, num_kv_heads: int,
              cache_dtype: torch.dtype) -> bool:
        """Whether a C kernel (cpu.decode, cpu.prefill or cpu.shared_prefix; built on first
        use) runs: allowed here, and it applies to this device, these dtypes and head
        shape."""
        return self._use_cpu_kernel and kernel.supports(query, num_kv_heads, cache_dtype)

    def _scratch(self, name: str, rows: int, like: torch.Tensor) -> torch.Tensor:
        """A reused [rows, Hkv, D] buffer for gathered K or V: gathering into memory that
        is already mapped is markedly faster on CPU than into a fresh allocation."""
        buf = self._buffers.get(name)
        row_shape = like.shape[1:]
        numel = rows * like.shape[1] * like.shape[2]
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            buf = torch.empty(max(numel, 2 * (buf.numel() if buf is not None else 0)),
                              dtype=like.dtype, device=like.device)
            self._buffers[name] = buf
        return buf[:numel].view(rows, *row_shape)

    def _cascade(self, meta: AttentionMetadata, window: int | None) -> tuple[int, np.ndarray | None]:
        """How many leading blocks to attend once for the batch, and which sequences skip
        them. A sequence shares a block when it holds the same block id at that index as
        the reference sequence (one holding the most common first block) and the block
        lies wholly before the sequence's first query token. The count is chosen to
        maximise the tokens saved (shared length x sequences sharing it)."""
        bs, n = meta.block_size, meta.num_seqs
        lens = np.asarray(meta.seq_lens_cpu)
        if n < 2 or (window is not None and lens.max() > window):
            return 0, None
        first_query = lens - np.diff(np.asarray(meta.query_start_loc_cpu))
        limit = int(first_query.max()) // bs
        if limit * bs < self.min_cascade_tokens:
            return 0, None
        tables = meta.host_block_tables()[:, :limit]
        ids, counts = np.unique(tables[:, 0], return_counts=True)
        ref = int(np.flatnonzero(tables[:, 0] == ids[counts.argmax()])[0])
        same = np.cumprod(tables == tables[ref], axis=1).sum(axis=1)
        matched = np.minimum(same, first_query // bs)
        best, best_saving = 0, 0
        for k in np.unique(matched).tolist():
            sharing = int((matched >= k).sum())
            if k * bs >= self.min_cascade_tokens and sharing >= 2 and k * sharing > best_saving:
                best, best_saving = k, k * sharing
        if not best:
            return 0, None
        return best, matched < best

    def _plan(self, meta: AttentionMetadata, window: int | None, dtype: torch.dtype,
              head_dim: int, decode_kernel: bool, prefill_kernel: bool,
              cascade: bool = True) -> _StepPlan:
        """Built on the host with numpy (small arrays: torch's per-op cost would dominate),
        then moved to the device once. With decode_kernel, decodes get key ranges for the C
        kernel instead of gather indices and masks; with prefill_kernel, prefill chunks get
        one row each for the C kernel, but for those it leaves to flash: sequences longer
        than the window, and see cpu.prefill.FLASH_MIN_KEYS_X_DIM2. cascade False: no
        shared part (every query row's keys in one part, without prefill_kernel)."""
        key = ("plan", window, dtype, head_dim, decode_kernel, prefill_kernel, cascade)
        if key in meta.cache:
            return meta.cache[key]
        bs, nd, n = meta.block_size, meta.num_decode_seqs, meta.num_seqs
        device = meta.seq_lens.device
        tables = meta.host_block_tables()
        lens = np.asarray(meta.seq_lens_cpu, dtype=np.int64)
        qsl = meta.query_start_loc_cpu
        shared, not_member = self._cascade(meta, window) if cascade else (0, None)
        prefix = shared * bs
        # each sequence's own keys start after the shared part (members) or at 0
        own_start = np.where(not_member, 0, prefix) if shared else np.zeros(n, dtype=np.int64)

        def to_device(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(device)

        def additive(valid: np.ndarray) -> torch.Tensor:
            return to_device(np.where(valid, np.float32(0), np.float32(-np.inf))).to(dtype)

        decode_groups, decode_bounds = [], None
        if decode_kernel and nd:
            lo, hi = own_start[:nd], lens[:nd]
            if window is not None:
                lo = np.maximum(lo, hi - window)
            decode_bounds = (to_device(lo.astype(np.int32)), to_device(hi.astype(np.int32)))
        for a, b in _length_groups(0 if decode_kernel else nd, self.max_decode_groups):
            seq_lens, start = lens[a:b, None], own_start[a:b, None]
            width = int((seq_lens - start).max())
            pos = start + np.arange(width)[None, :]
            valid = pos < seq_lens
            if window is not None:
                valid &= pos > seq_lens - 1 - window
            slots = _slots(tables[a:b], np.minimum(pos, seq_lens - 1), bs)
            decode_groups.append((a, b, to_device(slots.reshape(-1)), width,
                                  additive(valid)[:, None, None, :]))

        prefill_groups, group_slots, chunks, k0 = [], [], [], 0
        prefill_chunks, torch_rows = None, range(nd, n)
        # a window hides keys only from sequences longer than it; the C prefill kernel
        # has no window, so it takes the others
        windowed = lens > window if window is not None else np.zeros(n, dtype=bool)
        if prefill_kernel and n > nd:
            rows = np.arange(nd, n)
            starts, ends = np.asarray(qsl[nd:n]), np.asarray(qsl[nd + 1:n + 1])
            own_keys = lens[nd:n] - own_start[nd:n]
            flash_min = cpu.prefill.flash_min_keys_x_dim2()
            to_flash = windowed[nd:n].copy()
            if flash_min is not None and dtype == torch.bfloat16:
                to_flash |= ((own_keys * head_dim ** 2 >= flash_min)
                             & (ends - starts >= cpu.prefill.FLASH_MIN_QUERIES))
            torch_rows = rows[to_flash].tolist()
            if not to_flash.all():
                keep = ~to_flash
                prefill_chunks = to_device(np.stack(
                    [rows[keep], starts[keep], ends[keep], own_start[nd:n][keep],
                     lens[nd:n][keep]], axis=1).astype(np.int32))
        for i in torch_rows:
            start, end, seq_len = qsl[i], qsl[i + 1], int(lens[i])
            # under a window, the chunk goes in runs of `window` queries, each gathering
            # only the keys its queries see (at most 2 * window - 1), so long prompts cost
            # O(length * window), not O(length^2)
            w = window if windowed[i] else None
            run = max(end - start if w is None else w, 1)
            for r0 in range(start, end, run):
                r1 = min(r0 + run, end)
                first_q, end_q = seq_len - (end - r0), seq_len - (end - r1)  # positions
                first_key = own_start[i] if w is None else max(own_start[i], first_q - w + 1)
                kpos = np.arange(first_key, end_q)
                mask, seen = None, 0
                if prefill_kernel and w is None:  # left to flash: two calls, no mask
                    seen = len(kpos) - (r1 - r0)
                elif w is not None or len(kpos) != r1 - r0:
                    qpos = np.arange(first_q, end_q)
                    valid = kpos[None, :] <= qpos[:, None]
                    if w is not None:
                        valid &= kpos[None, :] > qpos[:, None] - w
                    mask = additive(valid)
                if chunks and k0 + len(kpos) > self.max_gather_rows:
                    prefill_groups.append((to_device(np.concatenate(group_slots)), chunks))
                    group_slots, chunks, k0 = [], [], 0
                group_slots.append(_slots(tables[i:i + 1], kpos[None, :], bs)[0])
                chunks.append((r0, r1, k0, k0 + len(kpos), mask, seen))
                k0 += len(kpos)
        if chunks:
            prefill_groups.append((to_device(np.concatenate(group_slots)), chunks))

        shared_slots = token_not_member = None
        if shared:
            ref = int(np.flatnonzero(~not_member)[0])
            shared_slots = to_device(_slots(tables[ref:ref + 1], np.arange(prefix)[None], bs)[0])
            if not_member.any():
                token_not_member = to_device(np.repeat(not_member, np.diff(np.asarray(qsl))))
        plan = _StepPlan(shared_slots, token_not_member, decode_groups, decode_bounds,
                         prefill_groups, prefill_chunks)
        meta.cache[key] = plan
        return plan

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, sliding_window: int | None = None, k_scale: float = 1.0,
                v_scale: float = 1.0, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """query [T, H, D], key/value [T, Hkv, D] -> [T, H, D]; writes key/value first
        (None: the caller has written them). k_scale, v_scale: an FP8 cache's scales;
        softcap: scores become softcap * tanh(scores / softcap) (no C kernel then); sinks
        [H]: a logit per query head added to the softmax's denominator (no C kernel nor
        cascade then)."""
        if key is not None:
            write_kv(key, value, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        num_tokens, num_heads, head_dim = query.shape
        num_kv_heads = k_cache.shape[2]
        group = num_heads // num_kv_heads
        cache_dtype, from_fp8 = k_cache.dtype, fp8.is_fp8(k_cache)
        if not from_fp8:
            k_scale = v_scale = 1.0
        # an FP8 cache is gathered as its codes, then widened
        raw = torch.uint8 if from_fp8 else cache_dtype
        k_flat = k_cache.view(raw).view(-1, num_kv_heads, head_dim)
        v_flat = v_cache.view(raw).view(-1, num_kv_heads, head_dim)

        def widen(k: torch.Tensor, v: torch.Tensor):
            """Gathered K and V in the query's dtype (read times the scales)."""
            return (fp8.dequantize(k.view(cache_dtype), k_scale, query.dtype),
                    fp8.dequantize(v.view(cache_dtype), v_scale, query.dtype))

        decode_kernel = softcap is None and sinks is None \
            and self._uses(cpu.decode, query, num_kv_heads, cache_dtype)
        prefill_kernel = decode_kernel and self._uses(cpu.prefill, query, num_kv_heads,
                                                      cache_dtype)
        plan = self._plan(meta, sliding_window, query.dtype, head_dim, decode_kernel,
                          prefill_kernel, cascade=sinks is None)
        # the sinks as each call's rows hold the heads: decodes [Hkv, G], prefill [H, 1]
        decode_sink = sinks.view(num_kv_heads, group) if sinks is not None else None
        prefill_sink = sinks.view(num_heads, 1) if sinks is not None else None
        cascade = plan.shared_slots is not None

        def gather(slots: torch.Tensor, shape: tuple[int, ...]):
            k = self._scratch("k", slots.numel(), k_flat)
            v = self._scratch("v", slots.numel(), v_flat)
            torch.index_select(k_flat, 0, slots, out=k)
            torch.index_select(v_flat, 0, slots, out=v)
            return widen(k.view(*shape, num_kv_heads, head_dim),
                         v.view(*shape, num_kv_heads, head_dim))

        q = query.view(num_tokens, num_kv_heads, group, head_dim)
        out_heads = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype,
                                device=query.device)
        out = out_heads.view(num_tokens, num_kv_heads, group, head_dim)  # own part, per KV head
        # own parts' log-sum-exp, for the merge of those the kernels do not merge themselves
        lse = torch.empty(num_tokens, num_kv_heads, group, dtype=torch.float32,
                          device=query.device) \
            if cascade and (plan.decode_groups or plan.prefill_groups) else None

        shared = shared_lse = None
        if cascade:
            # shared part: every query row of the batch in one product against the shared K/V
            ks = k_flat.index_select(0, plan.shared_slots)
            vs = v_flat.index_select(0, plan.shared_slots)
            if softcap is None and self._uses(cpu.shared_prefix, query, num_kv_heads,
                                              cache_dtype):
                shared, shared_lse = cpu.shared_prefix.attention(
                    query, ks.view(cache_dtype), vs.view(cache_dtype), scale, k_scale, v_scale)
            else:
                ks, vs = widen(ks, vs)
                qs = q.permute(1, 0, 2, 3).reshape(1, num_kv_heads, num_tokens * group,
                                                   head_dim)
                shared, shared_lse = _attention_with_lse(
                    qs, ks.transpose(0, 1)[None], vs.transpose(0, 1)[None], None, scale,
                    softcap=softcap)
                shared = shared.view(num_kv_heads, num_tokens, group, head_dim).transpose(0, 1)
                shared_lse = shared_lse.view(num_kv_heads, num_tokens, group).transpose(0, 1)
            if plan.token_not_member is not None:
                shared_lse = shared_lse.masked_fill(plan.token_not_member[:, None, None],
                                                    float("-inf"))

        merged = 0  # tokens [0, merged) already hold the result over shared and own keys
        if plan.decode_bounds is not None:
            lo, hi = plan.decode_bounds
            nd = lo.numel()
            # the kernel starts from the shared part's result, read where it lies, and merges it
            init = (shared[:nd], shared_lse[:nd]) if cascade else None
            cpu.decode.attention(query[:nd], k_cache, v_cache, meta.block_tables, lo, hi, scale,
                                 out_heads[:nd], None, init, k_scale, v_scale)
            merged = nd
        for a, b, slots, width, mask in plan.decode_groups:
            k, v = gather(slots, (b - a, width))
            o, l = _attention_with_lse(q[a:b], k.transpose(1, 2), v.transpose(1, 2), mask, scale,
                                       softcap=softcap, sink=decode_sink)
            out[a:b] = o
            if cascade:
                lse[a:b] = l
        if plan.prefill_chunks is not None:  # follows the decodes: merged == nd here
            cpu.prefill.attention(query, k_cache, v_cache, meta.block_tables,
                                  plan.prefill_chunks, scale, out_heads, None,
                                  (shared, shared_lse) if cascade else None, k_scale, v_scale)
        if prefill_kernel:
            merged = num_tokens  # but for any chunks left to flash, merged one by one below
        # prefill chunks: their keys gathered a group at a time, then one call each, all
        # query heads against the KV heads (no copy of the queries: [1, heads, tokens, D]
        # is a view of the token-major rows)
        for slots, chunks in plan.prefill_groups:
            k_all, v_all = gather(slots, (slots.shape[0],))
            for start, end, k0, k1, mask, seen in chunks:
                qi = query[start:end].transpose(0, 1)[None]

                def attend(a: int, b: int, causal: bool):  # keys [a, b) of the group
                    o, l = _attention_with_lse(qi, k_all[a:b].transpose(0, 1)[None],
                                               v_all[a:b].transpose(0, 1)[None], mask, scale,
                                               causal=causal, softcap=softcap,
                                               sink=prefill_sink)
                    return o[0].transpose(0, 1), l[0].transpose(0, 1).reshape(
                        end - start, num_kv_heads, group)

                o, l = attend(k0 + seen, k1, mask is None)
                out_heads[start:end] = o
                if seen:  # the earlier context, seen whole, and the shared prefix's result:
                    # merged with the chunk's own part in float32, rounded once
                    o_seen, l_seen = attend(k0, k0 + seen, False)
                    parts = [(out[start:end], l), (o_seen.reshape(out[start:end].shape), l_seen)]
                    if cascade:  # (merged == num_tokens: the policy's chunks only)
                        parts.append((shared[start:end], shared_lse[start:end]))
                    _merge_parts(out[start:end], parts)
                    continue
                if cascade:
                    lse[start:end] = l
                    if merged == num_tokens:
                        _merge_shared(out[start:end], lse[start:end], shared[start:end],
                                      shared_lse[start:end])
        if cascade and merged < num_tokens:
            _merge_shared(out[merged:], lse[merged:], shared[merged:], shared_lse[merged:])
        return out_heads


def _merge_parts(out: torch.Tensor,
                 parts: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """out [T, Hkv, G, D] = attention over the union of the parts' keys, from each part's
    (result, log-sum-exp), weighted by e^(lse - total) in float32 and rounded once. A part
    over no keys (lse -inf) adds nothing; the first part's lse is finite."""
    total = torch.logsumexp(torch.stack([lse for _, lse in parts]), dim=0)
    merged = sum(torch.exp(lse - total)[..., None] * o.float() for o, lse in parts)
    out.copy_(merged)


def _merge_shared(out: torch.Tensor, lse: torch.Tensor, shared: torch.Tensor,
                  shared_lse: torch.Tensor) -> None:
    """out (own keys' result, [T, Hkv, G, D]) becomes the result over own and shared keys.
    The weights are e^lse / (e^lse + e^shared_lse) = sigmoid(lse - shared_lse); every query
    sees at least itself in its own part, so lse is finite. lerp computes in float32 and
    rounds once, so a weight rounded to the model's dtype costs at most about one unit in
    the last place of the result, and skips two float32 copies."""
    own_weight = torch.sigmoid(lse - shared_lse)[..., None].to(out.dtype)
    torch.lerp(shared, out, own_weight, out=out)
