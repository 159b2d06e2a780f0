"""The CPU attention path against a one-sequence-at-a-time reference, on paged batches
where sequences share leading blocks (the cascade) and where they do not."""
from __future__ import annotations

import pytest
import torch

from batchinfer.attention import AttentionMetadata, TorchAttention
from batchinfer.kernels import cpu
from reference import read_fp8, ref_decode_attention, ref_prefill_attention, to_fp8

BLOCK = 16
KV_HEADS, GROUP, HEAD_DIM = 2, 4, 32


def paged_batch(seqs: list[tuple[int, int, int]], dtype=torch.float32, seed=0,
                heads: tuple[int, int, int] = (KV_HEADS, GROUP, HEAD_DIM)):
    """seqs: (shared_blocks, seq_len, query_len). The first `shared_blocks` blocks of each
    sequence are the same physical blocks (a cached system prompt); the rest are its own.
    Decodes (query_len 1) must come first. heads: KV heads, query heads per KV head,
    head_dim."""
    kv_heads, group, head_dim = heads
    gen = torch.Generator().manual_seed(seed)
    shared_ids = list(range(1, 1 + max(s for s, _, _ in seqs)))
    next_id = 1 + len(shared_ids)
    tables, slots = [], []
    for shared, seq_len, q_len in seqs:
        n_blocks = -(-seq_len // BLOCK)
        own = list(range(next_id, next_id + n_blocks - shared))
        next_id += len(own)
        table = shared_ids[:shared] + own
        tables.append(table)
        for p in range(seq_len - q_len, seq_len):
            slots.append(table[p // BLOCK] * BLOCK + p % BLOCK)
    shape = (next_id, BLOCK, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    width = max(map(len, tables))
    block_tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        block_tables[i, :len(t)] = torch.tensor(t)
    q_lens = [q for _, _, q in seqs]
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    slot_t = torch.tensor(slots)
    # the new tokens' K/V are what the cache already holds at their slots
    key = k_cache.view(-1, kv_heads, head_dim)[slot_t].clone()
    value = v_cache.view(-1, kv_heads, head_dim)[slot_t].clone()
    query = torch.randn(qsl[-1], kv_heads * group, head_dim, generator=gen).to(dtype)
    seq_lens = [s for _, s, _ in seqs]
    meta = AttentionMetadata(
        slot_mapping=slot_t, query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=block_tables,
        max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        num_decode_seqs=sum(1 for q in q_lens if q == 1), block_size=BLOCK,
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)
    return query, key, value, k_cache, v_cache, meta


def reference(query, k_cache, v_cache, meta, window):
    nd = meta.num_decode_seqs
    out = ref_prefill_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                meta.query_start_loc, 0.2, window, first_seq=nd)
    if nd:
        out[:nd] = ref_decode_attention(query[:nd], k_cache, v_cache, meta.block_tables[:nd],
                                        meta.seq_lens[:nd], 0.2, window)
    return out


MIXED = [
    (8, 130, 1), (8, 200, 1), (8, 129, 1), (0, 90, 1), (8, 170, 1),  # decodes; one unshared
    (8, 129, 1), (8, 200, 40), (8, 150, 22),  # a decode just past the prefix; chunks after it
    (0, 140, 140),                            # an unrelated prompt
    (5, 100, 100),  # a prompt computing over part of the shared blocks: sees them causally
]


def step_plan(meta):
    """The plan the backend built for this step (one per window and dtype)."""
    (plan,) = [v for k, v in meta.cache.items() if k[0] == "plan"]
    return plan


@pytest.mark.parametrize("use_cpu_kernel", [True, False])
@pytest.mark.parametrize("window", [None, 48])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_matches_reference(window, dtype, tol, use_cpu_kernel):
    seqs = sorted(MIXED, key=lambda s: s[2] != 1)
    query, key, value, k_cache, v_cache, meta = paged_batch(seqs, dtype)
    backend = TorchAttention(use_cpu_kernel=use_cpu_kernel)
    out = backend.forward(query, key, value, k_cache, v_cache, meta, 0.2, window)
    expected = reference(query, k_cache, v_cache, meta, window)
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    plan = step_plan(meta)
    # decodes go to the C kernel where it is built, to gathered groups otherwise
    kernel_used = use_cpu_kernel and cpu.decode.available()
    assert (plan.decode_bounds is not None) == kernel_used
    assert bool(plan.decode_groups) == (not kernel_used)
    # prompt chunks go to the C prefill kernel with it, unless there is a window
    prefill_kernel = kernel_used and window is None and cpu.prefill.available()
    assert (plan.prefill_chunks is not None) == prefill_kernel
    assert bool(plan.prefill_groups) == (not prefill_kernel)
    # the cascade runs without a window (128 shared tokens), never with one shorter than the context
    assert (plan.shared_slots is not None) == (window is None)
    if window is None:
        assert plan.shared_slots.numel() == 8 * BLOCK
        skips = [s[0] < 8 or s[1] - s[2] < 8 * BLOCK for s in seqs]
        assert plan.token_not_member.tolist() == [f for s, f in zip(seqs, skips) for _ in range(s[2])]


@pytest.mark.parametrize("window", [None, 48])
def test_soft_capped_scores_match_reference(window):
    # every part (cascade, decodes, chunks after earlier context) in plain ops, capped
    seqs = sorted(MIXED, key=lambda s: s[2] != 1)
    query, key, value, k_cache, v_cache, meta = paged_batch(seqs)
    query = query * 4  # scores well past the cap
    out = TorchAttention().forward(query, key, value, k_cache, v_cache, meta, 0.2, window,
                                   softcap=3.0)
    plan = step_plan(meta)
    assert plan.decode_bounds is None and plan.prefill_chunks is None  # no C kernel
    assert (plan.shared_slots is not None) == (window is None)
    nd = meta.num_decode_seqs
    expected = ref_prefill_attention(query, k_cache, v_cache, meta.block_tables,
                                     meta.seq_lens, meta.query_start_loc, 0.2, window,
                                     first_seq=nd, softcap=3.0)
    expected[:nd] = ref_decode_attention(query[:nd], k_cache, v_cache, meta.block_tables[:nd],
                                         meta.seq_lens[:nd], 0.2, window, softcap=3.0)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    uncapped = reference(query, k_cache, v_cache, meta, window)
    assert (uncapped - expected).abs().max() > 0.1


@pytest.mark.parametrize("use_cpu_kernel", [True, False])
@pytest.mark.parametrize("window", [None, 48])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_fp8_cache_matches_reference(window, dtype, tol, use_cpu_kernel):
    """An FP8 cache, on every path (the C kernels, gathered groups and flash, the cascade's
    shared part): the new tokens' K/V are written as E4M3 of k / k_scale and v / v_scale,
    and the keys are read back times their scales."""
    k_scale, v_scale = 0.5, 3.0
    seqs = sorted(MIXED, key=lambda s: s[2] != 1)
    query, key, value, k_cache, v_cache, meta = paged_batch(seqs, dtype)
    k_cache, v_cache = to_fp8(k_cache, k_scale), to_fp8(v_cache, v_scale)
    slots = meta.slot_mapping
    for cache in (k_cache, v_cache):  # the new tokens' slots hold something else until written
        cache.view(torch.uint8).view(-1, KV_HEADS, HEAD_DIM)[slots] = 0x7f
    backend = TorchAttention(use_cpu_kernel=use_cpu_kernel)
    out = backend.forward(query, key * 1.5, value, k_cache, v_cache, meta, 0.2, window,
                          k_scale, v_scale)
    for cache, new, scale in ((k_cache, key * 1.5, k_scale), (v_cache, value, v_scale)):
        written = cache.view(torch.uint8).view(-1, KV_HEADS, HEAD_DIM)[slots]
        assert torch.equal(written, to_fp8(new, scale).view(torch.uint8))
    expected = reference(query, read_fp8(k_cache, k_scale), read_fp8(v_cache, v_scale), meta,
                         window)
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    plan = step_plan(meta)
    kernel_used = use_cpu_kernel and cpu.decode.available()
    assert (plan.decode_bounds is not None) == kernel_used
    assert (plan.shared_slots is not None) == (window is None)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_sliding_window_chunks_gather_only_the_keys_their_runs_see(dtype, tol):
    """A prompt chunk of a sequence longer than the window goes in runs of `window`
    queries, each with at most 2 * window - 1 keys (not the whole context): long prompts
    cost length x window. Sequences no longer than the window lose no keys to it and go to
    the C prefill kernel where it is built."""
    window = 48
    seqs = [(0, 400, 1), (0, 300, 300), (0, 700, 130), (0, 60, 60), (0, 40, 40), (0, 48, 20)]
    query, key, value, k_cache, v_cache, meta = paged_batch(seqs, dtype)
    out = TorchAttention().forward(query, key, value, k_cache, v_cache, meta, 0.2, window)
    torch.testing.assert_close(out.float(), reference(query, k_cache, v_cache, meta, window),
                               atol=tol, rtol=tol)
    plan = step_plan(meta)
    chunks = [c for _, group in plan.prefill_groups for c in group]
    runs = [(end - start, k1 - k0) for start, end, k0, k1, *_ in chunks]
    expected = ([(48, 48)] + [(48, 95)] * 5 + [(12, 59)]   # 300 queries from position 0
                + [(48, 95)] * 2 + [(34, 81)]              # 130 after 570 earlier tokens
                + [(48, 48), (12, 59)])                    # 60 from position 0
    if cpu.prefill.available() and cpu.decode.available():
        assert plan.prefill_chunks[:, 0].tolist() == [4, 5]
    else:  # the short ones through flash too, whole, causal
        assert plan.prefill_chunks is None
        expected += [(40, 40), (20, 48)]
    assert runs == expected


def test_a_window_longer_than_every_sequence_changes_nothing():
    """Window 256 over MIXED (contexts up to 200): the same plan as without a window
    (the cascade, the C kernels where built) and the same result."""
    seqs = sorted(MIXED, key=lambda s: s[2] != 1)
    query, key, value, k_cache, v_cache, meta = paged_batch(seqs)
    out = TorchAttention().forward(query, key, value, k_cache, v_cache, meta, 0.2, 256)
    torch.testing.assert_close(out, reference(query, k_cache, v_cache, meta, 256),
                               atol=2e-5, rtol=2e-5)
    query, key, value, k_cache, v_cache, meta_none = paged_batch(seqs)
    assert torch.equal(out, TorchAttention().forward(query, key, value, k_cache, v_cache,
                                                     meta_none, 0.2, None))
    plan, plan_none = step_plan(meta), step_plan(meta_none)
    assert torch.equal(plan.shared_slots, plan_none.shared_slots)
    assert (plan.prefill_chunks is None) == (plan_none.prefill_chunks is None)
    if plan.prefill_chunks is not None:
        assert torch.equal(plan.prefill_chunks, plan_none.prefill_chunks)


@pytest.mark.parametrize("seqs, to_flash", [
    # (query tokens, earlier keys seen whole) of the chunks left to flash: a member of the
    # cascade whose keys are its own 100 tokens, the two unshared prompts, and chunks after
    # earlier context of their own (a long prompt's later chunk): 40 after 32 keys, 100
    # after 200; the 22-token chunk stays in the kernel (too short)
    (MIXED + [(8, 228, 100), (0, 300, 100)], [(40, 32), (140, 0), (100, 0), (100, 0),
                                               (100, 200)]),
    # every chunk long enough: no kernel call at all
    ([(8, 130, 1), (8, 229, 101), (0, 140, 140)], [(101, 0), (140, 0)]),
])
def test_long_bfloat16_chunks_left_to_flash(monkeypatch, seqs, to_flash):
    """Where the prefill kernel leaves long bfloat16 chunks to torch's flash kernel (CPUs
    with AMX), those run as gathered flash calls without a mask (earlier context and own
    tokens apart), each merged with the shared prefix's result on its own, and the others
    stay in the kernel's one call."""
    if not (cpu.prefill.available() and cpu.decode.available()):
        pytest.skip("the C kernels are not built here")
    monkeypatch.setattr(cpu.prefill, "flash_min_keys_x_dim2", lambda: 64 * HEAD_DIM ** 2)
    seqs = sorted(seqs, key=lambda s: s[2] != 1)
    query, key, value, k_cache, v_cache, meta = paged_batch(seqs, torch.bfloat16)
    out = TorchAttention().forward(query, key, value, k_cache, v_cache, meta, 0.2, None)
    torch.testing.assert_close(out.float(), reference(query, k_cache, v_cache, meta, None),
                               atol=3e-2, rtol=3e-2)
    plan = step_plan(meta)
    assert plan.shared_slots is not None
    flashed = [(end - start, seen) for _, chunks in plan.prefill_groups
               for start, end, _, _, mask, seen in chunks if mask is None]
    assert flashed == to_flash
    kept = [s[2] for s in seqs if s[2] > 1 and s[2] not in [q for q, _ in to_flash]]
    if kept:
        assert (plan.prefill_chunks[:, 2] - plan.prefill_chunks[:, 1]).tolist() == kept
    else:
        assert plan.prefill_chunks is None


@pytest.mark.parametrize("heads", [(3, 3, 64), (1, 2, 128)])
@pytest.mark.parametrize("max_gather_rows", [16384, 200])
def test_flash_chunks_after_earlier_context_other_shapes(monkeypatch, heads, max_gather_rows):
    """The same split for SmolLM2's and a head_dim-128 shape, with the chunks in one gather
    group or each in its own."""
    if not (cpu.prefill.available() and cpu.decode.available()):
        pytest.skip("the C kernels are not built here")
    monkeypatch.setattr(cpu.prefill, "flash_min_keys_x_dim2", lambda: 64 * heads[2] ** 2)
    seqs = [(8, 150, 1), (8, 170, 1), (8, 300, 60), (0, 250, 90), (8, 228, 100), (2, 180, 40)]
    query, key, value, k_cache, v_cache, meta = paged_batch(seqs, torch.bfloat16, seed=3,
                                                            heads=heads)
    backend = TorchAttention()
    backend.max_gather_rows = max_gather_rows
    out = backend.forward(query, key, value, k_cache, v_cache, meta, 0.2, None)
    torch.testing.assert_close(out.float(), reference(query, k_cache, v_cache, meta, None),
                               atol=3e-2, rtol=3e-2)
    plan = step_plan(meta)
    flashed = [(end - start, seen) for _, chunks in plan.prefill_groups
               for start, end, _, _, _, seen in chunks]
    # own keys after the 128 shared: 172 (60 queries), 100; the others' own keys start at 0
    assert flashed == [(60, 112), (90, 160), (100, 0), (40, 140)]
    assert len(plan.prefill_groups) == (1 if max_gather_rows == 16384 else 4)
    assert plan.prefill_chunks is None


@pytest.mark.parametrize("max_gather_rows, groups", [(16384, 1), (150, 3)])
def test_prefill_keys_gathered_in_bounded_groups(max_gather_rows, groups):
    """Without the C prefill kernel, prefill chunks share one gather until their keys pass
    max_gather_rows (own keys: 72, 22, 140 and 100 rows here); a chunk past the bound starts
    a new group."""
    seqs = sorted(MIXED, key=lambda s: s[2] != 1)
    query, key, value, k_cache, v_cache, meta = paged_batch(seqs)
    backend = TorchAttention(use_cpu_kernel=False)
    backend.max_gather_rows = max_gather_rows
    out = backend.forward(query, key, value, k_cache, v_cache, meta, 0.2, None)
    torch.testing.assert_close(out, reference(query, k_cache, v_cache, meta, None),
                               atol=2e-5, rtol=2e-5)
    plan = step_plan(meta)
    assert len(plan.prefill_groups) == groups
    assert sum(len(chunks) for _, chunks in plan.prefill_groups) == 4
    # exactly causal chunks (keys = their own tokens) take no mask
    masks = [mask is None for _, chunks in plan.prefill_groups for *_, mask, _ in chunks]
    assert masks == [False, True, True, True]


def test_cascade_picks_the_prefix_most_sequences_share():
    # 4 sequences share 6 blocks, 2 of them share 10: 6 x 4 saves more than 10 x 2
    seqs = [(6, 120, 1), (6, 140, 1), (10, 190, 1), (10, 200, 1)]
    query, key, value, k_cache, v_cache, meta = paged_batch(seqs)
    backend = TorchAttention()
    out = backend.forward(query, key, value, k_cache, v_cache, meta, 0.2, None)
    plan = step_plan(meta)
    assert plan.shared_slots.numel() == 6 * BLOCK
    torch.testing.assert_close(out, reference(query, k_cache, v_cache, meta, None),
                               atol=2e-5, rtol=2e-5)


def test_no_cascade_below_the_threshold():
    seqs = [(2, 60, 1), (2, 70, 1), (2, 50, 1)]  # 32 shared tokens: not worth a second call
    query, key, value, k_cache, v_cache, meta = paged_batch(seqs)
    out = TorchAttention().forward(query, key, value, k_cache, v_cache, meta, 0.2, None)
    assert step_plan(meta).shared_slots is None
    torch.testing.assert_close(out, reference(query, k_cache, v_cache, meta, None),
                               atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2)])
def test_math_attention_matches_the_cpu_flash_kernel(heads, kv_heads):
    # the plain-ops path (used off CPU) against the CPU flash kernel, with grouped KV heads
    from batchinfer.attention.torch_backend import _attention_with_lse, _math_attention_with_lse
    gen = torch.Generator().manual_seed(heads)
    q = torch.randn(2, heads, 5, 16, generator=gen)
    k, v = torch.randn(2, 2, kv_heads, 7, 16, generator=gen).unbind(0)
    mask = torch.zeros(5, 7).masked_fill_(torch.rand(5, 7, generator=gen) < 0.3, float("-inf"))
    mask[:, 0] = 0  # every row sees a key
    out, lse = _attention_with_lse(q, k, v, mask, 0.25)
    out_math, lse_math = _math_attention_with_lse(q, k, v, mask, 0.25)
    torch.testing.assert_close(out_math, out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_math, lse, atol=1e-5, rtol=1e-5)
