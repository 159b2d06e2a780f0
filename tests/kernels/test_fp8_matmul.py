"""The FP8 products' Triton kernels against float64 references (under the interpreter on
CPU): activation quantization to the bit, W8A8 against the product of the dequantized
operands, W8A16 against x times the dequantized weight.

The shape x group x dtype x bias matrix is covered pairwise, as in test_attention_kernels.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from batchinfer.kernels.triton.fp8_matmul import (
    linear, quantize_activations, select_path, w8a8_matmul, w8a16_matmul)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP8 = torch.float8_e4m3fn
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# A result's own rounding to its dtype, relative (the interpreter truncates float32 to
# bfloat16: up to one unit in the last place, not half) ...
ROUNDING = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -22}
# ... plus float32 accumulation, relative to the sum of the products' magnitudes: at most
# K * 2^-24 in theory (576 * 6e-8 = 3.4e-5), far less in practice. Hopper's FP8 tensor
# cores add a slice's 128 products with about 14 bits: more slack on a GPU.
ACCUMULATION = 2e-4 if DEVICE.type == "cuda" else 1e-5

# Quantized activations and FP8 products need FP8 tensor cores on a GPU (not under the
# interpreter, which emulates them).
needs_fp8 = pytest.mark.skipif(
    DEVICE.type == "cuda" and torch.cuda.get_device_capability() < (8, 9),
    reason="FP8 activations need compute capability 8.9 or above")

FACTORS = ((1, 5, 33), (128, 576), (96, 200), (128, "K"), ("bfloat16", "float16"),
           (False, True))
# (M, K, N, group_size, dtype, bias): a pairwise-covering subset. K = 576 has a partial
# last group of 64 columns; M = 33 and N = 200 end in partial tiles.
CASES = [
    (1, 128, 200, 128, "bfloat16", False), (1, 576, 96, "K", "float16", True),
    (5, 128, 96, 128, "float16", True), (5, 128, 200, "K", "float16", False),
    (5, 576, 96, 128, "bfloat16", False), (33, 128, 200, 128, "bfloat16", True),
    (33, 576, 96, "K", "float16", False), (33, 576, 200, "K", "bfloat16", True),
]


def test_cases_cover_every_pair():
    covered = {(i, case[i], j, case[j]) for case in CASES
               for i, j in itertools.combinations(range(len(FACTORS)), 2)}
    for (i, a), (j, b) in itertools.combinations(enumerate(FACTORS), 2):
        for x, y in itertools.product(a, b):
            assert (i, x, j, y) in covered, (x, y)


def _expand(scale: torch.Tensor, group_size: int, k: int) -> torch.Tensor:
    return scale.repeat_interleave(group_size, dim=1)[:, :k]


def _group_amax(x: torch.Tensor, group_size: int) -> torch.Tensor:
    k = x.shape[1]
    return torch.stack([x[:, g:g + group_size].abs().amax(dim=1)
                        for g in range(0, k, group_size)], dim=1)


def ref_quantize(x, group_size, input_scale=None, scale_ub=None):
    """The float32 recipe quantize_activations follows, in torch."""
    xf = x.float().cpu()
    if input_scale is not None:
        scale = torch.full((x.shape[0], -(-x.shape[1] // group_size)), float(input_scale))
    else:
        amax = _group_amax(xf, group_size)
        if scale_ub is not None:
            amax = amax.clamp(max=scale_ub)
        scale = amax.clamp(min=1e-10) / 448.0
    q = (xf / _expand(scale, group_size, x.shape[1])).clamp(-448.0, 448.0).to(FP8)
    return q, scale


def _weight(n: int, k: int, group_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A float8 weight and its [N, G] scales, each group's magnitude its own."""
    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // group_size)
    spread = torch.exp(torch.randn(n, groups, generator=gen))
    w = torch.randn(n, k, generator=gen) * _expand(spread, group_size, k)
    scale = _group_amax(w, group_size) / 448.0
    q = (w / _expand(scale, group_size, k)).clamp(-448.0, 448.0).to(FP8)
    return q.to(DEVICE), scale.to(DEVICE)


def _dequant(q: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    return q.cpu().double() * _expand(scale.cpu().double(), group_size, q.shape[1])


def _padded(x: torch.Tensor) -> torch.Tensor:
    """x as a view with NaN past each row, so a kernel that reads past K fails."""
    m, k = x.shape
    if x.dtype == FP8:
        big = torch.full((m, k + 8), 0x7F, dtype=torch.uint8)  # float8_e4m3fn's NaN
        big[:, :k] = x.cpu().view(torch.uint8)
        return big.view(FP8).to(DEVICE)[:, :k]
    big = torch.full((m, k + 8), float("nan"), dtype=x.dtype)
    big[:, :k] = x.cpu()
    return big.to(DEVICE)[:, :k]


def _inputs(m, k, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.exp(torch.randn(m, 1, generator=gen))
    return _padded(x.to(dtype))


def assert_tight(got, ref, magnitude, dtype):
    """got within its own rounding and float32 accumulation of the float64 ref."""
    err = (got.cpu().double() - ref).abs()
    bound = ROUNDING[dtype] * ref.abs() + ACCUMULATION * magnitude
    worst = (err - bound).argmax()
    assert (err <= bound).all(), (err.flatten()[worst], bound.flatten()[worst])


@needs_fp8
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("group", [128, "K"])
@pytest.mark.parametrize("mode", ["dynamic", "scale_ub", "static"])
def test_quantize_matches_torch(mode, group, dtype):
    x = _inputs(33, 576, DTYPES[dtype], seed=1).cpu()
    x[0] *= 100.0                  # past the bound on the maximum
    x[1] = 0.0                     # all zeros: the 1e-10 floor
    x[2, :200] = 0.0               # group_size 128: a zero group, a partial one
    group_size = 576 if group == "K" else group
    kwargs = dict(dynamic={}, scale_ub=dict(scale_ub=3.0),
                  static=dict(input_scale=torch.tensor(0.004)))[mode]
    q, scale = quantize_activations(_padded(x), group_size, **kwargs)
    ref_q, ref_scale = ref_quantize(x, group_size,
                                    input_scale=kwargs.get("input_scale"),
                                    scale_ub=kwargs.get("scale_ub"))
    assert q.dtype == FP8 and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == ref_scale.shape
    assert torch.equal(scale.cpu(), ref_scale)
    assert torch.equal(q.cpu().view(torch.uint8), ref_q.view(torch.uint8))
    if mode != "dynamic":
        # the bound or the static scale clamps some values at +-448
        assert (q.cpu().float().abs() == 448.0).sum() > 1


@needs_fp8
def test_quantize_rounds_to_nearest_even_at_every_step():
    # Every float8 value's neighbourhood: the midpoints to the next value (ties) and the
    # float32 values just beside them, subnormals included, both signs, and values past 448.
    grid = torch.arange(0, 127, dtype=torch.uint8).view(FP8).float()  # 0 .. 448
    mid = (grid[:-1] + grid[1:]) / 2
    near = torch.cat([mid, torch.nextafter(mid, grid[1:]), torch.nextafter(mid, grid[:-1]),
                      grid, torch.tensor([448.5, 464.0, 1e4, 2.0 ** -11, 0.0])])
    x = torch.cat([near, -near]).view(1, -1)
    k = x.shape[1]
    q, scale = quantize_activations(x.to(DEVICE), k, input_scale=1.0)
    ref_q = x.clamp(-448.0, 448.0).to(FP8)
    assert torch.equal(q.cpu().view(torch.uint8), ref_q.view(torch.uint8))
    assert float(scale) == 1.0
    # a tie rounds to the even mantissa: 1 + 1/16 -> 1, 1 + 3/16 -> 1.25; -0 stays -0
    q, _ = quantize_activations(torch.tensor([[1.0625, 1.1875, -0.0, 3 * 2.0 ** -10]],
                                             device=DEVICE), 4, input_scale=1.0)
    assert q.cpu().float().tolist()[0] == [1.0, 1.25, 0.0, 2.0 ** -8]
    assert q.cpu().view(torch.uint8)[0, 2] == 0x80


# float32 bits: NaN of either sign and payload, +-inf, +-the largest float, +-448, 1.
SPECIALS = [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x7F800000, 0xFF800000,
            0x7F7FFFFF, 0xFF7FFFFF, 0x43E00000, 0xC3E00000, 0x3F800000]


def _from_bits(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


# (the interpreter's numpy warns of the overflows and NaN quotients)
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@needs_fp8
@pytest.mark.parametrize("input_scale", [1.0, 0.5, 3.0, None], ids=str)
def test_quantize_special_values(input_scale):
    """NaN stays NaN (0x7f, 0xff), never +-448 as a clamp that drops NaN makes it;
    infinities and huge values saturate to +-448; bits as torch's conversion on the same
    device. Dynamic (None): one row per special beside ordinary values, so a row
    with an infinity gets an infinite scale (its finite values 0, the infinity NaN) and
    one with the largest float a huge one."""
    specials = _from_bits(SPECIALS)
    if input_scale is None:
        x = torch.tensor([1.0, -2.0, 0.5]).repeat(len(SPECIALS), 6)
        x[:, 5] = specials
        x = x[~specials.isnan()]  # NaN rows: the next test
    else:
        x = specials.repeat(2, 3)
    q, scale = quantize_activations(x.to(DEVICE), x.shape[1], input_scale=input_scale)
    xd = x.to(DEVICE)
    if input_scale is None:
        ref_scale = xd.abs().amax(dim=1, keepdim=True).clamp(min=1e-10) / 448.0
        assert torch.equal(scale, ref_scale)
        ref = (xd / ref_scale).clamp(-448.0, 448.0).to(FP8)
    else:
        ref = (xd / input_scale).clamp(-448.0, 448.0).to(FP8)
    assert torch.equal(q.view(torch.uint8), ref.view(torch.uint8))
    if input_scale is not None:
        # NaN codes (a GPU's division may give every NaN one sign, as torch's there does)
        assert [c & 0x7F for c in q.view(torch.uint8)[0, :4].tolist()] == [0x7F] * 4


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@needs_fp8
@pytest.mark.parametrize("bits", [0x7FC00000, 0xFFC00000], ids=hex)
def test_a_nan_activation_stays_nan(bits):
    """A NaN among a token's activations stays NaN through the dynamic quantization (not
    -448 or 448 in its place), whatever its group's scale (a maximum that may pass NaN by);
    the other tokens are untouched."""
    x = _inputs(3, 128, torch.bfloat16, seed=4)
    x[1, 17] = _from_bits([bits])[0]
    q, _ = quantize_activations(x, 128)
    assert q[1, 17].float().isnan()
    assert not q[[0, 2]].float().isnan().any()


@needs_fp8
@pytest.mark.parametrize("case", CASES, ids=str)
def test_w8a8_matches_the_dequantized_product(case):
    m, k, n, group, dtype, has_bias = case
    dtype = DTYPES[dtype]
    group_size = k if group == "K" else group
    x = _inputs(m, k, dtype, seed=m + k)
    weight, weight_scale = _weight(n, k, group_size, seed=n)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype) \
        if has_bias else None
    x_fp8, x_scale = quantize_activations(x, group_size)
    got = w8a8_matmul(_padded(x_fp8), x_scale, weight, weight_scale, group_size, dtype, bias)
    assert got.dtype == dtype and got.shape == (m, n)
    w = _dequant(weight, weight_scale, group_size)
    xq = _dequant(x_fp8, x_scale, group_size)
    b = bias.cpu().double() if has_bias else torch.zeros(n, dtype=torch.float64)
    # tight: the product of what the kernel was given
    assert_tight(got, xq @ w.T + b, xq.abs() @ w.abs().T + b.abs(), dtype)
    # loose: x itself, through the activations' 3-bit mantissas (about 2.5% in norm)
    exact = x.cpu().double() @ w.T + b
    assert (got.cpu().double() - exact).norm() < 0.06 * exact.norm()
    # linear quantizes the same way; under the interpreter it takes this very path
    y = linear(x, weight, weight_scale, group_size, bias=bias)
    if DEVICE.type == "cpu":
        assert torch.equal(y, got)
    else:
        assert_tight(y, xq @ w.T + b, xq.abs() @ w.abs().T + b.abs(), dtype)


# float32 x; K = 200 ends in a partial BLOCK_K slice (the interpreter's W8A8 tiles meet one
# at K = 576)
@pytest.mark.parametrize("case", CASES + [(5, 576, 96, 128, "float32", True),
                                          (5, 200, 96, "K", "bfloat16", True)], ids=str)
def test_w8a16_matches_x_times_the_dequantized_weight(case):
    m, k, n, group, dtype, has_bias = case
    dtype = DTYPES[dtype]
    group_size = k if group == "K" else group
    x = _inputs(m, k, dtype, seed=m + k)
    weight, weight_scale = _weight(n, k, group_size, seed=n)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype) \
        if has_bias else None
    got = w8a16_matmul(x, weight, weight_scale, group_size, bias)
    assert got.dtype == dtype and got.shape == (m, n)
    w = _dequant(weight, weight_scale, group_size)
    xd = x.cpu().double()
    b = bias.cpu().double() if has_bias else torch.zeros(n, dtype=torch.float64)
    assert_tight(got, xd @ w.T + b, xd.abs() @ w.abs().T + b.abs(), dtype)


def test_w8a16_widens_every_float8_value_exactly():
    # weight row j holds the finite float8 values shifted by j; x = I picks them out
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    k = codes.numel()  # 254
    rows = torch.stack([codes.roll(j) for j in range(16)])
    weight = rows.view(FP8).to(DEVICE)
    eye = torch.eye(k, dtype=torch.bfloat16, device=DEVICE)
    got = w8a16_matmul(eye, weight, torch.ones(16, 1, device=DEVICE), k)
    assert torch.equal(got.cpu().float(), rows.view(FP8).float().T)


@needs_fp8
def test_linear_with_a_static_input_scale():
    m, k, n, group_size = 5, 576, 96, 128
    x = _inputs(m, k, torch.bfloat16, seed=4)
    weight, weight_scale = _weight(n, k, group_size, seed=5)
    input_scale = torch.tensor(float(x.abs().max()) / 448.0)
    got = linear(x, weight, weight_scale, group_size, input_scale=input_scale)
    x_fp8, x_scale = quantize_activations(x, group_size, input_scale=input_scale)
    assert torch.equal(x_scale.cpu(), torch.full((m, 5), float(input_scale)))
    if DEVICE.type == "cpu":
        assert torch.equal(got, w8a8_matmul(x_fp8, x_scale, weight, weight_scale, group_size,
                                            torch.bfloat16))
    exact = x.cpu().double() @ _dequant(weight, weight_scale, group_size).T
    # one scale for all tokens: small tokens keep fewer bits
    assert (got.cpu().double() - exact).norm() < 0.1 * exact.norm()
    # leading dimensions are kept
    assert linear(x.view(1, m, k), weight, weight_scale, group_size,
                  input_scale=input_scale).shape == (1, m, n)


# select_path's choice by compute capability (rows) and x's dtype (columns), for
# per-channel scales and 16-aligned K and N. torch._scaled_mm's row-wise scaling writes
# bfloat16 only, and has no kernel for 8.9 in the torch versions batchinfer supports.
PATHS = {
    #          bfloat16     float16  float32
    (7, 5):  ("w8a16",     "w8a16", "w8a16"),
    (8, 0):  ("w8a16",     "w8a16", "w8a16"),
    (8, 6):  ("w8a16",     "w8a16", "w8a16"),
    (8, 9):  ("w8a8",      "w8a8",  "w8a8"),
    (9, 0):  ("scaled_mm", "w8a8",  "w8a8"),
    (10, 0): ("scaled_mm", "w8a8",  "w8a8"),
    (12, 0): ("w8a8",      "w8a8",  "w8a8"),
}


@pytest.mark.parametrize("capability", PATHS, ids=str)
def test_select_path_by_capability_and_dtype(capability):
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    got = tuple(select_path(capability, dtype, 4096, 4096, 1) for dtype in dtypes)
    assert got == PATHS[capability]


def test_select_path_needs_per_channel_scales_and_aligned_shapes():
    bf16 = torch.bfloat16
    assert select_path((9, 0), bf16, 4096, 4096, 32) == "w8a8"      # block scales
    assert select_path((9, 0), bf16, 200, 4096, 1) == "w8a8"        # N not 16-aligned
    assert select_path((9, 0), bf16, 4096, 4104, 1) == "w8a8"       # K not 16-aligned
    assert select_path((8, 0), bf16, 4096, 4096, 32) == "w8a16"
    assert select_path(None, bf16, 4096, 4096, 1) == "w8a8"         # the interpreter


def test_wrong_scale_shapes_are_refused():
    weight, weight_scale = _weight(96, 576, 128, seed=0)
    x = torch.randn(3, 576, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="weight_scale"):
        linear(x, weight, weight_scale[:, :4], 128)
    with pytest.raises(ValueError, match="weight_scale"):
        w8a16_matmul(x, weight, weight_scale, 576)
    with pytest.raises(ValueError, match="multiple of 32"):
        w8a16_matmul(x, weight, torch.ones(96, 29, device=DEVICE), 20)
