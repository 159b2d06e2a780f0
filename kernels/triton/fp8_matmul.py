"""FP8 linear layers on GPUs: y = x @ dequant(W)^T (+ bias) for FP8 checkpoints.

The weight is float8_e4m3fn [N, K] with float32 scales [N, G], G = ceil(K / group_size):
W[n, k] = weight[n, k] * weight_scale[n, k // group_size]. group_size is 128 for block-scaled
checkpoints (DeepSeek-V3, Qwen3 FP8, llm-compressor's block strategy; the [128, 128] block
scales expanded to one row per output feature) and K for per-channel or per-tensor scales
(G = 1). The last group may be partial (K = 576 with groups of 128).

`linear` chooses a path by the GPU's compute capability (`select_path`):

- 8.9 and above (Ada, Hopper, Blackwell: FP8 tensor cores): the activations are quantized
  to FP8, per token and, for block-scaled weights, per group of group_size columns
  (`quantize_activations`), then multiplied in FP8:
  - per-channel weights with bfloat16 x and K, N multiples of 16 on 9.x and 10.x (Hopper,
    data-centre Blackwell): torch._scaled_mm with row-wise scales (CUTLASS), whose output
    is bfloat16 only, and which has no 8.9 kernel before torch 2.7;
  - otherwise (float16 or float32 x, 8.9, block scales) `w8a8_matmul`: each BLOCK_K slice of a group is multiplied in FP8, and its
    float32 result is scaled by x_scale[m, g] * w_scale[n, g] before it is added up (as
    vLLM's w8a8_block_fp8_matmul does).
- below 8.9 (Ampere, Turing: no FP8 in the tensor cores, and no float8e4nv type in Triton
  there): `w8a16_matmul` reads the weight's bytes as uint8, widens them to x's dtype with
  integer operations, multiplies in x's dtype with float32 accumulation and applies the
  weight scales per group. The activations are not quantized.
- CPU tensors under the Triton interpreter (TRITON_INTERPRET=1, for tests): the FP8 path
  through the Triton kernels (the interpreter emulates FP8); `w8a16_matmul` is called
  directly by its tests.

Two things differ under the interpreter and are handled in the kernels: its float32 ->
float8 cast does not round to nearest even (ties and carries into the exponent come out
wrong), so the activations' E4M3 codes are computed with integer operations, compiled and
interpreted alike (`float_to_fp8`, the FP8 KV cache's conversion, which reads NaN and the
sign before the clamp, so a compiled min/max cannot turn NaN into 448), and stored as
bytes; and it multiplies bfloat16 tiles as raw bits, so the W8A16 kernel's
tiles go to float32 before tl.dot there (`dot_settings`). FP8 tiles in tl.dot are exact
under the interpreter and stay FP8.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import SUPPORTED_DTYPES, dot_settings, is_interpreted, next_power_of_2
from ._paged import float_to_fp8

FP8_MAX: tl.constexpr = tl.constexpr(448.0)  # the largest float8_e4m3fn value
# The smallest absolute maximum a token's group is scaled by, so an all-zero group gets a
# finite scale (vLLM's per-token-group quantization uses the same).
AMAX_EPS: tl.constexpr = tl.constexpr(1e-10)
# float8_e4m3fn bits placed in a float32's exponent and mantissa read 2^(127 - 7) too small.
_E4M3_FROM_F32_BITS: tl.constexpr = tl.constexpr(2.0 ** 120)


@triton.jit
def _e4m3_to_float32(b):
    """float8_e4m3fn bytes (uint8) as float32 with integer operations only: the sign and the
    seven exponent-mantissa bits moved to float32's places, then scaled by 2^120 (exact,
    subnormals included; the NaN bytes 0x7f and 0xff read as 480 and -480)."""
    b = b.to(tl.int32)
    bits = ((b & 0x7F) << 20) | ((b & 0x80) << 24)
    return bits.to(tl.float32, bitcast=True) * _E4M3_FROM_F32_BITS


@triton.jit
def _quantize_kernel(
    q_ptr,             # [M, K] uint8: the float8_e4m3fn result's codes
    scale_ptr,         # [M, G] float32
    x_ptr,             # [M, K]
    static_scale_ptr,  # [1] float32 (STATIC)
    amax_ub_ptr,       # [1] float32 (USE_UB)
    K, group_size,
    stride_xm, stride_xk,
    stride_qm, stride_qk,
    stride_sm, stride_sg,
    STATIC: tl.constexpr,
    USE_UB: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    start = group * group_size
    end = tl.minimum(start + group_size, K)
    x_row = x_ptr + row * stride_xm
    if STATIC:
        scale = tl.load(static_scale_ptr)
    else:
        amax = tl.zeros([BLOCK], tl.float32)
        for k0 in range(start, end, BLOCK):
            k = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_row + k * stride_xk, mask=k < end, other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        group_max = tl.max(amax, 0)
        if USE_UB:
            group_max = tl.minimum(group_max, tl.load(amax_ub_ptr))
        scale = tl.math.div_rn(tl.maximum(group_max, AMAX_EPS), FP8_MAX)
    tl.store(scale_ptr + row * stride_sm + group * stride_sg, scale)
    for k0 in range(start, end, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        k_ok = k < end
        x = tl.load(x_row + k * stride_xk, mask=k_ok, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * stride_qm + k * stride_qk, float_to_fp8(x, scale), mask=k_ok)


@triton.jit
def _w8a8_kernel(
    out_ptr,       # [M, N]
    x_ptr,         # [M, K] float8_e4m3fn
    x_scale_ptr,   # [M, G] float32
    w_ptr,         # [N, K] float8_e4m3fn
    w_scale_ptr,   # [N, G] float32
    bias_ptr,      # [N] (HAS_BIAS)
    M, N, K, group_size,
    stride_xm, stride_xk,
    stride_xsm, stride_xsg,
    stride_wn, stride_wk,
    stride_wsn, stride_wsg,
    stride_om, stride_on,
    PER_GROUP: tl.constexpr,   # G > 1: BLOCK_K divides group_size, scales applied per slice
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    rows = rows.to(tl.int64)
    cols = cols.to(tl.int64)
    x_rows = x_ptr + rows[:, None] * stride_xm
    w_cols = w_ptr + cols[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = tl.load(x_rows + k[None, :] * stride_xk, mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        b = tl.load(w_cols + k[:, None] * stride_wk, mask=col_ok[None, :] & k_ok[:, None],
                    other=0.0)
        # A fresh product per slice: Hopper's FP8 tensor cores add with reduced precision
        # into the accumulator they are given, so at most BLOCK_K products are added there.
        part = tl.dot(a, b)
        if PER_GROUP:
            group = k0 // group_size
            xs = tl.load(x_scale_ptr + rows * stride_xsm + group * stride_xsg, mask=row_ok,
                         other=0.0)
            ws = tl.load(w_scale_ptr + cols * stride_wsn + group * stride_wsg, mask=col_ok,
                         other=0.0)
            part = part * xs[:, None] * ws[None, :]
        acc += part
    if not PER_GROUP:
        xs = tl.load(x_scale_ptr + rows * stride_xsm, mask=row_ok, other=0.0)
        ws = tl.load(w_scale_ptr + cols * stride_wsn, mask=col_ok, other=0.0)
        acc = acc * xs[:, None] * ws[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on,
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _w8a16_kernel(
    out_ptr,       # [M, N] x's dtype
    x_ptr,         # [M, K] float16, bfloat16 or float32
    w_ptr,         # [N, K] uint8: the float8_e4m3fn weight's bytes
    w_scale_ptr,   # [N, G] float32
    bias_ptr,      # [N] (HAS_BIAS)
    M, N, K, group_size,
    stride_xm, stride_xk,
    stride_wn, stride_wk,
    stride_wsn, stride_wsg,
    stride_om, stride_on,
    PER_GROUP: tl.constexpr,   # G > 1: BLOCK_K divides group_size, scales applied per slice
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    rows = rows.to(tl.int64)
    cols = cols.to(tl.int64)
    x_rows = x_ptr + rows[:, None] * stride_xm
    w_cols = w_ptr + cols[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = tl.load(x_rows + k[None, :] * stride_xk, mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        b = tl.load(w_cols + k[:, None] * stride_wk, mask=col_ok[None, :] & k_ok[:, None],
                    other=0)
        # every float8_e4m3fn value is exact in float16 and bfloat16
        b = _e4m3_to_float32(b).to(x_ptr.dtype.element_ty)
        if DOT_F32:
            a, b = a.to(tl.float32), b.to(tl.float32)
        if PER_GROUP:
            ws = tl.load(w_scale_ptr + cols * stride_wsn + (k0 // group_size) * stride_wsg,
                         mask=col_ok, other=0.0)
            acc += tl.dot(a, b, input_precision=DOT_PRECISION) * ws[None, :]
        else:
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    if not PER_GROUP:
        acc = acc * tl.load(w_scale_ptr + cols * stride_wsn, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on,
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _check_device(kernel: object, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.device.type != "cuda" and not is_interpreted(kernel):
            raise ValueError("Triton kernels need CUDA tensors; to run them on CPU set "
                             "TRITON_INTERPRET=1 before batchinfer is imported")


def _num_groups(k: int, group_size: int) -> int:
    if group_size < 1:
        raise ValueError(f"group_size must be positive, got {group_size}")
    return -(-k // group_size)


def _check_x(x: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    if x.dim() != 2 or x.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"x must be a 2-D tensor of {names}, got {x.dtype} {tuple(x.shape)}")


def _check_weight(k: int, weight: torch.Tensor, weight_scale: torch.Tensor,
                  group_size: int) -> None:
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2 or weight.shape[1] != k \
            or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous float8_e4m3fn [N, K={k}] tensor, got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    groups = _num_groups(k, group_size)
    if weight_scale.dtype != torch.float32 \
            or tuple(weight_scale.shape) != (weight.shape[0], groups):
        raise ValueError(f"weight_scale must be float32 [N={weight.shape[0]}, "
                         f"ceil(K / group_size)={groups}], got {weight_scale.dtype} "
                         f"{tuple(weight_scale.shape)}")
    if groups > 1 and group_size % 32 != 0:
        raise ValueError(f"group_size={group_size} must be a multiple of 32 (or at least K)")


def _block_k(k: int, group_size: int, largest: int) -> tuple[int, bool]:
    """(BLOCK_K, PER_GROUP): with several groups a slice must not straddle two, so BLOCK_K
    is the largest power of two dividing group_size, up to `largest`."""
    if _num_groups(k, group_size) == 1:
        return largest, False
    return min(group_size & -group_size, largest), True


def _scalar(value: float | torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """A float or one-element tensor as float32 [1] on `device`, for the kernel to read
    (a tensor already there is not read back to the host)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return value.to(device, torch.float32).reshape(1)
    return torch.tensor([float(value)], dtype=torch.float32, device=device)


def quantize_activations(x: torch.Tensor, group_size: int,
                         input_scale: float | torch.Tensor | None = None,
                         scale_ub: float | torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_fp8 float8_e4m3fn [M, K], x_scale float32 [M, G]), G = ceil(K / group_size):
    x_fp8[m, k] = x[m, k] / x_scale[m, k // group_size] clamped to +-448, rounded to nearest
    (ties to even); group_size >= K gives one scale per token.

    Dynamic (input_scale None): x_scale[m, g] = max(min(max|x[m, group g]|, scale_ub), 1e-10)
    / 448. scale_ub bounds the absolute maximum, not the scale, as fbgemm_fp8's
    activation_scale_ub does in fbgemm and vLLM. Static: every x_scale is input_scale (one
    float32 from the checkpoint); scale_ub does not apply. Divisions are IEEE, so the bits
    equal torch's (x.float() / x_scale).clamp(-448, 448).to(torch.float8_e4m3fn).

    Grid: one program per (token, group), walking its group BLOCK columns at a time, twice
    when dynamic (maximum, then quantize).
    """
    _check_x(x, SUPPORTED_DTYPES)
    _check_device(_quantize_kernel, x)
    m, k = x.shape
    groups = _num_groups(k, group_size)
    group_size = min(group_size, k)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, scale.zero_()
    static = _scalar(input_scale, x.device)
    ub = _scalar(scale_ub, x.device)
    largest = 128 if is_interpreted(_quantize_kernel) else 1024
    codes = q.view(torch.uint8)
    _quantize_kernel[(m, groups)](
        codes, scale, x, static if static is not None else scale, ub if ub is not None else scale,
        k, group_size, *x.stride(), *codes.stride(), *scale.stride(),
        STATIC=static is not None, USE_UB=ub is not None and static is None,
        BLOCK=min(next_power_of_2(group_size), largest), num_warps=4,
    )
    return q, scale


def w8a8_matmul(x_fp8: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                weight_scale: torch.Tensor, group_size: int, out_dtype: torch.dtype,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """y[m, n] = sum_g x_scale[m, g] * weight_scale[n, g] * sum_{k in g} x_fp8[m, k] *
    weight[n, k] (+ bias[n]), [M, N] in out_dtype, accumulated in float32.

    x_fp8 and x_scale come from quantize_activations with the same group_size. Grid:
    (ceil(N / BLOCK_N), ceil(M / BLOCK_M)), N tiles fastest so programs running together
    share their rows of x; BLOCK_M grows with M (16 for decode batches, up to 64), BLOCK_N
    is 128 and BLOCK_K 128 (a divisor of group_size when there are several groups); under
    the interpreter BLOCK_M is 16 and BLOCK_N 32.
    """
    _check_x(x_fp8, (torch.float8_e4m3fn,))
    _check_weight(x_fp8.shape[1], weight, weight_scale, group_size)
    _check_device(_w8a8_kernel, x_fp8, weight)
    m, k = x_fp8.shape
    n = weight.shape[0]
    if tuple(x_scale.shape) != (m, weight_scale.shape[1]) or x_scale.dtype != torch.float32:
        raise ValueError(f"x_scale must be float32 [{m}, {weight_scale.shape[1]}], got "
                         f"{x_scale.dtype} {tuple(x_scale.shape)}")
    out = torch.empty(m, n, dtype=out_dtype, device=x_fp8.device)
    if m == 0 or n == 0:
        return out
    interpreted = is_interpreted(_w8a8_kernel)
    block_m = 16 if interpreted or m <= 16 else 32 if m <= 32 else 64
    block_n = 32 if interpreted else 128
    block_k, per_group = _block_k(k, group_size, 128)
    _w8a8_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m))](
        out, x_fp8, x_scale, weight, weight_scale, bias if bias is not None else out,
        m, n, k, group_size, *x_fp8.stride(), *x_scale.stride(), *weight.stride(),
        *weight_scale.stride(), *out.stride(),
        PER_GROUP=per_group, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=3,
    )
    return out


def w8a16_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ dequant(weight)^T (+ bias) with the weight widened in the kernel: y[m, n] =
    sum_g weight_scale[n, g] * sum_{k in g} x[m, k] * weight[n, k], products in x's dtype,
    float32 accumulation, [M, N] in x's dtype. For GPUs without FP8 (compute capability
    below 8.9): the weight is read as uint8 and converted with integer operations.

    Grid: (ceil(N / BLOCK_N), ceil(M / BLOCK_M)) with BLOCK_M 16 to 64 by M, BLOCK_N and
    BLOCK_K 64 (small enough for Turing's shared memory); under the interpreter BLOCK_M is
    16 and BLOCK_N 32.
    """
    _check_x(x, SUPPORTED_DTYPES)
    _check_weight(x.shape[1], weight, weight_scale, group_size)
    _check_device(_w8a16_kernel, x, weight)
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    interpreted = is_interpreted(_w8a16_kernel)
    block_m = 16 if interpreted or m <= 16 else 32 if m <= 32 else 64
    block_n = 32 if interpreted else 64
    block_k, per_group = _block_k(k, group_size, 64)
    dot_f32, precision = dot_settings(_w8a16_kernel, x.dtype)
    w_bytes = weight.view(torch.uint8)
    _w8a16_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m))](
        out, x, w_bytes, weight_scale, bias if bias is not None else out,
        m, n, k, group_size, *x.stride(), *w_bytes.stride(), *weight_scale.stride(),
        *out.stride(), PER_GROUP=per_group, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_F32=dot_f32, DOT_PRECISION=precision, num_warps=4, num_stages=3,
    )
    return out


def select_path(capability: tuple[int, int] | None, dtype: torch.dtype, n: int, k: int,
                num_groups: int) -> str:
    """'scaled_mm', 'w8a8' or 'w8a16' for a CUDA device of `capability` (None: CPU tensors
    under the interpreter, which take 'w8a8')."""
    if capability is None:
        return "w8a8"
    if tuple(capability) < (8, 9):
        return "w8a16"
    # _scaled_mm's row-wise scaling: one scale per row of each operand, 16-aligned K and N,
    # a bfloat16 result, and a kernel for the architecture in every torch batchinfer takes
    if num_groups == 1 and dtype == torch.bfloat16 and capability[0] in (9, 10) \
            and k % 16 == 0 and n % 16 == 0:
        return "scaled_mm"
    return "w8a8"


def linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group_size: int,
           input_scale: float | torch.Tensor | None = None,
           scale_ub: float | torch.Tensor | None = None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequant(weight)^T + bias -> [..., N] in x's dtype, by the path
    select_path picks for x's device (see the module's docstring). input_scale and scale_ub
    apply to the FP8 paths' activation quantization (quantize_activations); the W8A16 path
    multiplies x as it is."""
    k = x.shape[-1]
    n = weight.shape[0]
    x2 = x.reshape(-1, k)
    capability = torch.cuda.get_device_capability(x.device) if x.device.type == "cuda" else None
    path = select_path(capability, x.dtype, n, k, weight_scale.shape[-1])
    if path == "w8a16":
        out = w8a16_matmul(x2, weight, weight_scale, group_size, bias)
    else:
        _check_weight(k, weight, weight_scale, group_size)
        x_fp8, x_scale = quantize_activations(x2, group_size, input_scale, scale_ub)
        if path == "scaled_mm":
            out = torch._scaled_mm(x_fp8, weight.t(), scale_a=x_scale,
                                   scale_b=weight_scale.reshape(1, n),
                                   bias=None if bias is None else bias.to(x.dtype),
                                   out_dtype=x.dtype)
        else:
            out = w8a8_matmul(x_fp8, x_scale, weight, weight_scale, group_size, x.dtype, bias)
    return out.reshape(*x.shape[:-1], n)
