"""Every kernel that writes or reads an FP8 (E4M3) KV cache against the reference: K/V
rounded to E4M3 as torch rounds them (reference.to_fp8), read back times their scales
(reference.read_fp8). Scales other than 1 (0.5 and 3.0, or 0.37 where rounding points
move); caches from the paged_batch fixture, unused slots poisoned (NaN, whose E4M3 code
0x7f every kernel reads as NaN); the Triton kernels under the interpreter on CPU."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from batchinfer.attention.torch_backend import write_kv as torch_write_kv
from batchinfer.kernels import cpu
from batchinfer.kernels.triton._paged import float_to_fp8, fp8_to_float
from batchinfer.kernels.triton.decode import paged_decode_attention
from batchinfer.kernels.triton.kv_write import write_kv
from batchinfer.kernels.triton.prefill import paged_prefill_attention
from reference import (FP8, read_fp8, ref_decode_attention, ref_prefill_attention,
                       ref_write_kv, to_fp8)

CPU = torch.device("cpu")
SCALE = 0.3
K_SCALE, V_SCALE = 0.5, 3.0
TOLERANCES = {torch.float32: dict(atol=2e-5, rtol=2e-5),
              torch.float16: dict(atol=1e-3, rtol=1e-3),
              torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
if torch.cuda.is_available():  # probabilities rounded to 16 bits before P @ V on a GPU
    TOLERANCES.update({torch.float16: dict(atol=4e-3, rtol=4e-3),
                       torch.bfloat16: dict(atol=3e-2, rtol=3e-2)})


def conversion_inputs() -> torch.Tensor:
    """Every finite bfloat16 value (each of E4M3's rounding boundaries and ties lies among
    them), random floats across E4M3's range and below its smallest subnormal, float32
    denormals, and the specials (clamped: +-inf to +-448; NaN stays NaN)."""
    gen = torch.Generator().manual_seed(0)
    every_bf16 = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return torch.cat([
        every_bf16.float()[every_bf16.float().isfinite()],
        torch.randn(20000, generator=gen) * 300, torch.randn(20000, generator=gen) * 0.01,
        torch.randn(2000, generator=gen) * 1e-3, torch.rand(256, generator=gen) * 1e-38,
        torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0,
                      448.0, -448.0, 464.0, 480.0, 2.0 ** -10, 3 * 2.0 ** -11])])


def as_fp8(batch, k_scale: float = K_SCALE, v_scale: float = V_SCALE):
    """The batch's caches as FP8 ones: the codes of k / k_scale and v / v_scale (NaN slots
    stay NaN), with what a kernel reads from them (float32)."""
    batch.k_cache, batch.v_cache = to_fp8(batch.k_cache, k_scale), to_fp8(batch.v_cache, v_scale)
    return read_fp8(batch.k_cache, k_scale), read_fp8(batch.v_cache, v_scale)


def same_codes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ---- the E4M3 conversions, bit for bit ----------------------------------------------------

@triton.jit
def _to_fp8_kernel(x_ptr, out_ptr, scale, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, float_to_fp8(tl.load(x_ptr + i, mask=i < n), scale), mask=i < n)


@triton.jit
def _from_fp8_kernel(code_ptr, out_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(out_ptr + i, fp8_to_float(tl.load(code_ptr + i)))


# the interpreter's numpy warns as float32 inputs near the top of the range overflow on
# division by a scale below 1 (to inf, which the clamp turns to 448, as torch's does)
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("scale", [1.0, 0.5, 3.0, 0.37])
def test_triton_conversions_are_torchs(device, scale):
    x = conversion_inputs().to(device)
    codes = torch.empty(x.shape, dtype=torch.uint8, device=device)
    _to_fp8_kernel[(triton.cdiv(x.numel(), 1 << 16),)](x, codes, scale, x.numel(),
                                                         BLOCK=1 << 16)
    assert same_codes(codes, to_fp8(x, scale))
    every_code = torch.arange(256, dtype=torch.uint8, device=device)
    values = torch.empty(256, device=device)
    _from_fp8_kernel[(1,)](every_code, values, BLOCK=256)
    want = every_code.view(FP8).float()
    assert torch.equal(values.nan_to_num(7.0), want.nan_to_num(7.0))
    assert torch.equal(values.signbit(), want.signbit())  # -0.0 (0x80) included


# (float32 bits, scale, code): NaN of either sign and any payload stays NaN (0x7f, 0xff);
# infinities, huge values and quotients past 448 saturate to +-448 (0x7e, 0xfe).
SPECIALS = [(0x7FC00000, 1.0, 0x7F), (0xFFC00000, 1.0, 0xFF), (0x7F800001, 0.5, 0x7F),
            (0xFFFFFFFF, 3.0, 0xFF), (0x7F800000, 1.0, 0x7E), (0xFF800000, 0.37, 0xFE),
            (0x7F7FFFFF, 1.0, 0x7E), (0xFF7FFFFF, 3.0, 0xFE), (0x43C80000, 0.5, 0x7E),
            (0xC3C80000, 0.5, 0xFE), (0x43E00000, 1.0, 0x7E), (0x43DC0000, 1.0, 0x7E),
            (0x7F000000, 1e-30, 0x7E)]


# (the interpreter's numpy warns of the overflows and NaN quotients)
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("bits, scale, code", SPECIALS, ids=lambda v: f"{v:#x}"
                         if isinstance(v, int) else str(v))
def test_triton_write_conversion_specials(device, bits, scale, code):
    x = torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = x.to(device).expand(16).contiguous()
    codes = torch.empty(16, dtype=torch.uint8, device=device)
    _to_fp8_kernel[(1,)](x, codes, scale, 16, BLOCK=16)
    got = codes.tolist()
    if code & 0x7F == 0x7F:
        # NaN's sign is the quotient's, which a GPU's division may drop (as torch's there)
        got, code = [c & 0x7F for c in got], 0x7F
    assert got == [code] * 16
    assert same_codes(codes, to_fp8(x, scale))


@pytest.fixture(scope="module")
def rope_write(built_or_skip):
    return cpu.rope.RopeKernel(built_or_skip(cpu.rope, "the CPU rope op"))


@pytest.fixture(scope="module")
def decode_kernel(built_or_skip):
    return cpu.decode.DecodeKernel(built_or_skip(cpu.decode, "the CPU decode kernel"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 0.5, 3.0, 0.37])
def test_c_write_conversion_is_torchs(rope_write, dtype, scale):
    """rope.c's float -> E4M3 over every input of interest, through the value rows it
    stores (and the key rows, the same values rotated by cos 1 and sin 0: equal but where
    inf * 0 makes a NaN)."""
    from batchinfer.model.rope import apply_rotary
    x = conversion_inputs().to(dtype)
    head_dim = 32
    rows = x.numel() // head_dim
    v = x[:rows * head_dim].view(rows, 1, head_dim)
    qk = torch.cat([torch.zeros_like(v), v], dim=1)
    cos, sin = torch.ones(rows, head_dim, dtype=dtype), torch.zeros(rows, head_dim, dtype=dtype)
    k_cache = torch.zeros(rows, 1, 1, head_dim, dtype=FP8)
    v_cache = torch.zeros_like(k_cache)
    rope_write(qk, v, cos, sin, torch.arange(rows), k_cache, v_cache, scale, scale)
    assert same_codes(v_cache.view(rows, 1, head_dim), to_fp8(v, scale))
    assert same_codes(k_cache.view(rows, 1, head_dim),
                      to_fp8(apply_rotary(qk, cos[:, None], sin[:, None])[:, 1:], scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 48, 64])  # bfloat16 rows split even/odd at 32, 64
@pytest.mark.parametrize("v_scale", [1.0, 3.0])
def test_c_read_conversion_is_torchs(decode_kernel, dtype, head_dim, v_scale):
    """decode.c's E4M3 -> float over all 256 codes: sequences of one key, whose output is
    its value row (times v_scale, rounded to the query's type)."""
    n = -(-256 // head_dim)
    codes = torch.zeros(n * head_dim, dtype=torch.uint8)
    codes[:256] = torch.arange(256, dtype=torch.uint8)
    v_cache = codes.view(n, 1, 1, head_dim).view(FP8)
    k_cache = torch.zeros_like(v_cache)
    query = torch.randn(n, 2, head_dim).to(dtype)
    out = torch.empty_like(query)
    decode_kernel(query, k_cache, v_cache, torch.arange(n, dtype=torch.int32)[:, None],
                  torch.zeros(n, dtype=torch.int32), torch.ones(n, dtype=torch.int32), SCALE,
                  out, None, None, 2.0, v_scale)
    want = (read_fp8(v_cache, v_scale).view(n, 1, head_dim)).to(dtype).expand(n, 2, head_dim)
    assert torch.equal(out.float().nan_to_num(7.0), want.float().nan_to_num(7.0))


# ---- Triton kernels (under the interpreter on CPU) ------------------------------------------

# (dtype, block size, head_dim, GQA ratio, sliding window)
TRITON_CASES = [(torch.float32, 16, 64, 4, None), (torch.bfloat16, 8, 48, 1, 20),
                (torch.float16, 32, 80, 8, None)]


@pytest.mark.parametrize("case", TRITON_CASES, ids=str)
def test_triton_write(paged_batch, case):
    dtype, block_size, head_dim, group, _ = case
    b = paged_batch([3, 19], [3, 11], block_size=block_size, num_kv_heads=2, group=group,
                    head_dim=head_dim, dtype=dtype, cache_dtype=FP8)
    slots = b.meta.slot_mapping.clone()
    slots[1] = -1  # padding tokens carry slot -1 and are not stored
    key, value = b.key * 7, b.value * 0.01  # values that differ from what the cache holds
    before = b.k_cache.clone()
    expected = (b.k_cache.clone(), b.v_cache.clone())
    ref_write_kv(key, value, *expected, slots, 0.37, V_SCALE)
    write_kv(key, value, b.k_cache, b.v_cache, slots, 0.37, V_SCALE)
    assert same_codes(b.k_cache, expected[0]) and same_codes(b.v_cache, expected[1])
    assert not same_codes(b.k_cache, before)


@pytest.mark.parametrize("case", TRITON_CASES, ids=str)
def test_triton_decode(paged_batch, case):
    dtype, block_size, head_dim, group, window = case
    b = paged_batch([1, 14, 37, 50], [1] * 4, block_size=block_size, num_kv_heads=2,
                    group=group, head_dim=head_dim, dtype=dtype)
    k_read, v_read = as_fp8(b)
    m = b.meta
    ref = ref_decode_attention(b.query, k_read, v_read, m.block_tables, m.seq_lens, SCALE,
                               window)
    for num_splits in (1, 3):  # one split; three (some empty) merged by the reduction kernel
        out = paged_decode_attention(b.query, b.k_cache, b.v_cache, m.block_tables, m.seq_lens,
                                     SCALE, window, num_splits=num_splits, block_n=16,
                                     k_scale=K_SCALE, v_scale=V_SCALE)
        torch.testing.assert_close(out.float(), ref, **TOLERANCES[dtype])


@pytest.mark.parametrize("case", TRITON_CASES, ids=str)
def test_triton_prefill(paged_batch, case):
    dtype, block_size, head_dim, group, window = case
    b = paged_batch([1, 14, 37, 50], [1, 5, 37, 3], block_size=block_size, num_kv_heads=2,
                    group=group, head_dim=head_dim, dtype=dtype)
    k_read, v_read = as_fp8(b)
    m = b.meta
    ref = ref_prefill_attention(b.query, k_read, v_read, m.block_tables, m.seq_lens,
                                m.query_start_loc, SCALE, window)
    out = paged_prefill_attention(b.query, b.k_cache, b.v_cache, m.block_tables, m.seq_lens,
                                  m.query_start_loc, SCALE, window, block_m=32, block_n=16,
                                  k_scale=K_SCALE, v_scale=V_SCALE)
    torch.testing.assert_close(out.float(), ref, **TOLERANCES[dtype])


def test_triton_refuses_mixed_cache_dtypes(paged_batch):
    b = paged_batch([4], [1], block_size=8, num_kv_heads=1, group=1, head_dim=16,
                    dtype=torch.float32)
    with pytest.raises(ValueError, match="K and V caches differ"):
        paged_decode_attention(b.query, b.k_cache.to(FP8), b.v_cache, b.meta.block_tables,
                               b.meta.seq_lens, SCALE)


# ---- C kernels --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(8, 4, 32), (9, 3, 64)])
def test_c_rope_write_is_the_torch_paths(rope_write, dtype, num_heads, num_kv_heads, head_dim):
    """The rotated k and v written as E4M3 with their scales: the codes torch's path
    writes (attention.torch_backend.write_kv after the rotation), the other slots untouched."""
    from batchinfer.model.rope import RotaryEmbedding, apply_rotary
    gen = torch.Generator().manual_seed(head_dim)
    num_tokens = 21
    qkv = (torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
           * 3).to(dtype)
    width = (num_heads + num_kv_heads) * head_dim
    qk = qkv[:, :width].view(num_tokens, num_heads + num_kv_heads, head_dim)
    v = qkv[:, width:].view(num_tokens, num_kv_heads, head_dim)
    rope = RotaryEmbedding(head_dim, 4096, {"rope_theta": 10000.0, "rope_type": "default"},
                           dtype)
    cos, sin = rope.lookup(torch.randint(0, 4096, (num_tokens,), generator=gen))
    shape = (4, 16, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan")).to(FP8)
    v_cache = torch.full(shape, float("nan")).to(FP8)
    slots = torch.randperm(64, generator=gen)[:num_tokens]
    rotated = apply_rotary(qk, cos, sin)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    torch_write_kv(rotated[:, num_heads:], v, k_ref, v_ref, slots, 0.37, V_SCALE)
    q = rope_write(qk, v, cos, sin, slots, k_cache, v_cache, 0.37, V_SCALE)
    assert torch.equal(q, rotated[:, :num_heads])
    assert same_codes(k_cache, k_ref) and same_codes(v_cache, v_ref)
    written = k_cache.view(-1, num_kv_heads, head_dim)[slots]
    assert same_codes(written, to_fp8(rotated[:, num_heads:], 0.37))
    assert int(k_cache.float().isnan().all(-1).all(-1).sum()) == 64 - num_tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads, group, head_dim, block_size", [
    (4, 2, 32, 16), (3, 3, 64, 16), (1, 3, 256, 16), (5, 1, 48, 32), (1, 1, 16, 8)])
def test_c_decode(decode_kernel, paged_batch, dtype, num_kv_heads, group, head_dim, block_size):
    seq_lens = [1, 15, 16, 17, 33, 100, 257]
    b = paged_batch(seq_lens, [1] * len(seq_lens), block_size=block_size,
                    num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, dtype=dtype,
                    device=CPU)
    k_read, v_read = as_fp8(b)
    assert cpu.decode.supports(b.query, num_kv_heads, FP8)
    n = len(seq_lens)
    for window in (None, 20):  # whole contexts; ranges starting mid-block
        hi = torch.tensor(seq_lens, dtype=torch.int32)
        lo = (hi - window).clamp(min=0) if window else torch.zeros_like(hi)
        out = torch.empty_like(b.query)
        decode_kernel(b.query, b.k_cache, b.v_cache, b.meta.block_tables, lo, hi, SCALE, out,
                      None, None, K_SCALE, V_SCALE)
        ref = ref_decode_attention(b.query, k_read, v_read, b.meta.block_tables,
                                   b.meta.seq_lens, SCALE, window)
        torch.testing.assert_close(out.float(), ref, **TOLERANCES[dtype])
    # a partial result over keys [0, mid) merged in: attention over [0, hi)
    mid = torch.tensor([min(16, s - 1) for s in seq_lens], dtype=torch.int32)
    first, first_lse = torch.empty_like(b.query), torch.empty(n, b.query.shape[1])
    decode_kernel(b.query, b.k_cache, b.v_cache, b.meta.block_tables, torch.zeros_like(mid),
                  mid, SCALE, first, first_lse, None, K_SCALE, V_SCALE)
    out = torch.empty_like(b.query)
    init = (first.view(n, num_kv_heads, group, head_dim), first_lse.view(n, num_kv_heads, group))
    decode_kernel(b.query, b.k_cache, b.v_cache, b.meta.block_tables, mid, hi, SCALE, out, None,
                  init, K_SCALE, V_SCALE)
    ref = ref_decode_attention(b.query, k_read, v_read, b.meta.block_tables, b.meta.seq_lens,
                               SCALE)
    torch.testing.assert_close(out.float(), ref, **TOLERANCES[dtype])


@pytest.fixture(scope="module", params=["float32 form", "bfloat16 dot form"])
def prefill_kernel(built_or_skip, request):
    kernel = cpu.prefill.PrefillKernel(built_or_skip(cpu.prefill, "the CPU prefill kernel"))
    kernel.bf16_dot = request.param == "bfloat16 dot form"  # on FMAs without AVX512-BF16
    return kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads, group, head_dim", [(2, 4, 64), (1, 3, 32), (2, 1, 48)])
def test_c_prefill(prefill_kernel, paged_batch, dtype, num_kv_heads, group, head_dim):
    """Prompts, chunks after earlier context, and chunks long enough for the bfloat16
    micro-kernel (keys x head_dim past DOT_MIN_KEY_ELEMENTS); then the same queries merged
    with a partial result over other keys."""
    seq_lens, query_lens = [5, 40, 1, 600, 70], [5, 17, 1, 560, 1]
    b = paged_batch(seq_lens, query_lens, block_size=16, num_kv_heads=num_kv_heads,
                    group=group, head_dim=head_dim, dtype=dtype, device=CPU)
    k_read, v_read = as_fp8(b)
    assert cpu.prefill.supports(b.query, num_kv_heads, FP8)
    m = b.meta
    qsl, lens = m.query_start_loc_cpu, m.seq_lens_cpu

    def chunks(lo):
        return torch.tensor([[i, qsl[i], qsl[i + 1], lo[i], lens[i]] for i in range(len(lens))],
                            dtype=torch.int32)

    out = torch.full(b.query.shape, float("nan"), dtype=dtype)
    prefill_kernel(b.query, b.k_cache, b.v_cache, m.block_tables, chunks([0] * 5), SCALE, out,
                   None, None, K_SCALE, V_SCALE)
    ref = ref_prefill_attention(b.query, k_read, v_read, m.block_tables, m.seq_lens,
                                m.query_start_loc, SCALE)
    torch.testing.assert_close(out.float(), ref, **TOLERANCES[dtype])
    # the chunks' first 16 keys as a partial result to start from (as a cascade's shared
    # prefix is), where they all lie before the chunk
    first = [lens[i] - (qsl[i + 1] - qsl[i]) >= 16 for i in range(5)]
    init = first_keys_attention(b.query, k_read, v_read, m, first, 16, dtype)
    out = torch.full(b.query.shape, float("nan"), dtype=dtype)
    prefill_kernel(b.query, b.k_cache, b.v_cache, m.block_tables,
                   chunks([16 if f else 0 for f in first]), SCALE, out, None, init, K_SCALE,
                   V_SCALE)
    torch.testing.assert_close(out.float(), ref, **TOLERANCES[dtype])


def first_keys_attention(query, k_read, v_read, meta, take, n, dtype):
    """(out [T, Hkv, G, D] in dtype, lse [T, Hkv, G]) of the queries of each sequence i with
    take[i] over its first n keys (no mask: they precede its queries); lse -inf elsewhere."""
    num_kv_heads, head_dim = k_read.shape[2], k_read.shape[3]
    t, group = query.shape[0], query.shape[1] // num_kv_heads
    out = torch.zeros(t, num_kv_heads, group, head_dim, dtype=dtype)
    lse = torch.full((t, num_kv_heads, group), float("-inf"))
    qsl = meta.query_start_loc_cpu
    pos = torch.arange(n)
    for i, use in enumerate(take):
        if not use:
            continue
        slots = meta.block_tables[i, pos // meta.block_size].long() * meta.block_size \
            + pos % meta.block_size
        k = k_read.view(-1, num_kv_heads, head_dim)[slots].double()
        v = v_read.view(-1, num_kv_heads, head_dim)[slots].double()
        q = query[qsl[i]:qsl[i + 1]].double().view(-1, num_kv_heads, group, head_dim)
        scores = torch.einsum("lhgd,nhd->lhgn", q, k) * SCALE
        lse[qsl[i]:qsl[i + 1]] = scores.logsumexp(-1).float()
        out[qsl[i]:qsl[i + 1]] = torch.einsum("lhgn,nhd->lhgd", scores.softmax(-1), v).to(dtype)
    return out, lse


@pytest.fixture(scope="module")
def shared_prefix_kernel(built_or_skip):
    kernel = cpu.shared_prefix.SharedPrefixKernel(
        built_or_skip(cpu.shared_prefix, "the shared-prefix kernel"))
    kernel.use_bf16 = True  # on FMAs without AVX512-BF16
    return kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, keys, kv_heads, group, head_dim", [
    (7, 64, 2, 3, 48), (37, 513, 3, 3, 64), (5, 100, 1, 2, 256)])
def test_c_shared_prefix(shared_prefix_kernel, dtype, tokens, keys, kv_heads, group, head_dim):
    gen = torch.Generator().manual_seed(keys)
    q = (torch.randn(tokens, kv_heads * group, head_dim, generator=gen) * 3).to(dtype)
    k = to_fp8(torch.randn(keys, kv_heads, head_dim, generator=gen), K_SCALE)
    v = to_fp8(torch.randn(keys, kv_heads, head_dim, generator=gen), V_SCALE)
    out, lse = shared_prefix_kernel(q, k, v, SCALE, K_SCALE, V_SCALE)
    kr, vr = read_fp8(k, K_SCALE).double(), read_fp8(v, V_SCALE).double()
    s = torch.einsum("thgd,phd->thgp", q.double().view(tokens, kv_heads, group, head_dim),
                     kr) * SCALE
    want = torch.einsum("thgp,phd->thgd", torch.softmax(s, -1), vr)
    torch.testing.assert_close(lse.double(), s.logsumexp(-1), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.double(), want, **TOLERANCES[dtype])


def test_wrappers_take_fp8_caches_only_as_caches(decode_kernel):
    query = torch.zeros(1, 4, 32)
    assert decode_kernel.supports(torch.float32, 4, 2, 32, FP8)
    assert decode_kernel.supports(torch.bfloat16, 4, 2, 32, FP8)
    assert not decode_kernel.supports(torch.float16, 4, 2, 32, FP8)
    assert not decode_kernel.supports(FP8, 4, 2, 32)  # queries are never FP8
    assert cpu.rope.supports(torch.zeros(1, 6, 32), FP8)
    assert not cpu.rope.supports(torch.zeros(1, 6, 32), torch.float16)
    assert cpu.prefill.supports(query, 2, FP8) and cpu.shared_prefix.supports(query, 2, FP8)
    cache = torch.zeros(2, 16, 2, 32, dtype=FP8)
    with pytest.raises(ValueError, match="out of contract"):  # K and V of different types
        decode_kernel(query, cache, cache.float(), torch.zeros(1, 2, dtype=torch.int32),
                      torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                      SCALE, torch.empty_like(query), None)
