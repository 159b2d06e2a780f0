/* Attention of many query rows over one set of keys, for CPUs: the shared part of a
 * cascade, where every sequence of a step that shares a cached prefix sees all of its keys
 * (no mask). kernels/cpu_build.py compiles it on first use; kernels/cpu_shared_prefix.py
 * checks the arguments and calls it through ctypes.
 *
 * The keys are few (a system prompt) and the query rows many (every token of the step
 * times its group): two small matrix products with a softmax between them, written the way
 * a GEMM micro-kernel is. Each KV head's keys are first laid out once per call, in float32
 * as K^T ([D][keys]) and V ([keys][D]); in bfloat16 as K's pairs of adjacent dimensions,
 * key-major within a pair ([D/2][keys] 32-bit words), and V's pairs of adjacent keys
 * ([keys/2][D] words). A block of ROWS query rows then takes the scores of 64 keys at a
 * time in ROWS x 4 accumulators, without horizontal sums: per dimension (float32), one
 * broadcast query element times four vectors of 16 keys; per pair of dimensions
 * (bfloat16), one broadcast query pair against four such vectors, each a `vdpbf16ps` (two
 * products per lane, summed in float32). Each row's maximum is kept as the scores are
 * stored. The softmax of a block of up to KEY_BLOCK keys is taken in float32 and base 2
 * (log2(e) folded into the scale; online across blocks) and the weighted V rows are summed
 * the same way: one broadcast weight (pair of weights) times up to four vectors of a V row
 * (pair row). bfloat16 weights are rounded to bfloat16 first, as torch's flash kernel
 * rounds them. Scores, sums and the output accumulate in float32.
 *
 * float32 needs nothing beyond the vector extensions of cpu_vec.h. bfloat16 needs the
 * AVX512-BF16 instructions (AMD Zen 4 and later, Intel Cooper Lake and later): without
 * them its entry point returns 1 and the caller keeps to torch's flash kernel.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_vec.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_BF16_DOT 1
#else
#define HAVE_BF16_DOT 0
#endif

#define INLINE static inline __attribute__((always_inline))

#define ROWS 6          /* query rows per micro-block: 6 x 4 accumulators in registers */
#define KEY_BLOCK 512   /* keys per softmax block: a block's scores (ROWS x 2 KB) in L1 */
#define ITEM_ROWS 48    /* query rows per work item */
#define MAX_HEAD_DIM 256

/* 32-bit words of the scratch a call needs: K and V of every KV head, keys padded to 64
 * (bfloat16 packs two elements a word). */
int64_t shared_prefix_scratch_words(int64_t num_keys, int64_t num_kv_heads, int64_t head_dim,
                                    int64_t bf16) {
    return (bf16 ? 1 : 2) * num_kv_heads * head_dim * ((num_keys + 63) / 64 * 64);
}

int shared_prefix_bf16_available(void) { return HAVE_BF16_DOT; }

typedef struct {
    const void *q;
    int64_t q_token_stride;
    const uint32_t *keys;  /* per KV head: K's layout, then V's (see prepare) */
    int64_t num_tokens, num_kv_heads, group, head_dim, num_keys, keys_pad;
    float scale;
    void *out;
    float *lse;
} shared_args;

/* 16 words (pairs of bfloat16) from p */
INLINE i32x16 load_pairs(const uint32_t *p) { i32x16 v; memcpy(&v, p, sizeof v); return v; }

/* acc += each lane's pair of bfloat16 in `pairs` times the pair `pair`, summed */
INLINE f32x16 dot2(f32x16 acc, i32x16 pairs, uint32_t pair) {
#if HAVE_BF16_DOT
    return (f32x16)_mm512_dpbf16_ps((__m512)acc, (__m512bh)pairs,
                                    (__m512bh)_mm512_set1_epi32((int)pair));
#else
    (void)pairs, (void)pair;
    return acc;  /* never called: the bfloat16 entry point refuses to run */
#endif
}

/* e rounded to bfloat16 (nearest even) at p */
INLINE void store_weights_bf16(uint16_t *p, f32x16 e) {
#if HAVE_BF16_DOT
    const __m256bh h = _mm512_cvtneps_pbh((__m512)e);  /* one instruction */
    memcpy(p, &h, sizeof h);
#else
    store_bf16(p, e);
#endif
}

/* s[r][0..64) = scale * q_r . k_p for keys p0 .. p0 + 64 of the block's ROWS rows, in
 * log2 units (scale includes log2(e)); keys from `valid` on are -inf. q holds each row's
 * query (float32: MAX_HEAD_DIM floats a row; bfloat16: MAX_HEAD_DIM / 2 words of pairs of
 * dimensions), kp points at key p0 of K's layout. mx[r] takes row r's running maximum. */
INLINE void scores64(const float *qf, const uint32_t *qw, const uint32_t *kp,
                     int64_t keys_pad, int64_t head_dim, float scale, int64_t valid, float *s,
                     f32x16 *mx, const int bf16) {
    f32x16 acc[ROWS][4];
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = (f32x16){0};
    if (bf16) {
        for (int64_t e = 0; e < head_dim / 2; e++) {
            const uint32_t *k = kp + e * keys_pad;
            const i32x16 k0 = load_pairs(k), k1 = load_pairs(k + 16), k2 = load_pairs(k + 32),
                         k3 = load_pairs(k + 48);
            for (int r = 0; r < ROWS; r++) {
                const uint32_t x = qw[r * (MAX_HEAD_DIM / 2) + e];
                acc[r][0] = dot2(acc[r][0], k0, x);
                acc[r][1] = dot2(acc[r][1], k1, x);
                acc[r][2] = dot2(acc[r][2], k2, x);
                acc[r][3] = dot2(acc[r][3], k3, x);
            }
        }
    } else {
        const float *kt = (const float *)kp;
        for (int64_t d = 0; d < head_dim; d++) {
            const float *k = kt + d * keys_pad;
            const f32x16 k0 = load_f32(k), k1 = load_f32(k + 16), k2 = load_f32(k + 32),
                         k3 = load_f32(k + 48);
            for (int r = 0; r < ROWS; r++) {
                const float x = qf[r * MAX_HEAD_DIM + d];
                acc[r][0] += x * k0;
                acc[r][1] += x * k1;
                acc[r][2] += x * k2;
                acc[r][3] += x * k3;
            }
        }
    }
    const i32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int c = 0; c < 4; c++) {
        const i32x16 ok = lane < (int32_t)(valid - 16 * c);
        for (int r = 0; r < ROWS; r++) {
            f32x16 x = acc[r][c] * scale;
            if (valid < 64)
                x = (f32x16)(((i32x16)x & ok) | ((i32x16)((f32x16){0} - INFINITY) & ~ok));
            mx[r] = vmax(mx[r], x);
            store_f32(s + r * KEY_BLOCK + 16 * c, x);
        }
    }
}

/* 2^x for x <= 0 (Cephes' exp2f polynomial on [-0.5, 0.5]); x below -125, -inf included,
 * counts as -125, so the exponent stays in range: 2^-125 is nothing next to the weight 1
 * of a row's largest score. (A NaN score is not carried through: a row with one gives
 * finite garbage where torch gives NaN.) */
INLINE f32x16 exp2_nonpositive(f32x16 x) {
    x = vmax(x, (f32x16){0} - 125.0f);
    const float magic = 12582912.0f;  /* 1.5 * 2^23: adding it rounds to an integer */
    const f32x16 t = x + magic, n = t - magic, f = x - n;
    f32x16 p = (f32x16){0} + 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    const i32x16 ni = (i32x16)t - (i32x16)((f32x16){0} + magic);
    return (f32x16)((i32x16)p + (ni << 23));
}

/* o[r][0 .. 16 NV) += sum over keys p < n (n even) of row r's weight p times V's row p,
 * for ROWS rows; vp points at V's first row (pair row, for bfloat16) at the column o starts
 * at. Weights: float32 (wf) or bfloat16 (wb), KEY_BLOCK a row. */
INLINE void weighted_sum(const float *wf, const uint16_t *wb, const uint32_t *vp, int64_t n,
                         int64_t head_dim, float *o, const int NV, const int bf16) {
    f32x16 acc[ROWS][4];
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < NV; c++) acc[r][c] = load_f32(o + r * MAX_HEAD_DIM + 16 * c);
    if (bf16) {
        for (int64_t f = 0; f < n / 2; f++) {
            i32x16 vv[4];
            for (int c = 0; c < NV; c++) vv[c] = load_pairs(vp + f * head_dim + 16 * c);
            for (int r = 0; r < ROWS; r++) {
                uint32_t x;
                memcpy(&x, wb + r * KEY_BLOCK + 2 * f, sizeof x);
                for (int c = 0; c < NV; c++) acc[r][c] = dot2(acc[r][c], vv[c], x);
            }
        }
    } else {
        for (int64_t p = 0; p < n; p++) {
            const float *v = (const float *)vp + p * head_dim;
            f32x16 vv[4];
            for (int c = 0; c < NV; c++) vv[c] = load_f32(v + 16 * c);
            for (int r = 0; r < ROWS; r++) {
                const float x = wf[r * KEY_BLOCK + p];
                for (int c = 0; c < NV; c++) acc[r][c] += x * vv[c];
            }
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < NV; c++) store_f32(o + r * MAX_HEAD_DIM + 16 * c, acc[r][c]);
}

/* Query rows [r0, r0 + rows) (rows <= ROWS) of KV head h; row i is token i / group, query
 * head h * group + i % group. */
INLINE void row_block(const shared_args *d, int64_t h, int64_t r0, int64_t rows,
                      const int bf16) {
    const int64_t D = d->head_dim, nc = D / 16, group = d->group;
    const int64_t k_words = (bf16 ? D / 2 : D) * d->keys_pad;
    const uint32_t *kp = d->keys + h * (bf16 ? 1 : 2) * D * d->keys_pad, *vp = kp + k_words;
    float qf[ROWS * MAX_HEAD_DIM], o[ROWS * MAX_HEAD_DIM], s[ROWS * KEY_BLOCK];
    float wf[ROWS * KEY_BLOCK], m[ROWS], l[ROWS];  /* (of qf/wf and qw/wb, one is used) */
    uint32_t qw[ROWS * (MAX_HEAD_DIM / 2)];
    uint16_t wb[ROWS * KEY_BLOCK];
    for (int r = 0; r < ROWS; r++) {
        m[r] = -INFINITY;
        l[r] = 0.f;
        const int64_t i = r0 + r, t = i / group, head = h * group + i % group;
        const int64_t at = t * d->q_token_stride + head * D;
        if (bf16) {
            if (r < rows) memcpy(qw + r * (MAX_HEAD_DIM / 2), (const uint16_t *)d->q + at, 2 * D);
            else memset(qw + r * (MAX_HEAD_DIM / 2), 0, 2 * D);
        } else {
            if (r < rows) memcpy(qf + r * MAX_HEAD_DIM, (const float *)d->q + at, 4 * D);
            else memset(qf + r * MAX_HEAD_DIM, 0, 4 * D);
        }
        memset(o + r * MAX_HEAD_DIM, 0, 4 * D);
    }
    for (int64_t p0 = 0; p0 < d->num_keys; p0 += KEY_BLOCK) {
        const int64_t n = d->num_keys - p0 < KEY_BLOCK ? d->num_keys - p0 : KEY_BLOCK;
        const int64_t n16 = (n + 15) / 16 * 16;
        f32x16 mx[ROWS];
        for (int r = 0; r < ROWS; r++) mx[r] = (f32x16){0} - INFINITY;
        for (int64_t p = 0; p < n; p += 64)
            scores64(qf, qw, kp + p0 + p, d->keys_pad, D, d->scale * (float)M_LOG2E, n - p,
                     s + p, mx, bf16);
        for (int r = 0; r < ROWS; r++) {  /* softmax over the block, online across blocks */
            const float *sr = s + r * KEY_BLOCK;
            float block_max = mx[r][0];
            for (int k = 1; k < 16; k++) block_max = mx[r][k] > block_max ? mx[r][k] : block_max;
            const float m_new = m[r] > block_max ? m[r] : block_max;
            const float corr = exp2f(m[r] - m_new);  /* 0 for the first block */
            f32x16 sum = (f32x16){0};
            for (int64_t p = 0; p < n16; p += 16) {
                /* keys past n (scores -inf) weigh 2^-125 against V rows of zeros */
                const f32x16 e = exp2_nonpositive(load_f32(sr + p) - m_new);
                if (bf16) store_weights_bf16(wb + r * KEY_BLOCK + p, e);
                else store_f32(wf + r * KEY_BLOCK + p, e);
                sum += e;
            }
            l[r] = l[r] * corr + hsum(sum);
            m[r] = m_new;
            if (corr != 1.f)
                for (int64_t c = 0; c < nc; c++)
                    store_f32(o + r * MAX_HEAD_DIM + 16 * c,
                              load_f32(o + r * MAX_HEAD_DIM + 16 * c) * corr);
        }
        /* keys past n in the last 16 meet V rows of zeros (see prepare) */
        const uint32_t *vb = vp + (bf16 ? p0 / 2 : p0) * D;
        for (int64_t c = 0; c < nc; c += 4) {
            float *oc = o + 16 * c;
            switch (nc - c < 4 ? nc - c : 4) {
            case 1: weighted_sum(wf, wb, vb + 16 * c, n16, D, oc, 1, bf16); break;
            case 2: weighted_sum(wf, wb, vb + 16 * c, n16, D, oc, 2, bf16); break;
            case 3: weighted_sum(wf, wb, vb + 16 * c, n16, D, oc, 3, bf16); break;
            default: weighted_sum(wf, wb, vb + 16 * c, n16, D, oc, 4, bf16);
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t i = r0 + r, t = i / group, g = i % group;
        const int64_t row = (t * d->num_kv_heads + h) * group + g;
        const float inv = 1.f / l[r];  /* l >= 1: the largest score's weight is 1 */
        for (int64_t c = 0; c < nc; c++)
            store16(d->out, row * D + 16 * c, load_f32(o + r * MAX_HEAD_DIM + 16 * c) * inv,
                    bf16);
        d->lse[row] = (m[r] + log2f(l[r])) * (float)M_LN2;  /* back to natural log */
    }
}

/* K and V [num_keys, num_kv_heads, head_dim] into the scratch, per KV head, keys padded
 * to keys_pad with zeros: float32 K^T [D][keys_pad] and V [keys_pad][D]; bfloat16 K's
 * pairs of dimensions key-major ([D/2][keys_pad] words) and V's pairs of keys
 * ([keys_pad/2][D] words, the first key in the low half). */
INLINE void prepare(const void *k, const void *v, uint32_t *scratch, int64_t num_keys,
                    int64_t keys_pad, int64_t num_kv_heads, int64_t head_dim, const int bf16) {
    const int64_t D = head_dim, row = num_kv_heads * D;
    _Pragma("omp parallel for schedule(static)")
    for (int64_t h = 0; h < num_kv_heads; h++) {
        uint32_t *kp = scratch + h * (bf16 ? 1 : 2) * D * keys_pad;
        uint32_t *vp = kp + (bf16 ? D / 2 : D) * keys_pad;
        if (bf16) {
            const uint16_t *kb = k, *vb = v;
            for (int64_t p = 0; p < keys_pad; p++)
                for (int64_t e = 0; e < D / 2; e++) {
                    uint32_t word = 0;
                    if (p < num_keys) memcpy(&word, kb + p * row + h * D + 2 * e, sizeof word);
                    kp[e * keys_pad + p] = word;
                }
            for (int64_t f = 0; f < keys_pad / 2; f++)
                for (int64_t e = 0; e < D; e++) {
                    const uint32_t lo = 2 * f < num_keys ? vb[2 * f * row + h * D + e] : 0;
                    const uint32_t hi = 2 * f + 1 < num_keys
                                        ? vb[(2 * f + 1) * row + h * D + e] : 0;
                    vp[f * D + e] = lo | hi << 16;
                }
        } else {
            const float *kf = k, *vf = v;
            float *kt = (float *)kp, *vt = (float *)vp;
            for (int64_t p = 0; p < keys_pad; p++)
                for (int64_t e = 0; e < D; e++) {
                    kt[e * keys_pad + p] = p < num_keys ? kf[p * row + h * D + e] : 0.f;
                    vt[p * D + e] = p < num_keys ? vf[p * row + h * D + e] : 0.f;
                }
        }
    }
}

INLINE void run(const shared_args *d, const int bf16) {
    const int64_t rows = d->num_tokens * d->group;
    const int64_t per_head = (rows + ITEM_ROWS - 1) / ITEM_ROWS;
    _Pragma("omp parallel for schedule(static)")
    for (int64_t item = 0; item < d->num_kv_heads * per_head; item++) {
        const int64_t h = item / per_head, first = item % per_head * ITEM_ROWS;
        const int64_t last = rows - first < ITEM_ROWS ? rows : first + ITEM_ROWS;
        for (int64_t r0 = first; r0 < last; r0 += ROWS)
            row_block(d, h, r0, last - r0 < ROWS ? last - r0 : ROWS, bf16);
    }
}

/* Entry points, one per element type. q [num_tokens, num_kv_heads * group, head_dim]
 * (tokens q_token_stride elements apart); k, v [num_keys, num_kv_heads, head_dim],
 * contiguous; out [num_tokens, num_kv_heads, group, head_dim] in q's type and lse
 * (float32) [num_tokens, num_kv_heads, group], contiguous; scratch:
 * shared_prefix_scratch_words() 32-bit words. Returns nonzero, touching nothing, for a
 * shape it does not handle (and, for bfloat16, without the dot-product instructions). */
#define ENTRY(NAME, T, BF16)                                                                  \
int NAME(const T *q, int64_t q_token_stride, const T *k, const T *v, int64_t num_tokens,       \
         int64_t num_keys, int64_t num_kv_heads, int64_t group, int64_t head_dim, float scale, \
         T *out, float *lse, uint32_t *scratch) {                                              \
    if ((BF16 && !HAVE_BF16_DOT) || head_dim % 16 || head_dim > MAX_HEAD_DIM                  \
            || head_dim < 16 || group < 1 || num_keys < 1)                                     \
        return 1;                                                                              \
    const int64_t keys_pad = (num_keys + 63) / 64 * 64;                                       \
    prepare(k, v, scratch, num_keys, keys_pad, num_kv_heads, head_dim, BF16);                 \
    const shared_args d = {q, q_token_stride, scratch, num_tokens, num_kv_heads, group,        \
                           head_dim, num_keys, keys_pad, scale, out, lse};                     \
    run(&d, BF16);                                                                             \
    return 0;                                                                                  \
}
ENTRY(shared_prefix_f32, float, 0)
ENTRY(shared_prefix_bf16, uint16_t, 1)
