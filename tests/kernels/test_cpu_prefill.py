"""The C prefill-attention kernel (kernels/cpu/prefill.c) against a float64 reference.

Caches come from the paged_batch fixture (on the CPU here): blocks in shuffled order and
NaN in every slot outside a context, so a read past a chunk's keys shows as NaN."""
from __future__ import annotations

import pytest
import torch

from batchinfer.kernels import cpu

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def library(built_or_skip):
    return built_or_skip(cpu.prefill, "the CPU prefill kernel")


@pytest.fixture(scope="module", params=["float32 form", "bfloat16 dot form"])
def kernel(library, request):
    """The kernel with long bfloat16 chunks on each form in turn, whichever one this CPU's
    vendor gets by default: the dot form on AVX512-BF16's dot products, or on FMAs where the
    build has none."""
    kernel = cpu.prefill.PrefillKernel(library)
    kernel.bf16_dot = request.param == "bfloat16 dot form"
    return kernel


def chunks_of(batch, lo):
    """(s, q0, q1, lo, hi) per sequence of the batch; lo: each one's first key position."""
    qsl, lens = batch.meta.query_start_loc_cpu, batch.meta.seq_lens_cpu
    return torch.tensor([[i, qsl[i], qsl[i + 1], lo[i], lens[i]] for i in range(len(lens))],
                        dtype=torch.int32)


def reference(query, k_cache, v_cache, block_tables, chunks, scale, init=None):
    """(out, lse) in float64, one chunk at a time; init: (out, lse) over other keys, as
    [T, Hkv, G, D] and [T, Hkv, G]."""
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float64)
    lse = torch.full((num_tokens, num_heads), float("-inf"), dtype=torch.float64)
    for s, q0, q1, lo, hi in chunks.tolist():
        pos = torch.arange(lo, hi)
        slots = block_tables[s, pos // block_size].long() * block_size + pos % block_size
        k = k_cache.view(-1, num_kv_heads, head_dim)[slots].double().repeat_interleave(group, 1)
        v = v_cache.view(-1, num_kv_heads, head_dim)[slots].double().repeat_interleave(group, 1)
        q = query[q0:q1].double()
        scores = torch.einsum("thd,khd->thk", q, k) * scale
        n = q1 - q0
        qpos = torch.arange(hi - n, hi)
        scores = scores.masked_fill(pos[None, None, :] > qpos[:, None, None], float("-inf"))
        if init is not None:
            extra = init[1][q0:q1].reshape(n, num_heads).double()
            scores = torch.cat([scores, extra[..., None]], dim=-1)
        lse[q0:q1] = torch.logsumexp(scores, dim=-1)
        p = torch.exp(scores - lse[q0:q1, :, None])
        out[q0:q1] = torch.einsum("thk,khd->thd", p[..., :len(pos)], v)
        if init is not None:
            out[q0:q1] += p[..., -1:] * init[0][q0:q1].reshape(n, num_heads, head_dim).double()
    return out, lse


def run(kernel, batch, chunks, scale=0.3, query=None, init=None):
    query = batch.query if query is None else query
    out = torch.full(query.shape, float("nan"), dtype=query.dtype)
    lse = torch.full(query.shape[:2], float("nan"), dtype=torch.float32)
    kernel(query, batch.k_cache, batch.v_cache, batch.meta.block_tables, chunks, scale, out, lse,
           init)
    return out, lse


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_kv_heads, group, head_dim, block_size", [
    (4, 2, 32, 16),    # the bench's tiny shape
    (3, 3, 64, 16),    # SmolLM2-135M: 16-row groups straddle tokens
    (2, 4, 128, 16),   # Llama-style head_dim
    (1, 3, 256, 16),   # the largest head_dim
    (1, 1, 16, 8),     # blocks shorter than 16 keys; one row per token
    (5, 1, 48, 32),    # no GQA; a head_dim without its own specialisation
    (1, 16, 32, 16),   # the widest group the kernel takes
])
def test_matches_reference(kernel, paged_batch, dtype, tol, num_kv_heads, group, head_dim,
                           block_size):
    # whole prompts, chunks after earlier context (a chunked prompt, a cached prefix), one
    # token, and contexts past the 256-key block the kernel widens at a time
    seq_lens = [5, 40, 1, 300, 70, 600]
    query_lens = [5, 17, 1, 300, 1, 45]
    batch = paged_batch(seq_lens, query_lens, block_size=block_size, num_kv_heads=num_kv_heads,
                        group=group, head_dim=head_dim, dtype=dtype, device=CPU)
    assert kernel.supports(dtype, num_kv_heads * group, num_kv_heads, head_dim)
    for lo in ([0] * 6, [0, 16, 0, 0, 64, 257]):
        chunks = chunks_of(batch, lo)
        out, lse = run(kernel, batch, chunks)
        ref_out, ref_lse = reference(batch.query, batch.k_cache, batch.v_cache,
                                     batch.meta.block_tables, chunks, 0.3)
        torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
        torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)


def takes_dot_path(kernel, dtype, chunks, head_dim):
    """Which chunks run on the bfloat16 micro-kernel (none with the dot form off)."""
    keys = (chunks[:, 4] - chunks[:, 3]) * head_dim
    return (keys >= cpu.prefill.DOT_MIN_KEY_ELEMENTS) & (
        dtype == torch.bfloat16 and kernel.bf16_dot and head_dim % 32 == 0)


# short chunks, and long ones (past one 512-key block of the bfloat16 micro-kernel)
MERGE_CASES = [([40, 130, 9], [30, 100, 9], [8, 30, 0]),
               ([700, 300, 9], [650, 290, 9], [40, 8, 0])]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("seq_lens, query_lens, lo", MERGE_CASES)
def test_merges_a_strided_partial_result(kernel, paged_batch, dtype, tol, seq_lens,
                                         query_lens, lo):
    """init = (out, lse) over other keys, laid out as the cascade's shared part is (KV head
    major, strided); the result is attention over both. An init lse of -inf adds nothing."""
    batch = paged_batch(seq_lens, query_lens, block_size=16, num_kv_heads=3, group=3,
                        head_dim=64, dtype=dtype, device=CPU)
    num_tokens = sum(query_lens)
    gen = torch.Generator().manual_seed(1)
    init_out = torch.randn(3, num_tokens, 3, 64, generator=gen).to(dtype).transpose(0, 1)
    init_lse = torch.randn(3, num_tokens, 3, generator=gen).permute(1, 0, 2)
    init_lse.masked_fill_(torch.arange(num_tokens)[:, None, None] % 4 == 0, float("-inf"))
    assert not init_out.is_contiguous() and not init_lse.is_contiguous()
    chunks = chunks_of(batch, lo)
    out, lse = run(kernel, batch, chunks, init=(init_out, init_lse))
    ref_out, ref_lse = reference(batch.query, batch.k_cache, batch.v_cache,
                                 batch.meta.block_tables, chunks, 0.3, (init_out, init_lse))
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_threads", [1, 2])
def test_long_chunks_split_into_items(kernel, paged_batch, num_threads):
    """A chunk of more query rows than one work item takes (512) is split across items and
    threads; every row still sees exactly its causal keys."""
    batch = paged_batch([700, 300], [650, 300], block_size=16, num_kv_heads=2, group=2,
                        head_dim=32, dtype=torch.float32, device=CPU)
    chunks = chunks_of(batch, [0, 0])
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        out, lse = run(kernel, batch, chunks)
    finally:
        torch.set_num_threads(before)
    ref_out, ref_lse = reference(batch.query, batch.k_cache, batch.v_cache,
                                 batch.meta.block_tables, chunks, 0.3)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)


def test_only_the_chunks_tokens_are_written(kernel, paged_batch):
    # decodes ahead of the chunks keep what the decode kernel put there
    batch = paged_batch([20, 30, 50], [1, 1, 20], block_size=16, num_kv_heads=2, group=2,
                        head_dim=32, dtype=torch.float32, device=CPU)
    chunks = chunks_of(batch, [0, 0, 0])[2:]
    out, _ = run(kernel, batch, chunks)
    assert out[:2].isnan().all() and not out[2:].isnan().any()


def test_strided_query_rows(kernel, paged_batch):
    # q may be a view of a wider projection: rows are strided
    batch = paged_batch([20, 70], [20, 10], block_size=16, num_kv_heads=2, group=2,
                        head_dim=32, dtype=torch.float32, device=CPU)
    qkv = torch.randn(30, 4 * 32 + 2 * 2 * 32)
    query = qkv[:, :4 * 32].view(30, 4, 32)
    assert not query.is_contiguous()
    chunks = chunks_of(batch, [0, 0])
    out, _ = run(kernel, batch, chunks, query=query)
    ref_out, _ = reference(query, batch.k_cache, batch.v_cache, batch.meta.block_tables, chunks,
                           0.3)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length, position", [(40, 19), (900, 19), (900, 700)])
def test_a_nan_key_in_range_shows_in_the_output(kernel, paged_batch, dtype, length, position):
    batch = paged_batch([length], [length], block_size=16, num_kv_heads=1, group=2,
                        head_dim=32, dtype=dtype, device=CPU)
    block = int(batch.meta.block_tables[0, position // 16])
    batch.k_cache[block, position % 16, 0, 5] = float("nan")
    out, lse = run(kernel, batch, chunks_of(batch, [0]))
    # tokens before the position do not see it; every later one does
    assert not out[:position].isnan().any() and out[position:].isnan().all()
    assert not lse[:position].isnan().any() and lse[position:].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_nan_value_reaches_only_the_rows_computed_with_it(kernel, paged_batch, dtype):
    """A NaN in V at position p reaches every token from p on, and of the earlier ones at
    most those computed in one pass with a token that sees it (16 query rows in float32, 6
    in the bfloat16 micro-kernel, here 2 rows a token): none further back."""
    batch = paged_batch([900], [900], block_size=16, num_kv_heads=1, group=2, head_dim=32,
                        dtype=dtype, device=CPU)
    position = 700
    block = int(batch.meta.block_tables[0, position // 16])
    batch.v_cache[block, position % 16, 0, 5] = float("nan")
    out, _ = run(kernel, batch, chunks_of(batch, [0]))
    assert out[position:].isnan().any(dim=(1, 2)).all()
    assert not out[:position - 8].isnan().any()


def test_long_bfloat16_chunks_take_the_dot_product_kernel(kernel, paged_batch):
    """With the dot form on, bfloat16 chunks with enough keys run on paired dot products
    (AVX512-BF16's, or FMAs in their order; the cases above cover both forms); a chunk's
    result is the same whichever form its neighbours take, and both match the reference."""
    if not kernel.bf16_dot:
        pytest.skip("the float32 form: covered by the cases above")
    batch = paged_batch([900, 60, 520], [900, 60, 200], block_size=16, num_kv_heads=2,
                        group=4, head_dim=128, dtype=torch.bfloat16, device=CPU)
    chunks = chunks_of(batch, [0, 0, 0])
    assert takes_dot_path(kernel, torch.bfloat16, chunks, 128).tolist() == [True, False, True]
    out, lse = run(kernel, batch, chunks)
    ref_out, ref_lse = reference(batch.query, batch.k_cache, batch.v_cache,
                                 batch.meta.block_tables, chunks, 0.3)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)
    for i in range(3):  # each chunk alone
        alone = chunks[i:i + 1]
        q0, q1 = int(alone[0, 1]), int(alone[0, 2])
        out_i, lse_i = run(kernel, batch, alone)
        assert torch.equal(out_i[q0:q1], out[q0:q1]) and torch.equal(lse_i[q0:q1], lse[q0:q1])
    # with the dot products switched off (as on CPUs where they are no faster), every chunk
    # runs the float32 form: a different rounding, the same attention
    plain = cpu.prefill.PrefillKernel(kernel.path)
    plain.bf16_dot = False
    out_f, lse_f = run(plain, batch, chunks)
    torch.testing.assert_close(out_f.double(), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse_f.double(), ref_lse, atol=1e-4, rtol=1e-4)
    q1 = int(chunks[0, 2])
    assert not torch.equal(out_f[:q1], out[:q1])
    assert torch.equal(out_f[q1:int(chunks[1, 2])], out[q1:int(chunks[1, 2])])


def test_rejects_arguments_out_of_contract(kernel, paged_batch):
    batch = paged_batch([20, 30], [20, 5], block_size=16, num_kv_heads=2, group=2,
                        head_dim=32, dtype=torch.float32, device=CPU)
    chunks = chunks_of(batch, [0, 0])
    with pytest.raises(ValueError, match="out of contract"):
        run(kernel, batch, chunks, query=batch.query.to(torch.bfloat16))
    with pytest.raises(ValueError, match="out of contract"):
        run(kernel, batch, chunks.long())
    with pytest.raises(ValueError, match="out of contract"):  # init shaped per query head
        run(kernel, batch, chunks, init=(torch.zeros(25, 4, 32), torch.zeros(25, 4)))
    width = batch.meta.block_tables.shape[1] * 16
    bad_rows = (
        [0, 0, 20, 0, width + 1],   # context past the block table
        [0, 0, 20, -1, 20],         # a negative first key
        [0, 0, 20, 5, 20],          # fewer keys than queries: the first token would see none
        [2, 0, 20, 0, 20],          # a sequence past the block tables
        [0, 20, 26, 0, 30],         # tokens past the batch
        [0, 5, 5, 0, 20],           # no tokens
    )
    with pytest.raises(ValueError, match="outside the batch or the cache"):  # rows overlap
        run(kernel, batch, torch.tensor([[1, 20, 25, 0, 30], [0, 0, 21, 0, 21]],
                                        dtype=torch.int32))
    for row in bad_rows:
        with pytest.raises(ValueError, match="outside the batch or the cache"):
            run(kernel, batch, torch.tensor([row], dtype=torch.int32))
    batch.meta.block_tables[1, 0] = batch.k_cache.shape[0]
    with pytest.raises(ValueError, match="outside the batch or the cache"):
        run(kernel, batch, chunks)
    assert not kernel.supports(torch.float16, 4, 2, 32)
    assert not kernel.supports(torch.float32, 4, 2, 40)   # head_dim not a multiple of 16
    assert not kernel.supports(torch.float32, 64, 2, 32)  # 32 query heads per KV head


def test_a_smaller_block_size_is_checked_again(kernel, paged_batch):
    """The checks are cached per step (the same chunks and block tables serve every
    layer), but not across caches of another block size, where the same table covers
    fewer positions."""
    batch = paged_batch([40], [40], block_size=16, num_kv_heads=1, group=2, head_dim=32,
                        dtype=torch.float32, device=CPU)
    chunks = chunks_of(batch, [0])
    run(kernel, batch, chunks)
    small = torch.zeros(batch.k_cache.shape[0], 4, 1, 32)
    with pytest.raises(ValueError, match="outside the batch or the cache"):
        kernel(batch.query, small, small.clone(), batch.meta.block_tables, chunks, 0.3,
               torch.empty_like(batch.query))
