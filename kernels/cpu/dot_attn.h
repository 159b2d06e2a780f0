/* Attention of a few query rows over a block of keys as two small matrix products with the
 * softmax between them, written the way a GEMM micro-kernel is: the pieces that
 * shared_prefix.c (a cascade's shared prefix) and prefill.c (bfloat16 prompt
 * chunks) build their loops from.
 *
 * Keys come laid out by the caller, per KV head: in float32 as K^T ([D][keys]) and V
 * ([keys][D]); in bfloat16 as K's pairs of adjacent dimensions, key-major within a pair
 * ([D/2][keys] 32-bit words), and V's pairs of adjacent keys ([keys/2][D] words, the first
 * key in the low half). A block of DOT_ROWS query rows takes the scores of 64 keys at a time
 * in registers, without horizontal sums: per dimension (float32), one broadcast query
 * element times vectors of 16 keys; per pair of dimensions (bfloat16), one broadcast query
 * pair against such vectors, each a `vdpbf16ps` (two products per lane, summed in
 * float32). Scores are in base 2 (log2(e) folded into the
 * scale), so the softmax takes 2^x; the weighted V rows are summed the same way, one
 * broadcast weight (pair of weights) times vectors of a V row (pair row).
 * bfloat16 weights are rounded to bfloat16 first, as torch's flash kernel rounds them.
 * Scores, sums and outputs accumulate in float32.
 *
 * bfloat16 runs on the AVX512-BF16 instructions where the build has them (AMD Zen 4 and
 * later, Intel Cooper Lake and later; HAVE_BF16_DOT), elsewhere on two FMAs per pair, the
 * odd elements' product added first and then the even's: vdpbf16ps's order, whose results
 * those match bit for bit (the products of two bfloat16 are exact in float32; only
 * denormals, which the instruction flushes, can differ).
 *
 * The micro-kernel computes in vectors of the build's register width (vec.h's fvec), and its
 * register blocks are chosen per ISA: a pass keeps DOT_RB rows x DOT_CB vectors of accumulators, the vectors of keys
 * (values) it multiplies, and for emulated bfloat16 their even and odd halves and the
 * query's, within the register file. With 32 registers (AVX-512, aarch64): 6 x 4 (24
 * accumulators, 4 keys, 1 broadcast), emulated bfloat16 6 x 2 (12 + 4 halves + 2). With
 * 16 (AVX2): 6 x 2 (12 + 2 + 1), emulated bfloat16 3 x 2 (6 + 4 + 2). Each accumulator adds
 * the same products in the same order whatever the block, and the sums and maxima across
 * lanes are taken in 16-lane order, so the results do not depend on the vector width. */
#ifndef BATCHINFER_CPU_DOT_ATTN_H
#define BATCHINFER_CPU_DOT_ATTN_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_BF16_DOT 1
#else
#define HAVE_BF16_DOT 0
#endif

#ifndef INLINE
#define INLINE static inline __attribute__((always_inline))
#endif

#define DOT_ROWS 6          /* query rows per micro-block */
#define DOT_KEY_BLOCK 512   /* keys per softmax block: a block's scores (6 x 2 KB) in L1 */
#define DOT_MAX_HEAD_DIM 256

#if defined(__AVX512F__) || defined(__aarch64__)
#define DOT_CB 4
#define DOT_RB_BF16 6
#define DOT_CB_BF16 (HAVE_BF16_DOT ? 4 : 2)
#else
#define DOT_CB 2
#define DOT_RB_BF16 3
#define DOT_CB_BF16 2
#endif
/* rows and vectors of a register block (see above) */
#define DOT_RB(bf16) ((bf16) ? DOT_RB_BF16 : DOT_ROWS)
#define DOT_CBS(bf16) ((bf16) ? DOT_CB_BF16 : DOT_CB)

/* acc += each lane's pair of bfloat16 in `pairs` times the pair `pair`, summed */
INLINE fvec dot2(fvec acc, fvec pairs, uint32_t pair) {
#if HAVE_BF16_DOT
    return (fvec)_mm512_dpbf16_ps((__m512)acc, (__m512bh)pairs,
                                  (__m512bh)_mm512_set1_epi32((int)pair));
#else
    uvec w;
    memcpy(&w, &pairs, sizeof w);
    const uvec we = w << 16, wo = w & 0xffff0000u;
    const uint32_t pe = pair << 16, po = pair & 0xffff0000u;
    fvec even, odd;
    float xe, xo;
    memcpy(&even, &we, sizeof even);
    memcpy(&odd, &wo, sizeof odd);
    memcpy(&xe, &pe, sizeof xe);
    memcpy(&xo, &po, sizeof xo);
    acc += odd * xo;  /* contracted to FMAs: each product rounds once, with the sum */
    return acc + even * xe;
#endif
}

/* e rounded to bfloat16 (nearest even) at p */
INLINE void store_weights_bf16(uint16_t *p, fvec e) {
#if HAVE_BF16_DOT
    const __m256bh h = _mm512_cvtneps_pbh((__m512)e);  /* one instruction */
    memcpy(p, &h, sizeof h);
#else
    uvec u;  /* as vec.h's bf16_bits */
    memcpy(&u, &e, sizeof u);
    const uvec nan = (uvec)((u & 0x7fffffffu) > 0x7f800000u);
    const uvec r = ((u + 0x7fffu + ((u >> 16) & 1u)) & ~nan) | ((u | 0x400000u) & nan);
    const hvec h = __builtin_convertvector(r >> 16, hvec);
    memcpy(p, &h, sizeof h);
#endif
}

/* s[r][0..64) = scale * q_r . k_p for keys p0 .. p0 + 64 of the block's DOT_ROWS rows, in
 * log2 units (scale includes log2(e)); row r's keys from valid[r] on are -inf (valid[r] >= 64:
 * none). q holds each row's query (float32: DOT_MAX_HEAD_DIM floats a row; bfloat16:
 * DOT_MAX_HEAD_DIM / 2 words of pairs of dimensions), kp points at key p0 of K's layout.
 * mx[r] takes row r's running maximum. */
INLINE void scores64(const float *qf, const uint32_t *qw, const uint32_t *kp,
                     int64_t keys_pad, int64_t head_dim, float scale, const int64_t *valid,
                     float *s, fvec mx[][NSUB], const int bf16) {
    const int RB = DOT_RB(bf16), CB = DOT_CBS(bf16);
    ivec lane;
    for (int i = 0; i < NLANES; i++) lane[i] = i;
    for (int r0 = 0; r0 < DOT_ROWS; r0 += RB)
        for (int c0 = 0; c0 < 64 / NLANES; c0 += CB) {
            fvec acc[DOT_ROWS][4];
            for (int r = 0; r < RB; r++)
                for (int c = 0; c < CB; c++) acc[r][c] = (fvec){0};
            if (bf16) {
                for (int64_t e = 0; e < head_dim / 2; e++) {
                    const uint32_t *k = kp + e * keys_pad + NLANES * c0;
                    fvec kv[4];
                    for (int c = 0; c < CB; c++) kv[c] = load_fv(k + NLANES * c);
                    for (int r = 0; r < RB; r++) {
                        const uint32_t x = qw[(r0 + r) * (DOT_MAX_HEAD_DIM / 2) + e];
                        for (int c = 0; c < CB; c++) acc[r][c] = dot2(acc[r][c], kv[c], x);
                    }
                }
            } else {
                const float *kt = (const float *)kp;
                for (int64_t d = 0; d < head_dim; d++) {
                    const float *k = kt + d * keys_pad + NLANES * c0;
                    fvec kv[4];
                    for (int c = 0; c < CB; c++) kv[c] = load_fv(k + NLANES * c);
                    for (int r = 0; r < RB; r++) {
                        const float x = qf[(r0 + r) * DOT_MAX_HEAD_DIM + d];
                        for (int c = 0; c < CB; c++) acc[r][c] += x * kv[c];
                    }
                }
            }
            for (int c = 0; c < CB; c++) {
                const int64_t col = NLANES * (c0 + c);
                for (int r = 0; r < RB; r++) {
                    fvec x = acc[r][c] * scale;
                    if (valid[r0 + r] < 64) {
                        const ivec ok = lane < (int32_t)(valid[r0 + r] - col);
                        x = (fvec)(((ivec)x & ok) | ((ivec)((fvec){0} - INFINITY) & ~ok));
                    }
                    fvec *m = &mx[r0 + r][(c0 + c) % NSUB];
                    *m = fvmax(*m, x);
                    store_fv(s + (r0 + r) * DOT_KEY_BLOCK + col, x);
                }
            }
        }
}

/* 2^x for x <= 0 (Cephes' exp2f polynomial on [-0.5, 0.5]); x below -125, -inf included,
 * counts as -125, so the exponent stays in range: 2^-125 is nothing next to the weight 1
 * of a row's largest score. A NaN stays NaN, so a NaN key reaches the rows that see it, as
 * in torch's kernels. */
INLINE fvec exp2_nonpositive(fvec x) {
    const ivec nan = (ivec)(x != x);
    const fvec xc = fvmax(x, (fvec){0} - 125.0f);  /* -125 for a NaN, restored below */
    const float magic = 12582912.0f;  /* 1.5 * 2^23: adding it rounds to an integer */
    const fvec t = xc + magic, n = t - magic, f = xc - n;
    fvec p = (fvec){0} + 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    const ivec ni = (ivec)t - (ivec)((fvec){0} + magic);
    return (fvec)((((ivec)p + (ni << 23)) & ~nan) | ((ivec)x & nan));
}

/* o[r][0 .. 16 NV) += sum over keys p < n (n even) of row r's weight p times V's row p,
 * for DOT_ROWS rows; vp points at V's first row (pair row, for bfloat16) at the column o starts
 * at. Weights: float32 (wf) or bfloat16 (wb), DOT_KEY_BLOCK a row. */
INLINE void weighted_sum(const float *wf, const uint16_t *wb, const uint32_t *vp, int64_t n,
                         int64_t head_dim, float *o, const int NV, const int bf16) {
    const int RB = DOT_RB(bf16), CB = DOT_CBS(bf16), W = NV * NSUB;
    for (int r0 = 0; r0 < DOT_ROWS; r0 += RB)
        for (int c0 = 0; c0 < W; c0 += CB) {
            const int cn = W - c0 < CB ? W - c0 : CB;  /* vectors in this block */
            float *oc = o + NLANES * c0;
            fvec acc[DOT_ROWS][4];
            for (int r = 0; r < RB; r++)
                for (int c = 0; c < cn; c++)
                    acc[r][c] = load_fv(oc + (r0 + r) * DOT_MAX_HEAD_DIM + NLANES * c);
            if (bf16) {
                for (int64_t f = 0; f < n / 2; f++) {
                    const uint32_t *v = vp + f * head_dim + NLANES * c0;
                    fvec vv[4];
                    for (int c = 0; c < cn; c++) vv[c] = load_fv(v + NLANES * c);
                    for (int r = 0; r < RB; r++) {
                        uint32_t x;
                        memcpy(&x, wb + (r0 + r) * DOT_KEY_BLOCK + 2 * f, sizeof x);
                        for (int c = 0; c < cn; c++) acc[r][c] = dot2(acc[r][c], vv[c], x);
                    }
                }
            } else {
                for (int64_t p = 0; p < n; p++) {
                    const float *v = (const float *)vp + p * head_dim + NLANES * c0;
                    fvec vv[4];
                    for (int c = 0; c < cn; c++) vv[c] = load_fv(v + NLANES * c);
                    for (int r = 0; r < RB; r++) {
                        const float x = wf[(r0 + r) * DOT_KEY_BLOCK + p];
                        for (int c = 0; c < cn; c++) acc[r][c] += x * vv[c];
                    }
                }
            }
            for (int r = 0; r < RB; r++)
                for (int c = 0; c < cn; c++)
                    store_fv(oc + (r0 + r) * DOT_MAX_HEAD_DIM + NLANES * c, acc[r][c]);
        }
}

/* The state of DOT_ROWS query rows between key blocks: their queries (float32 rows, or
 * bfloat16 rows as words of pairs of dimensions), running maximum m (base 2) and sum l, and
 * unnormalised output o; and one block's scores and weights. */
typedef struct {
    float qf[DOT_ROWS * DOT_MAX_HEAD_DIM];
    uint32_t qw[DOT_ROWS * (DOT_MAX_HEAD_DIM / 2)];
    float o[DOT_ROWS * DOT_MAX_HEAD_DIM];
    float s[DOT_ROWS * DOT_KEY_BLOCK], wf[DOT_ROWS * DOT_KEY_BLOCK];
    uint16_t wb[DOT_ROWS * DOT_KEY_BLOCK];
    float m[DOT_ROWS], l[DOT_ROWS];
} dot_rows;

/* Row r's query: head_dim elements at q (float32 or bfloat16), or zeros for q NULL (a
 * padding row, whose results are not stored). */
INLINE void dot_load_query(dot_rows *st, int r, const void *q, int64_t head_dim, int bf16) {
    void *dst = bf16 ? (void *)(st->qw + r * (DOT_MAX_HEAD_DIM / 2))
                     : (void *)(st->qf + r * DOT_MAX_HEAD_DIM);
    if (q) memcpy(dst, q, (bf16 ? 2 : 4) * head_dim);
    else memset(dst, 0, (bf16 ? 2 : 4) * head_dim);
}

/* Row r starts from nothing (lse -inf) or from a partial result over other keys: its
 * normalised output init (head_dim elements) at natural log-sum-exp lse. v_scale: what the
 * rows' values are to be multiplied by at the end (dot_finish_row; an FP8 cache's scale,
 * else 1), which init is divided by here. */
INLINE void dot_start_row(dot_rows *st, int r, float lse, const void *init, int64_t head_dim,
                          int bf16, float v_scale) {
    st->m[r] = lse == -INFINITY ? -INFINITY : lse * (float)M_LOG2E;
    st->l[r] = lse == -INFINITY ? 0.f : 1.f;
    for (int64_t c = 0; c < head_dim; c += 16)
        store_f32(st->o + r * DOT_MAX_HEAD_DIM + c,
                  lse == -INFINITY ? (f32x16){0} : load16(init, c, bf16) * (1.f / v_scale));
}

/* Every row over n <= DOT_KEY_BLOCK keys: kp points at the first one's column of K's layout
 * (keys_pad words or floats a row), vp at its row of V's (pair row, for bfloat16), and the
 * layouts hold at least n rounded up to 64 keys. Row r sees keys [0, valid[r]) of them
 * (valid[r] <= n; every row sees at least one key of the first block it meets). The
 * weighted sum reads V up to n rounded up to even, and a key a row does not see enters it
 * at weight 2^-125: a finite value there does not show, an inf or NaN one reaches the row
 * (as within the float32 prefill kernel's passes, and torch's flash blocks). scale: the
 * scores' scale times log2(e). */
INLINE void dot_block(dot_rows *st, const uint32_t *kp, const uint32_t *vp, int64_t keys_pad,
                      int64_t head_dim, float scale, int64_t n, const int64_t *valid,
                      const int bf16) {
    const int64_t nc = head_dim / 16, n16 = (n + 15) / 16 * 16, n2 = (n + 1) / 2 * 2;
    fvec mx[DOT_ROWS][NSUB];  /* lane i of 16: mx[r][i / NLANES][i % NLANES] */
    for (int r = 0; r < DOT_ROWS; r++)
        for (int j = 0; j < NSUB; j++) mx[r][j] = (fvec){0} - INFINITY;
    for (int64_t p = 0; p < n; p += 64) {
        int64_t v[DOT_ROWS];
        for (int r = 0; r < DOT_ROWS; r++) v[r] = valid[r] - p;
        scores64(st->qf, st->qw, kp + p, keys_pad, head_dim, scale, v, st->s + p, mx, bf16);
    }
    for (int r = 0; r < DOT_ROWS; r++) {  /* softmax over the block, online across blocks */
        const float *sr = st->s + r * DOT_KEY_BLOCK;
        float block_max = mx[r][0][0];
        for (int k = 1; k < 16; k++) {
            const float x = mx[r][k / NLANES][k % NLANES];
            block_max = x > block_max ? x : block_max;
        }
        const float m_new = st->m[r] > block_max ? st->m[r] : block_max;
        const float corr = exp2f(st->m[r] - m_new);  /* 0 for the first block */
        fvec sum[NSUB];
        for (int j = 0; j < NSUB; j++) sum[j] = (fvec){0};
        for (int64_t p = 0; p < n16; p += 16)
            for (int j = 0; j < NSUB; j++) {
                const int64_t at = p + NLANES * j;
                const fvec e = exp2_nonpositive(load_fv(sr + at) - m_new);
                if (bf16) store_weights_bf16(st->wb + r * DOT_KEY_BLOCK + at, e);
                else store_fv(st->wf + r * DOT_KEY_BLOCK + at, e);
                sum[j] += e;
            }
        float total = 0.f;  /* in 16-lane order */
        for (int k = 0; k < 16; k++) total += sum[k / NLANES][k % NLANES];
        st->l[r] = st->l[r] * corr + total;
        st->m[r] = m_new;
        if (corr != 1.f)
            for (int64_t c = 0; c < head_dim; c += NLANES)
                store_fv(st->o + r * DOT_MAX_HEAD_DIM + c,
                       load_fv(st->o + r * DOT_MAX_HEAD_DIM + c) * corr);
    }
    for (int64_t c = 0; c < nc; c += 4) {
        const uint32_t *vc = vp + 16 * c;
        float *oc = st->o + 16 * c;
        switch (nc - c < 4 ? nc - c : 4) {
        case 1: weighted_sum(st->wf, st->wb, vc, n2, head_dim, oc, 1, bf16); break;
        case 2: weighted_sum(st->wf, st->wb, vc, n2, head_dim, oc, 2, bf16); break;
        case 3: weighted_sum(st->wf, st->wb, vc, n2, head_dim, oc, 3, bf16); break;
        default: weighted_sum(st->wf, st->wb, vc, n2, head_dim, oc, 4, bf16);
        }
    }
}

/* Row r's result: its output, normalised and times v_scale, at out (head_dim elements);
 * returns its natural log-sum-exp. */
INLINE float dot_finish_row(const dot_rows *st, int r, void *out, int64_t head_dim, int bf16,
                            float v_scale) {
    const float inv = 1.f / st->l[r] * v_scale;  /* l >= 1: the largest score's weight is 1 */
    for (int64_t c = 0; c < head_dim; c += 16)
        store16(out, c, load_f32(st->o + r * DOT_MAX_HEAD_DIM + c) * inv, bf16);
    return (st->m[r] + log2f(st->l[r])) * (float)M_LN2;
}

#endif
