"""Weight-only FP8 linear products on CPUs (kernels/cpu/fp8_linear.c and the tiled torch
path of kernels/cpu/fp8_linear.py) against x @ dequant(W)^T computed in float64."""
from __future__ import annotations

import pytest
import torch

from batchinfer.kernels.cpu import fp8_linear

# Error bounds, as a share of sum_k |x[m, k] W[n, k]| + |bias[n]|: float32 accumulation; for
# bfloat16 the output's rounding, and on the tiled path W's rounding to bfloat16 as well.
TOLERANCE = {torch.float32: 2e-6, torch.float16: 2 ** -9, torch.bfloat16: 2 ** -7}


@pytest.fixture(scope="module")
def kernel(built_or_skip):
    return fp8_linear.Fp8LinearKernel(built_or_skip(fp8_linear, "the fp8 linear kernel"))


@pytest.fixture
def path(request, monkeypatch):
    """Pins linear() to one path: "kernel" (the C kernel for every row count, the tiled path
    failing the test), or "tiled" (never the kernel; needs no compiler)."""
    def fail(*args, **kwargs):
        raise AssertionError("the other path ran")
    if request.param == "kernel":
        request.getfixturevalue("kernel")
        monkeypatch.setattr(fp8_linear, "KERNEL_MAX_ROWS", 1 << 30)
        monkeypatch.setattr(fp8_linear, "linear_tiled", fail)
    else:
        monkeypatch.setattr(fp8_linear, "KERNEL_MAX_ROWS", 0)
        monkeypatch.setattr(fp8_linear.Fp8LinearKernel, "__call__", fail)
    return request.param


def quantized(n: int, k: int, group_size: int, seed: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight float8_e4m3fn [n, k], weight_scale float32 [n, ceil(k / group_size)]): random
    bytes across E4M3's range (no NaN), scales spread over 2^-12..2^-4."""
    gen = torch.Generator().manual_seed(seed)
    values = (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448)
    weight = values.to(torch.float8_e4m3fn)
    groups = -(-k // group_size)
    weight_scale = torch.exp2(torch.rand(n, groups, generator=gen) * 8 - 12)
    return weight, weight_scale


def reference(x, weight, weight_scale, group_size, bias=None):
    """(x @ dequant(W)^T + bias, |x| @ |dequant(W)|^T + |bias|), in float64."""
    k = weight.shape[1]
    w = weight.double() * weight_scale.double()[:, torch.arange(k) // group_size]
    x64 = x.double().reshape(-1, k)
    y, scale = x64 @ w.T, x64.abs() @ w.abs().T
    if bias is not None:
        y, scale = y + bias.double(), scale + bias.double().abs()
    return y.reshape(*x.shape[:-1], -1), scale.reshape(*x.shape[:-1], -1)


def assert_matches(out, x, weight, weight_scale, group_size, bias=None):
    expected, scale = reference(x, weight, weight_scale, group_size, bias)
    assert out.dtype == x.dtype and out.shape == expected.shape
    assert torch.isfinite(out).all()
    err = (out.double() - expected).abs()
    bound = TOLERANCE[x.dtype] * scale
    assert (err <= bound).all(), f"worst error {(err / scale).max().item():.3g} of scale"


CASES = [  # rows of x, N, K, group_size, dtype, bias
    (1, 96, 64, 128, torch.float32, False),      # one group, wider than K
    (3, 1000, 576, 128, torch.bfloat16, True),   # 5 groups, the last 64 wide
    (17, 96, 576, 64, torch.float32, True),
    (64, 1000, 64, 64, torch.bfloat16, False),
    (200, 96, 576, 576, torch.bfloat16, True),   # per output channel
    (1, 1000, 576, 576, torch.float32, True),
    (17, 1000, 576, 128, torch.bfloat16, False),
    (200, 1000, 64, 128, torch.float32, True),
    (5, 200, 4104, 128, torch.bfloat16, True),   # K not a multiple of 16; last group 8 wide
    (3, 96, 576, 128, torch.float16, True),
    (3, 96, 100, 7, torch.float32, False),       # groups that are not multiples of 16
]


@pytest.mark.parametrize("path", ["kernel", "tiled"], indirect=True)
@pytest.mark.parametrize("rows,n,k,group_size,dtype,with_bias", CASES, ids=[
    f"{m}x{n}x{k}-g{g}-{str(d)[6:]}{'-bias' if b else ''}" for m, n, k, g, d, b in CASES])
def test_linear_matches_float64(path, monkeypatch, rows, n, k, group_size, dtype, with_bias):
    if path == "tiled":  # tiles of at most 40 rows: several, the last one partial
        monkeypatch.setattr(fp8_linear, "TILE_BYTES", 40 * k * 2)
    weight, weight_scale = quantized(n, k, group_size, seed=rows * n + k)
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    out = fp8_linear.linear(x, weight, weight_scale, group_size, bias)
    assert_matches(out, x, weight, weight_scale, group_size, bias)


@pytest.mark.parametrize("path", ["kernel", "tiled"], indirect=True)
def test_leading_dims_strided_x_and_large_scales(path):
    """x [2, 3, K] taken from a wider tensor (not contiguous), and scales from 2^8 up, where
    the kernel cannot fold 2^120 into the scale."""
    weight, weight_scale = quantized(96, 576, 128, seed=5)
    weight_scale[:8] *= 2 ** 14
    x = torch.randn(2, 3, 700, dtype=torch.bfloat16)[..., 50:626]
    out = fp8_linear.linear(x, weight, weight_scale, 128)
    assert out.shape == (2, 3, 96)
    assert_matches(out, x, weight, weight_scale, 128)


@pytest.mark.parametrize("scale", [1.0, 2.0 ** -20, 512.0])
def test_e4m3_conversion_exact_for_every_finite_byte(kernel, scale):
    """Row n of W holds byte n at column n and zeros elsewhere; x is ones: y[0, n] is byte
    n's value times the scale (a power of two), exactly as torch converts it."""
    codes = torch.arange(256, dtype=torch.uint8)
    finite = (codes & 0x7F) != 0x7F
    weight = torch.diag(codes).view(torch.float8_e4m3fn)
    weight_scale = torch.full((256, 2), scale)
    out = kernel(torch.ones(1, 256), weight, weight_scale, 128)
    expected = codes.view(torch.float8_e4m3fn).float() * scale
    assert finite.sum() == 254
    assert torch.equal(out[0][finite], expected[finite])


def test_tensors_the_kernel_does_not_take_run_the_tiled_path(monkeypatch, kernel):
    monkeypatch.setattr(fp8_linear, "KERNEL_MAX_ROWS", 1 << 30)
    weight, weight_scale = quantized(96, 576, 128, seed=3)
    x = torch.randn(4, 576)
    assert fp8_linear.supports(x, weight, weight_scale, 128)
    e5m2 = weight.float().to(torch.float8_e5m2)
    unsupported = [  # (x, weight, weight_scale)
        (x.double(), weight, weight_scale),
        (x, e5m2, weight_scale),
        (x, weight, weight_scale.bfloat16()),
        (x, weight.t().contiguous().t(), weight_scale),
        (x, weight, weight_scale.t().contiguous().t()),
    ]

    def fail(*args, **kwargs):
        raise AssertionError("the kernel ran")
    monkeypatch.setattr(fp8_linear.Fp8LinearKernel, "__call__", fail)
    for xi, wi, si in unsupported:
        assert not fp8_linear.supports(xi, wi, si, 128)
        out = fp8_linear.linear(xi, wi, si, 128)
        expected, scale = reference(xi, wi, si, 128)
        assert out.dtype == xi.dtype
        assert ((out.double() - expected).abs() <= 2e-6 * scale).all()


def test_shapes_that_do_not_match_are_refused(kernel):
    weight, weight_scale = quantized(96, 576, 128, seed=4)
    x = torch.randn(2, 576)
    assert not fp8_linear.supports(x, weight, weight_scale[:, :1], 128)
    with pytest.raises(ValueError, match="weight_scale is"):
        fp8_linear.linear(x, weight, weight_scale[:, :1], 128)
    with pytest.raises(ValueError, match="out of contract"):
        kernel(x, weight, weight_scale[:, :1], 128)
    with pytest.raises(ValueError, match="does not match"):
        fp8_linear.linear(torch.randn(2, 512), weight, weight_scale, 128)
    with pytest.raises(ValueError, match="group_size"):
        fp8_linear.linear(x, weight, weight_scale, 0)
    with pytest.raises(ValueError, match="bias"):
        fp8_linear.linear(x, weight, weight_scale, 128, torch.zeros(95))


@pytest.mark.parametrize("rows,n,k,group_size,dtype,with_bias", [
    (1, 96, 64, 64, torch.bfloat16, False), (3, 200, 576, 128, torch.float32, True),
    (70, 96, 100, 7, torch.bfloat16, True)])
def test_without_the_kernel_every_row_count_runs_tiled(monkeypatch, rows, n, k, group_size,
                                                       dtype, with_bias):
    """Where the library cannot be built (or BATCHINFER_CPU_KERNELS=0), decode sizes too,
    with torch dequantising the tiles."""
    monkeypatch.setattr(fp8_linear, "_kernel", lambda: None)
    monkeypatch.setattr(fp8_linear, "TILE_BYTES", 40 * k * 6)  # several tiles
    tiled = fp8_linear.linear_tiled
    calls = []
    monkeypatch.setattr(fp8_linear, "linear_tiled", lambda *a: calls.append(1) or tiled(*a))
    weight, weight_scale = quantized(n, k, group_size, seed=6)
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    assert not fp8_linear.available()
    out = fp8_linear.linear(x, weight, weight_scale, group_size, bias)
    assert calls == [1]
    assert_matches(out, x, weight, weight_scale, group_size, bias)


@pytest.mark.parametrize("k,group_size", [(576, 128), (100, 7), (64, 64)])
def test_dequantize_gives_torchs_bits(kernel, k, group_size):
    """The C library's dequantisation of the tiled path: float32 W * scale, rounded once
    to the dtype as torch rounds it, whatever the scale."""
    weight, weight_scale = quantized(37, k, group_size, seed=k)
    weight_scale[:4] *= 2 ** 14
    groups = torch.arange(k) // group_size
    expected = weight.float() * weight_scale[:, groups]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = kernel.dequantize(weight, weight_scale, group_size, dtype)
        assert out.dtype == dtype and torch.equal(out, expected.to(dtype))
