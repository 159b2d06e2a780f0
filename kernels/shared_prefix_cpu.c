/* Attention of many bfloat16 query rows over one set of keys, for CPUs with bfloat16 dot
 * products (AVX512-BF16: AMD Zen 4 and later, Intel Cooper Lake and later): the shared part
 * of a cascade, where every sequence of a step that shares a cached prefix sees all of its
 * keys (no mask). kernels/cpu_build.py compiles it on first use;
 * kernels/cpu_shared_prefix.py checks the arguments and calls it through ctypes.
 *
 * The keys are few (a system prompt) and the query rows many (every token of the step
 * times its group): two small matrix products with a softmax between them, written the way
 * a GEMM micro-kernel is. Each KV head's keys are first laid out once per call: K as
 * pairs of adjacent dimensions, key-major within a pair ([D/2][keys] 32-bit words), V as
 * pairs of adjacent keys ([keys/2][D] words). A block of ROWS query rows then takes the
 * scores of 64 keys at a time in ROWS x 4 accumulators: per pair of dimensions, one
 * broadcast query pair against four vectors of 16 keys, each a `vdpbf16ps` (two products
 * per lane, summed in float32; no horizontal sums), each row's maximum kept as they are
 * stored. The softmax of a block of up to KEY_BLOCK keys is taken in float32 and base 2
 * (log2(e) folded into the scale; online across blocks), its weights rounded to bfloat16
 * as torch's flash kernel rounds them, and the weighted V rows are summed the same way: one
 * broadcast pair of weights against up to four vectors of a V pair row. Scores, sums and
 * the output accumulate in float32.
 *
 * Without the instructions (another CPU, another compiler) every entry point returns 1
 * and the caller keeps to torch's flash kernel.
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

/* Words of the scratch a call needs: K and V of every KV head, keys padded to 64. */
int64_t shared_prefix_scratch_words(int64_t num_keys, int64_t num_kv_heads, int64_t head_dim) {
    return num_kv_heads * head_dim * ((num_keys + 63) / 64 * 64);
}

int shared_prefix_available(void) { return HAVE_BF16_DOT; }

#if HAVE_BF16_DOT

typedef struct {
    const uint16_t *q;
    int64_t q_token_stride;
    const uint32_t *keys;  /* per KV head: K [D/2][keys_pad] words, then V [keys_pad/2][D] */
    int64_t num_tokens, num_kv_heads, group, head_dim, num_keys, keys_pad;
    float scale;
    uint16_t *out;
    float *lse;
} shared_args;

INLINE __m512 dot2(__m512 acc, __m512i pairs, uint32_t pair) {
    return _mm512_dpbf16_ps(acc, (__m512bh)pairs, (__m512bh)_mm512_set1_epi32((int)pair));
}

/* s[r][0..64) = scale * q_r . k_p for keys p0 .. p0 + 64 of the block's ROWS rows, in
 * log2 units (scale includes log2(e)); keys from `valid` on are -inf. q holds each row's
 * query as words (pairs of dimensions), kp points at key p0 of K's layout. mx[r] takes the
 * running maximum of row r's scores. */
INLINE void scores64(const uint32_t *q, const uint32_t *kp, int64_t keys_pad, int64_t pairs,
                     float scale, int64_t valid, float *s, f32x16 *mx) {
    __m512 acc[ROWS][4];
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t e = 0; e < pairs; e++) {
        const uint32_t *k = kp + e * keys_pad;
        const __m512i k0 = _mm512_loadu_si512(k), k1 = _mm512_loadu_si512(k + 16),
                      k2 = _mm512_loadu_si512(k + 32), k3 = _mm512_loadu_si512(k + 48);
        for (int r = 0; r < ROWS; r++) {
            const uint32_t x = q[r * (MAX_HEAD_DIM / 2) + e];
            acc[r][0] = dot2(acc[r][0], k0, x);
            acc[r][1] = dot2(acc[r][1], k1, x);
            acc[r][2] = dot2(acc[r][2], k2, x);
            acc[r][3] = dot2(acc[r][3], k3, x);
        }
    }
    const i32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int c = 0; c < 4; c++) {
        const i32x16 ok = lane < (int32_t)(valid - 16 * c);
        for (int r = 0; r < ROWS; r++) {
            f32x16 x = (f32x16)acc[r][c] * scale;
            if (valid < 64)
                x = (f32x16)(((i32x16)x & ok) | ((i32x16)((f32x16){0} - INFINITY) & ~ok));
            mx[r] = vmax(mx[r], x);
            store_f32(s + r * KEY_BLOCK + 16 * c, x);
        }
    }
}

/* 2^x for x <= 0 (Cephes' exp2f polynomial on [-0.5, 0.5]); x below -125, -inf included,
 * counts as -125, so the exponent stays in range: 2^-125 is nothing next to the weight 1
 * of a row's largest score. */
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

/* o[r][0 .. 16 NV) += sum over key pairs f < n2 of the weights' pair f of row r times V's
 * pair row f (at the column o starts at; rows D words apart), for ROWS rows; w holds each
 * row's weights as bfloat16, KEY_BLOCK a row. */
INLINE void weighted_sum(const uint16_t *w, const uint32_t *vp, int64_t n2, int64_t head_dim,
                         float *o, const int NV) {
    __m512 acc[ROWS][4];
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < NV; c++) acc[r][c] = _mm512_loadu_ps(o + r * MAX_HEAD_DIM + 16 * c);
    for (int64_t f = 0; f < n2; f++) {
        __m512i vv[4];
        for (int c = 0; c < NV; c++) vv[c] = _mm512_loadu_si512(vp + f * head_dim + 16 * c);
        for (int r = 0; r < ROWS; r++) {
            uint32_t x;
            memcpy(&x, w + r * KEY_BLOCK + 2 * f, sizeof x);
            for (int c = 0; c < NV; c++) acc[r][c] = dot2(acc[r][c], vv[c], x);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < NV; c++) _mm512_storeu_ps(o + r * MAX_HEAD_DIM + 16 * c, acc[r][c]);
}

/* Query rows [r0, r0 + rows) (rows <= ROWS) of KV head h; row i is token i / group, query
 * head h * group + i % group. */
INLINE void row_block(const shared_args *d, int64_t h, int64_t r0, int64_t rows) {
    const int64_t D = d->head_dim, nc = D / 16, group = d->group;
    const uint32_t *kp = d->keys + h * D * d->keys_pad, *vp = kp + D / 2 * d->keys_pad;
    uint32_t q[ROWS * (MAX_HEAD_DIM / 2)];
    float o[ROWS * MAX_HEAD_DIM], s[ROWS * KEY_BLOCK], m[ROWS], l[ROWS];
    uint16_t w[ROWS * KEY_BLOCK];
    for (int r = 0; r < ROWS; r++) {
        m[r] = -INFINITY;
        l[r] = 0.f;
        if (r < rows) {
            const int64_t i = r0 + r, t = i / group, head = h * group + i % group;
            memcpy(q + r * (MAX_HEAD_DIM / 2), d->q + t * d->q_token_stride + head * D, 2 * D);
        } else {
            memset(q + r * (MAX_HEAD_DIM / 2), 0, 2 * D);
        }
        memset(o + r * MAX_HEAD_DIM, 0, 4 * D);
    }
    for (int64_t p0 = 0; p0 < d->num_keys; p0 += KEY_BLOCK) {
        const int64_t n = d->num_keys - p0 < KEY_BLOCK ? d->num_keys - p0 : KEY_BLOCK;
        const int64_t n16 = (n + 15) / 16 * 16;
        f32x16 mx[ROWS];
        for (int r = 0; r < ROWS; r++) mx[r] = (f32x16){0} - INFINITY;
        for (int64_t p = 0; p < n; p += 64)
            scores64(q, kp + p0 + p, d->keys_pad, D / 2, d->scale * (float)M_LOG2E, n - p,
                     s + p, mx);
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
                const __m256bh e16 = _mm512_cvtneps_pbh((__m512)e);
                memcpy(w + r * KEY_BLOCK + p, &e16, sizeof e16);
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
        for (int64_t c = 0; c < nc; c += 4) {
            const uint32_t *vc = vp + p0 / 2 * D + 16 * c;
            switch (nc - c < 4 ? nc - c : 4) {
            case 1: weighted_sum(w, vc, n16 / 2, D, o + 16 * c, 1); break;
            case 2: weighted_sum(w, vc, n16 / 2, D, o + 16 * c, 2); break;
            case 3: weighted_sum(w, vc, n16 / 2, D, o + 16 * c, 3); break;
            default: weighted_sum(w, vc, n16 / 2, D, o + 16 * c, 4);
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t i = r0 + r, t = i / group, g = i % group;
        const int64_t row = (t * d->num_kv_heads + h) * group + g;
        const float inv = 1.f / l[r];  /* l >= 1: the largest score's weight is 1 */
        for (int64_t c = 0; c < nc; c++)
            store_bf16(d->out + row * D + 16 * c, load_f32(o + r * MAX_HEAD_DIM + 16 * c) * inv);
        d->lse[row] = (m[r] + log2f(l[r])) * (float)M_LN2;  /* back to natural log */
    }
}

/* K and V [num_keys, num_kv_heads, head_dim] into the scratch, per KV head: K's pairs of
 * dimensions key-major, V's pairs of keys, keys padded to keys_pad with zeros. */
static void prepare(const uint16_t *k, const uint16_t *v, uint32_t *scratch, int64_t num_keys,
                    int64_t keys_pad, int64_t num_kv_heads, int64_t head_dim) {
    const int64_t D = head_dim, row = num_kv_heads * D;
    #pragma omp parallel for schedule(static)
    for (int64_t h = 0; h < num_kv_heads; h++) {
        uint32_t *kp = scratch + h * D * keys_pad, *vp = kp + D / 2 * keys_pad;
        for (int64_t p = 0; p < keys_pad; p++)
            for (int64_t e = 0; e < D / 2; e++) {
                uint32_t word = 0;
                if (p < num_keys) memcpy(&word, k + p * row + h * D + 2 * e, sizeof word);
                kp[e * keys_pad + p] = word;
            }
        for (int64_t f = 0; f < keys_pad / 2; f++)
            for (int64_t e = 0; e < D; e++) {
                const uint32_t lo = 2 * f < num_keys ? v[2 * f * row + h * D + e] : 0;
                const uint32_t hi = 2 * f + 1 < num_keys ? v[(2 * f + 1) * row + h * D + e] : 0;
                vp[f * D + e] = lo | hi << 16;
            }
    }
}

static void run(const shared_args *d) {
    const int64_t rows = d->num_tokens * d->group;
    const int64_t per_head = (rows + ITEM_ROWS - 1) / ITEM_ROWS;
    #pragma omp parallel for schedule(static)
    for (int64_t item = 0; item < d->num_kv_heads * per_head; item++) {
        const int64_t h = item / per_head, first = item % per_head * ITEM_ROWS;
        const int64_t last = rows - first < ITEM_ROWS ? rows : first + ITEM_ROWS;
        for (int64_t r0 = first; r0 < last; r0 += ROWS)
            row_block(d, h, r0, last - r0 < ROWS ? last - r0 : ROWS);
    }
}

#endif

/* q [num_tokens, num_kv_heads * group, head_dim] bfloat16 (tokens q_token_stride elements
 * apart); k, v [num_keys, num_kv_heads, head_dim] bfloat16, contiguous; out
 * [num_tokens, num_kv_heads, group, head_dim] bfloat16 and lse (float32)
 * [num_tokens, num_kv_heads, group], contiguous; scratch: shared_prefix_scratch_words()
 * 32-bit words. Returns nonzero, touching nothing, for a shape it does not handle or
 * without bfloat16 dot products. */
int shared_prefix_bf16(const uint16_t *q, int64_t q_token_stride, const uint16_t *k,
                       const uint16_t *v, int64_t num_tokens, int64_t num_keys,
                       int64_t num_kv_heads, int64_t group, int64_t head_dim, float scale,
                       uint16_t *out, float *lse, uint32_t *scratch) {
    if (!HAVE_BF16_DOT || head_dim % 16 || head_dim > MAX_HEAD_DIM || head_dim < 16
            || group < 1 || num_keys < 1)
        return 1;
#if HAVE_BF16_DOT
    const int64_t keys_pad = (num_keys + 63) / 64 * 64;
    prepare(k, v, scratch, num_keys, keys_pad, num_kv_heads, head_dim);
    const shared_args d = {q, q_token_stride, scratch, num_tokens, num_kv_heads, group,
                           head_dim, num_keys, keys_pad, scale, out, lse};
    run(&d);
#endif
    return 0;
}
