"""Device helpers shared by the attention kernels."""
from __future__ import annotations

import triton
import triton.language as tl


# An FP8 KV cache holds E4M3 (torch.float8_e4m3fn) codes, which the kernels take as uint8
# and convert with integer operations: the same code compiled for any GPU and under the
# interpreter (whose float8 casts do not round as torch does), exactly as torch converts.


@triton.jit
def fp8_to_float(code):
    """float32 values of E4M3 codes (uint8): exact for every code, NaN for 0x7f and 0xff.
    Normals get their exponent and mantissa moved into place and rebiased (+120); the
    subnormals (exponent 0) are m * 2^-9; no float32 denormal is made on the way."""
    b = code.to(tl.int32)
    mag = b & 0x7F
    normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    value = tl.where(mag >= 8, normal, mag.to(tl.float32) * (1.0 / 512))
    value = tl.where(mag == 0x7F, float("nan"), value)
    return tl.where(b >= 0x80, -value, value)


@triton.jit
def float_to_fp8(x, scale):
    """E4M3 codes (uint8) of float32 x / scale, clamped to [-448, 448] (NaN stays NaN) and
    rounded to nearest even, as torch's (x / scale).clamp(-448, 448).to(float8_e4m3fn).
    The division is IEEE (div_rn: `/` is an approximation on NVIDIA GPUs). Normals round in
    the float32 bits (the rounding bias added below the 3 kept mantissa bits); below 2^-6,
    m * 2^-9 with m = |x| * 2^9 rounded to an integer by adding 2^23. NaN and the sign are
    read from the quotient's bits before the clamp, which a compiler may turn into a
    min/max that drops NaN."""
    y = tl.math.div_rn(x, scale)
    bits = y.to(tl.int32, bitcast=True)
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    y = tl.where(y > 448.0, 448.0, tl.where(y < -448.0, -448.0, y))
    a = y.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - 0x3C0
    t = a.to(tl.float32, bitcast=True) * 512.0 + 8388608.0
    sub = t.to(tl.int32, bitcast=True) - 0x4B000000
    code = tl.where(a >= 0x3C800000, normal, sub)
    code = tl.where(is_nan, 0x7F, code)
    code = tl.where(bits < 0, code | 0x80, code)
    return code.to(tl.uint8)


@triton.jit
def load_kv_tile(block_row, k_head, v_head, pos, pos_ok, d, d_ok, like,
                 stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
                 BLOCK_SIZE: tl.constexpr, DOT_F32: tl.constexpr, FP8: tl.constexpr):
    """K and V ([BLOCK_N, D_PAD]) of positions `pos` of one sequence and KV head, read
    through its block-table row; masked rows and padded dims read as 0. Cast to float32
    under DOT_F32, else to the element type of `like` (the query tile). FP8: the cache holds
    E4M3 codes (uint8), read as their values (exact in float16 and bfloat16 too), the
    scales left to the caller."""
    block = tl.load(block_row + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
    in_block = (pos % BLOCK_SIZE).to(tl.int64)
    kv_mask = pos_ok[:, None] & d_ok[None, :]
    k = tl.load(k_head + (block * stride_kb + in_block * stride_ks)[:, None]
                + d[None, :] * stride_kd, mask=kv_mask, other=0)
    v = tl.load(v_head + (block * stride_vb + in_block * stride_vs)[:, None]
                + d[None, :] * stride_vd, mask=kv_mask, other=0)
    if FP8:
        k = fp8_to_float(k)
        v = fp8_to_float(v)
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    else:
        k = k.to(like.dtype)
        v = v.to(like.dtype)
    return k, v


@triton.jit
def soft_cap(s, cap_log2):
    """cap * tanh(x / cap) of base-2 scores s = x * log2(e), given cap_log2 = cap * log2(e)
    (the same product in base-2 units). tanh(y) = 1 - 2 / (e^2y + 1), which saturates to
    +-1 where e^2y overflows or vanishes. Apply before masking: -inf comes out -cap."""
    e2y = tl.exp2(s / cap_log2 * 2.8853900817779268)  # 2 * log2(e)
    return cap_log2 * (1.0 - 2.0 / (e2y + 1.0))


@triton.jit
def online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """Fold one tile of base-2 scores s [M, N] (masked entries -inf) and its values
    v [N, D] into the running max m_i, sum l_i and unnormalised output acc. Rows that
    have seen only masked keys keep m_i = -inf and add nothing."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc
