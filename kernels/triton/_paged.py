"""Device helpers shared by the attention kernels."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_kv_tile(block_row, k_head, v_head, pos, pos_ok, d, d_ok, like,
                 stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
                 BLOCK_SIZE: tl.constexpr, DOT_F32: tl.constexpr):
    """K and V ([BLOCK_N, D_PAD]) of positions `pos` of one sequence and KV head, read
    through its block-table row; masked rows and padded dims read as 0. Cast to float32
    under DOT_F32, else to the element type of `like` (the query tile)."""
    block = tl.load(block_row + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
    in_block = (pos % BLOCK_SIZE).to(tl.int64)
    kv_mask = pos_ok[:, None] & d_ok[None, :]
    k = tl.load(k_head + (block * stride_kb + in_block * stride_ks)[:, None]
                + d[None, :] * stride_kd, mask=kv_mask, other=0.0)
    v = tl.load(v_head + (block * stride_vb + in_block * stride_vs)[:, None]
                + d[None, :] * stride_vd, mask=kv_mask, other=0.0)
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    else:
        k = k.to(like.dtype)
        v = v.to(like.dtype)
    return k, v


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
