/* Causal attention of prompt chunks for CPUs: each chunk's query tokens against its keys in
 * the paged cache, read in place. kernels/cpu/build.py compiles it on first use;
 * kernels/cpu/prefill.py checks the arguments and calls it through ctypes.
 *
 * Cache layout as for the decode kernel: [num_blocks, block_size, num_kv_heads, head_dim];
 * position p of sequence s is row p % block_size of block block_tables[s, p / block_size].
 * A chunk is (s, q0, q1, lo, hi): query tokens [q0, q1) of the batch are the last
 * n = q1 - q0 positions of sequence s, whose context ends at hi, and they attend to key
 * positions from lo on, causally: the chunk's i-th token sees [lo, hi - n + i + 1).
 * Query head h * group + g reads KV head h (GQA).
 *
 * Unlike a decode, a prompt's keys are read by many query rows (every later token and every
 * query head of the group), so this is a blocked product rather than a walk: a work item
 * is one chunk, one KV head and up to ITEM_ROWS of its query rows (token-major, the
 * group's heads within a token). It widens the keys to float32 KEY_BLOCK at a time into
 * thread-local buffers and takes the rows 16 at a time, one row per vector lane: their
 * queries are stored transposed, so a key's scores for all 16 rows are head_dim
 * multiply-adds of a query vector by the key's broadcast element, 8 keys at once. The
 * online softmax (running max and sum per row, carried across key blocks) is vectorised
 * across the rows too, and the weighted sum of V runs a few rows at a time with their
 * accumulators in registers. A row group stops at the last key its last row sees; masked
 * weights are 0 (so a NaN or inf value at a key a row cannot see still reaches it, as
 * 0 x NaN, when another row of its pass sees that key; torch's flash kernel spreads such a
 * value to its whole block of rows).
 *
 * float32 throughout, for float32 and bfloat16 caches alike; except that bfloat16 chunks
 * with long enough contexts, on AMD CPUs with AVX512-BF16 (Zen 4 and later, where its
 * paired dot product runs twice the multiply-adds of float32 FMAs), run as small matrix
 * products on it instead (prefill_item_dot, on dot_attn.h's micro-kernel; from about a
 * thousand keys on 1.5-1.7x faster at head_dim 64 and 128, 1.2-1.3x at 32). On an Intel
 * Xeon with AMX the dot product was no faster than float32 FMAs (it issues at half their
 * rate), and AMX tiles for the two products gained about 1% end to end. A build without
 * the instructions runs prefill_item_dot on FMAs (dot_attn.h) when asked (bf16_dot), with
 * the same results; the caller does not ask, as it has no faster products there.
 *
 * init_out/init_lse (optional): a partial result of the same query rows over other keys
 * (a cascade's shared prefix), merged in by starting each row's softmax from it.
 *
 * An FP8 cache holds E4M3 codes (kernels/fp8.py), widened exactly as keys are read (to
 * float32, or for the bfloat16 micro-kernel to bfloat16, which holds every E4M3 value); the
 * K scale is folded into the scores' scale by the caller, and the V scale multiplies each
 * row's result (a partial result to start from is divided by it first). */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dot_attn.h"
#include "vec.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define INLINE static inline __attribute__((always_inline))

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define KEY_BLOCK 256   /* keys widened and attended at a time (K and V: 2 x 64 KB at 64 wide) */
#define ITEM_ROWS 512   /* query rows per work item, about: the keys are widened once each */

/* Per-thread scratch, grown on demand and kept while the thread lives (torch's OpenMP
 * threads live as long as the process), so a call does not map fresh pages for it; freed
 * when a thread that called in exits. NULL when out of memory. */
struct scratch { float *p; size_t floats; };
static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;

static void scratch_free(void *v) {
    struct scratch *s = v;
    free(s->p);
    free(s);
}
static void scratch_key_create(void) { pthread_key_create(&scratch_key, scratch_free); }

static float *thread_scratch(size_t floats) {
    pthread_once(&scratch_once, scratch_key_create);
    struct scratch *s = pthread_getspecific(scratch_key);
    if (!s) {
        if (!(s = calloc(1, sizeof *s)) || pthread_setspecific(scratch_key, s)) {
            free(s);
            return NULL;
        }
    }
    if (floats > s->floats) {
        free(s->p);
        s->p = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
        s->floats = s->p ? floats : 0;
    }
    return s->p;
}

/* exp(x) for softmax weights (x <= 0 but for rounding): 2^n * 2^f with n = round(x log2 e)
 * and 2^f, |f| <= 1/2, from its degree-6 Taylor polynomial (relative error ~2e-7 plus
 * ~3e-8 * |x| from log2 e's rounding). With AVX-512, vscalefps applies 2^n: half the
 * instructions of vexp's clamped Cephes form. x is held at -87 and above, so exp(-inf) is
 * about 1.6e-38, not 0 (callers zero masked weights themselves, and a rescale that small
 * vanishes in float32 sums); a NaN stays NaN. */
INLINE fvec exp_weight(fvec x) {
#if defined(__AVX512F__)
    /* results stay normal floats: a denormal one takes a microcode assist (~100 cycles) */
    x = fvmax((fvec){0} - 87.f, x);  /* fvmax keeps its second argument when it is NaN */
    const __m512 t = (__m512)(x * 1.44269504088896341f);
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const fvec f = (fvec)_mm512_sub_ps(t, n);
    fvec p = (fvec){0} + 1.5403530393381609e-4f;   /* ln2^6 / 6! */
    p = p * f + 1.3333558146428443e-3f;                /* ln2^5 / 5! */
    p = p * f + 9.6181291076284772e-3f;                /* ln2^4 / 4! */
    p = p * f + 5.5504108664821580e-2f;                /* ln2^3 / 3! */
    p = p * f + 2.4022650695910071e-1f;                /* ln2^2 / 2! */
    p = p * f + 6.9314718055994531e-1f;                /* ln2 */
    p = p * f + 1.0f;
    return (fvec)_mm512_scalef_ps((__m512)p, n);
#else
    return vexp_fv(x);
#endif
}

/* Transpose 16 vectors in place (x[i][j] <-> x[j][i]): at each level b = 8, 4, 2, 1, rows
 * i and i + b swap their off-diagonal b-wide blocks. */
INLINE void transpose16(f32x16 *x) {
#define UNPAREN(...) __VA_ARGS__
#define SWAP(B, LO, HI)                                                                      \
    for (int i = 0; i < 16; i++)                                                             \
        if (!(i & B)) {                                                                      \
            const f32x16 lo = x[i], hi = x[i + B];                                           \
            x[i] = SHUFFLE(lo, hi, UNPAREN LO);                                              \
            x[i + B] = SHUFFLE(lo, hi, UNPAREN HI);                                          \
        }
    SWAP(8, (0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),
            (8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31))
    SWAP(4, (0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27),
            (4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31))
    SWAP(2, (0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29),
            (2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31))
    SWAP(1, (0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30),
            (1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31))
#undef SWAP
#undef UNPAREN
}

/* 16 elements at element i of a cache of the element type (bf16 as for load16), or of
 * E4M3 codes (fp8), widened */
INLINE f32x16 load16_kv(const void *base, int64_t i, int bf16, int fp8) {
    return fp8 ? load_fp8((const uint8_t *)base + i) : load16(base, i, bf16);
}

/* Keys [k0, k0 + n) of the sequence whose block table is table, widened to float32 rows of
 * head_dim: kb[j * head_dim + d] = K[j][d], vb likewise. */
INLINE void widen_block(const void *k_cache, const void *v_cache, const int32_t *table,
                        int64_t block_size, int64_t key_stride, int64_t head_off, int64_t k0,
                        int64_t n, int64_t head_dim, float *kb, float *vb, int bf16, int fp8) {
    for (int64_t j = 0; j < n; j++) {
        const int64_t p = k0 + j;
        const int64_t at = ((int64_t)table[p / block_size] * block_size + p % block_size)
                           * key_stride + head_off;
        for (int64_t c = 0; c < head_dim; c += 16) {
            store_f32(kb + j * head_dim + c, load16_kv(k_cache, at + c, bf16, fp8));
            store_f32(vb + j * head_dim + c, load16_kv(v_cache, at + c, bf16, fp8));
        }
    }
}

/* keys whose scores are summed together: independent FMA chains, KEYS_PER_STEP x NSUB
 * accumulators and the query's NSUB vectors in registers (16 AVX2 registers: 4 keys) */
#define KEYS_PER_STEP (NLANES == 16 ? 8 : 4)

/* One group of 16 query rows over a widened block of keys. qt: the rows' scaled queries
 * transposed ([head_dim][16]); m, l: their running max and sum; a: their accumulators
 * ([16][head_dim]); lim: how many of the block's keys each row sees (non-decreasing: rows
 * are token-major); s: [KEY_BLOCK][16] scratch. Compiled for constant NC = head_dim / 16,
 * R rows per weighted-sum pass and CB of a row's NC 16-element chunks at a time (R x CB x
 * NSUB accumulators in registers). Works in fvecs (vec.h), NSUB to 16 lanes; every sum and
 * maximum is taken in the same order whatever NSUB. */
INLINE void row_group(const float *qt, float *m, float *l, float *a, const int32_t *lim,
                      int64_t cols, const float *kb, const float *vb, float *s,
                      const int64_t NC, const int64_t R, const int64_t CB) {
    const int64_t D = NC * 16;
    /* scores, one vector of the 16 rows per key: row-vector x key, summed along head_dim */
    for (int64_t j = 0; j < cols; j += KEYS_PER_STEP) {
        fvec acc[KEYS_PER_STEP][NSUB];
        for (int64_t k = 0; k < KEYS_PER_STEP; k++)
            for (int h = 0; h < NSUB; h++) acc[k][h] = (fvec){0};
        for (int64_t d = 0; d < D; d++)
            for (int h = 0; h < NSUB; h++) {
                const fvec q = load_fv(qt + d * 16 + NLANES * h);
                for (int64_t k = 0; k < KEYS_PER_STEP; k++) acc[k][h] += kb[(j + k) * D + d] * q;
            }
        for (int64_t k = 0; k < KEYS_PER_STEP; k++)
            for (int h = 0; h < NSUB; h++) store_fv(s + (j + k) * 16 + NLANES * h, acc[k][h]);
    }
    /* online softmax, every row at once: weights replace the scores, 0 past a row's limit */
    const fvec neg_inf = (fvec){0} - INFINITY;
    float corr[16];  /* each row's rescale of its accumulators */
    for (int h = 0; h < NSUB; h++) {
        ivec lim_h;
        memcpy(&lim_h, lim + NLANES * h, sizeof lim_h);
        fvec mx = neg_inf;  /* a NaN score is passed over here (fvmax keeps its second
                             * argument) and shows as NaN through its weight instead */
        for (int64_t j = 0; j < cols; j++) {
            const ivec valid = (ivec){0} + (int32_t)j < lim_h;
            mx = fvmax((fvec)(((ivec)load_fv(s + j * 16 + NLANES * h) & valid)
                              | ((ivec)neg_inf & ~valid)), mx);
        }
        const fvec m_old = load_fv(m + NLANES * h), m_new = fvmax(m_old, mx);
        /* a row with nothing yet and nothing here keeps corr 1 and weights 0 */
        const ivec none = (ivec)(m_new == neg_inf);
        const fvec corr_h = exp_weight((fvec)((ivec)(m_old - m_new) & ~none));
        fvec sum = (fvec){0};
        for (int64_t j = 0; j < cols; j++) {
            const ivec valid = ((ivec){0} + (int32_t)j < lim_h) & ~none;
            float *sj = s + j * 16 + NLANES * h;
            const fvec e = (fvec)((ivec)exp_weight(load_fv(sj) - m_new) & valid);
            store_fv(sj, e);
            sum += e;
        }
        store_fv(m + NLANES * h, m_new);
        store_fv(l + NLANES * h, load_fv(l + NLANES * h) * corr_h + sum);
        store_fv(corr + NLANES * h, corr_h);
    }
    /* weighted values, R rows x CB chunks at a time with their accumulators in registers */
    for (int64_t r0 = 0; r0 < 16; r0 += R) {
        int64_t end = 0;  /* keys any of these rows sees */
        for (int64_t r = r0; r < r0 + R; r++) end = lim[r] > end ? lim[r] : end;
        for (int64_t c0 = 0; c0 < NC; c0 += CB) {
            fvec acc[R * CB * NSUB];
            for (int64_t r = 0; r < R; r++)
                for (int64_t c = 0; c < CB * NSUB; c++)
                    acc[r * CB * NSUB + c] = load_fv(a + (r0 + r) * D + c0 * 16 + c * NLANES)
                                             * corr[r0 + r];
            for (int64_t j = 0; j < end; j++)
                for (int64_t c = 0; c < CB * NSUB; c++) {
                    const fvec v = load_fv(vb + j * D + c0 * 16 + c * NLANES);
                    for (int64_t r = 0; r < R; r++) acc[r * CB * NSUB + c] += s[j * 16 + r0 + r] * v;
                }
            for (int64_t r = 0; r < R; r++)
                for (int64_t c = 0; c < CB * NSUB; c++)
                    store_fv(a + (r0 + r) * D + c0 * 16 + c * NLANES, acc[r * CB * NSUB + c]);
        }
    }
}

/* row_group compiled for the common head sizes: with AVX-512's 32 registers, R x NC = 16
 * vectors of accumulators; with 16 AVX2 registers (NEON's 32 of 4 lanes), 2 rows x 2 chunks
 * (8 of 8 lanes) */
INLINE void row_group_any(const float *qt, float *m, float *l, float *a, const int32_t *lim,
                          int64_t cols, const float *kb, const float *vb, float *s,
                          int64_t nc) {
#if NLANES == 16
#define ROW_GROUP(NC) row_group(qt, m, l, a, lim, cols, kb, vb, s, NC, 16 / (NC), NC)
#else
#define ROW_GROUP(NC) row_group(qt, m, l, a, lim, cols, kb, vb, s, NC, 2, 2)
#endif
    switch (nc) {
    case 2: ROW_GROUP(2); break;
    case 4: ROW_GROUP(4); break;
    case 8: ROW_GROUP(8); break;
    case 16: ROW_GROUP(16); break;
    default:  /* other head sizes: nc not constant */
        row_group(qt, m, l, a, lim, cols, kb, vb, s, nc, 1, 1);
    }
#undef ROW_GROUP
}

/* One work item: chunk tokens [t0, t1) (0-based in the chunk of n tokens starting at batch
 * token q0), KV head h. Its query rows are token-major (the group's heads within a token),
 * in groups of 16; padding rows repeat the last row and are not stored. */
INLINE int prefill_item(
        const void *q, int64_t q_token_stride, const void *k_cache, const void *v_cache,
        const int32_t *table, int64_t block_size, int64_t q0, int64_t n, int64_t lo,
        int64_t hi, int64_t t0, int64_t t1, int64_t h, int64_t num_kv_heads, int64_t group,
        int64_t head_dim, float scale, void *out, float *lse, const void *init_out,
        const float *init_lse, const int64_t *init_strides, float v_scale, int bf16, int fp8) {
    const int64_t D = head_dim, heads = num_kv_heads * group;
    const int64_t rows = (t1 - t0) * group, padded = (rows + 15) / 16 * 16;
    const int64_t key_stride = num_kv_heads * head_dim;
    /* a key block's widened K and V, one group's scores, then per row: transposed query,
     * accumulator, max, sum */
    float *kb = thread_scratch((size_t)(2 * KEY_BLOCK * D + 16 * KEY_BLOCK + 2 * padded * D
                                        + 2 * padded));
    if (!kb) return 1;  /* out of memory */
    /* the score loop reads keys up to the block's count rounded up to 8 (at most
     * KEY_BLOCK): rows past the count hold whatever was there before, and their scores are
     * masked */
    float *vb = kb + KEY_BLOCK * D, *s = vb + KEY_BLOCK * D;
    float *qt = s + 16 * KEY_BLOCK, *a = qt + padded * D, *m = a + padded * D, *l = m + padded;
    int32_t last[ITEM_ROWS + 16];  /* each row's keys end here (exclusive) */
    const int64_t *os = init_strides, *ls = init_strides + 3;
    for (int64_t r = 0; r < padded; r++) {
        const int64_t rr = r < rows ? r : rows - 1;
        const int64_t i = t0 + rr / group, g = rr % group, token = q0 + i;
        last[r] = (int32_t)(hi - n + i + 1);
        const float init = init_lse ? init_lse[token * ls[0] + h * ls[1] + g * ls[2]]
                                    : -INFINITY;
        m[r] = init;
        l[r] = init == -INFINITY ? 0.f : 1.f;
        for (int64_t c = 0; c < D; c += 16)
            store_f32(a + r * D + c, init == -INFINITY ? (f32x16){0}
                      : load16(init_out, token * os[0] + h * os[1] + g * os[2] + c, bf16)
                            * (1.f / v_scale));
    }
    /* queries, scaled, 16 rows x 16 elements at a time transposed into qt */
    for (int64_t g0 = 0; g0 < padded; g0 += 16)
        for (int64_t c = 0; c < D; c += 16) {
            f32x16 x[16];
            for (int64_t r = 0; r < 16; r++) {
                const int64_t rr = g0 + r < rows ? g0 + r : rows - 1;
                const int64_t token = q0 + t0 + rr / group, head = h * group + rr % group;
                x[r] = load16(q, token * q_token_stride + head * D + c, bf16) * scale;
            }
            transpose16(x);
            for (int64_t e = 0; e < 16; e++) store_f32(qt + g0 * D + (c + e) * 16, x[e]);
        }
    const int64_t end = last[padded - 1];
    for (int64_t k0 = lo; k0 < end; k0 += KEY_BLOCK) {
        const int64_t kn = end - k0 < KEY_BLOCK ? end - k0 : KEY_BLOCK;
        widen_block(k_cache, v_cache, table, block_size, key_stride, h * D, k0, kn, D, kb, vb,
                    bf16, fp8);
        for (int64_t g0 = 0; g0 < padded; g0 += 16) {
            int32_t lim[16];
            for (int64_t r = 0; r < 16; r++) {
                const int64_t see = last[g0 + r] - k0;
                lim[r] = (int32_t)(see < 0 ? 0 : see > kn ? kn : see);
            }
            if (lim[15] == 0) continue;  /* the group's last row sees the most */
            row_group_any(qt + g0 * D, m + g0, l + g0, a + g0 * D, lim, lim[15], kb, vb, s,
                          D / 16);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t token = q0 + t0 + r / group, head = h * group + r % group;
        const float inv = l[r] == 0.f ? 0.f : 1.f / l[r] * v_scale;  /* 0: no keys, no init */
        for (int64_t c = 0; c < D; c += 16)
            store16(out, token * heads * D + head * D + c, load_f32(a + r * D + c) * inv, bf16);
        if (lse) lse[token * heads + head] = l[r] == 0.f ? -INFINITY : m[r] + logf(l[r]);
    }
    return 0;
}

/* 16 words of pairs of bfloat16: elements [i, i + 32) of a bfloat16 cache, or of an E4M3
 * one (fp8) widened exactly */
INLINE f32x16 load_pairs_kv(const void *base, int64_t i, int fp8) {
    f32x16 x;
    if (fp8) {
        u16x16 w;
        memcpy(&w, (const uint8_t *)base + i, sizeof w);
        const f32x16 even = fp8_to_f32(__builtin_convertvector(w & 0xff, u32x16));
        const f32x16 odd = fp8_to_f32(__builtin_convertvector(w >> 8, u32x16));
        u32x16 e, o;
        memcpy(&e, &even, sizeof e);
        memcpy(&o, &odd, sizeof o);
        const u32x16 pairs = e >> 16 | (o & 0xffff0000u);
        memcpy(&x, &pairs, sizeof x);
    } else {
        memcpy(&x, (const uint16_t *)base + i, sizeof x);
    }
    return x;
}
/* elements [i, i + 16) of a bfloat16 cache, or of an E4M3 one (fp8) widened exactly, as
 * bfloat16 bits */
INLINE u16x16 load_bf16_kv(const void *base, int64_t i, int fp8) {
    u16x16 h;
    if (fp8) {
        const f32x16 v = load_fp8((const uint8_t *)base + i);
        u32x16 u;
        memcpy(&u, &v, sizeof u);
        h = __builtin_convertvector(u >> 16, u16x16);
    } else {
        memcpy(&h, (const uint16_t *)base + i, sizeof h);
    }
    return h;
}

/* bfloat16 keys [k0, k0 + n) of KV head h (head_off = h * D) laid out for dot_attn.h,
 * padded with zeros to kpad (n rounded up to 64): K's pairs of dimensions key-major
 * ([D/2][kpad] words; 16 keys x 16 words at a time, transposed in registers), V's pairs of
 * keys ([kpad/2][D] words). D is a multiple of 32. The cache holds bfloat16, or E4M3 codes
 * (fp8). */
INLINE void lay_out_block(const void *k_cache, const void *v_cache,
                          const int32_t *table, int64_t block_size, int64_t key_stride,
                          int64_t head_off, int64_t k0, int64_t n, int64_t kpad, int64_t D,
                          uint32_t *kl, uint32_t *vl, int fp8) {
#define ROW(p) (((int64_t)table[(k0 + (p)) / block_size] * block_size + (k0 + (p)) % block_size) \
                * key_stride + head_off)
    for (int64_t p0 = 0; p0 < kpad; p0 += 16)
        for (int64_t w0 = 0; w0 < D / 2; w0 += 16) {
            f32x16 x[16];
            for (int64_t j = 0; j < 16; j++) {
                if (p0 + j < n) x[j] = load_pairs_kv(k_cache, ROW(p0 + j) + 2 * w0, fp8);
                else x[j] = (f32x16){0};
            }
            transpose16(x);
            for (int64_t e = 0; e < 16; e++) memcpy(kl + (w0 + e) * kpad + p0, &x[e], sizeof x[e]);
        }
    for (int64_t f = 0; f < kpad / 2; f++) {
        const int64_t a = 2 * f < n ? ROW(2 * f) : -1;
        const int64_t b = 2 * f + 1 < n ? ROW(2 * f + 1) : -1;
        for (int64_t e = 0; e < D; e += 16) {
            u16x16 lo = {0}, hi = {0};
            if (a >= 0) lo = load_bf16_kv(v_cache, a + e, fp8);
            if (b >= 0) hi = load_bf16_kv(v_cache, b + e, fp8);
            const u32x16 w = __builtin_convertvector(lo, u32x16)
                           | __builtin_convertvector(hi, u32x16) << 16;
            memcpy(vl + f * D + e, &w, sizeof w);
        }
    }
#undef ROW
}

/* Row i of a work item's state (output o, D floats a row; running max m and sum l) into
 * row r of the micro-kernel's, and back. */
INLINE void row_in(dot_rows *st, int r, const float *o, const float *m, const float *l,
                   int64_t i, int64_t D) {
    memcpy(st->o + r * DOT_MAX_HEAD_DIM, o + i * D, 4 * D);
    st->m[r] = m[i];
    st->l[r] = l[i];
}
INLINE void row_out(const dot_rows *st, int r, float *o, float *m, float *l, int64_t i,
                    int64_t D) {
    memcpy(o + i * D, st->o + r * DOT_MAX_HEAD_DIM, 4 * D);
    m[i] = st->m[r];
    l[i] = st->l[r];
}

/* A chunk takes prefill_item_dot from this many keys times head_dim on: below it the
 * micro-kernel's fixed costs (laying out keys, 64-key score blocks on the causal diagonal,
 * moving each row's state in and out per key block) outweigh its faster products. Measured
 * on a 2-core Zen 4, 8192 tokens in equal chunks, against prefill_item: head_dim 32 at 1.18x
 * the time at 256 keys, 0.93x at 512, 0.85x at 1024; head_dim 64 at 1.11x at 128 keys,
 * 0.84x at 256, 0.65x at 1024; head_dim 128, one 1024-token chunk, 0.59x. */
#define DOT_MIN_KEY_ELEMENTS 16384

/* prefill_item for bfloat16 (head_dim a multiple of 32), made for AVX512-BF16: the
 * same work item as two small products per block of keys on dot_attn.h's micro-kernel,
 * whose paired dot products run twice the multiply-adds of float32 FMAs. Each block of up
 * to DOT_KEY_BLOCK keys is laid out once for the item; the item's rows then take it
 * DOT_ROWS at a time, each stopping at the last key its last row sees, their softmax state
 * and output kept in the item's scratch between blocks. */
INLINE int prefill_item_dot(
        const uint16_t *q, int64_t q_token_stride, const void *k_cache,
        const void *v_cache, const int32_t *table, int64_t block_size, int64_t q0,
        int64_t n, int64_t lo, int64_t hi, int64_t t0, int64_t t1, int64_t h,
        int64_t num_kv_heads, int64_t group, int64_t head_dim, float scale, uint16_t *out,
        float *lse, const uint16_t *init_out, const float *init_lse,
        const int64_t *init_strides, float v_scale, int fp8) {
    const int64_t D = head_dim, heads = num_kv_heads * group;
    const int64_t rows = (t1 - t0) * group;
    const int64_t padded = (rows + DOT_ROWS - 1) / DOT_ROWS * DOT_ROWS;
    float *buf = thread_scratch((size_t)(D * DOT_KEY_BLOCK + padded * (D + 2)));
    if (!buf) return 1;  /* out of memory */
    uint32_t *kl = (uint32_t *)buf, *vl = kl + D / 2 * DOT_KEY_BLOCK;
    float *o = (float *)(vl + DOT_KEY_BLOCK / 2 * D), *m = o + padded * D, *l = m + padded;
    int64_t last[ITEM_ROWS + DOT_ROWS];  /* each row's keys end here (exclusive) */
    const int64_t *os = init_strides, *ls = init_strides + 3;
    dot_rows st;
    /* row r of the item: token q0 + t0 + r / group, query head h * group + r % group;
     * padding rows repeat the last row */
#define TOKEN(r) (q0 + t0 + ((r) < rows ? (r) : rows - 1) / group)
#define GROUP_ROW(r) (((r) < rows ? (r) : rows - 1) % group)
    for (int64_t r = 0; r < padded; r++) {
        const int64_t token = TOKEN(r), g = GROUP_ROW(r);
        last[r] = hi - n + (token - q0) + 1;
        const int64_t rr = r % DOT_ROWS;
        dot_start_row(&st, rr, init_lse ? init_lse[token * ls[0] + h * ls[1] + g * ls[2]]
                                        : -INFINITY,
                      init_out ? init_out + token * os[0] + h * os[1] + g * os[2] : NULL,
                      D, 1, v_scale);
        row_out(&st, rr, o, m, l, r, D);
    }
    const int64_t key_stride = num_kv_heads * D, end = last[padded - 1];
    for (int64_t k0 = lo; k0 < end; k0 += DOT_KEY_BLOCK) {
        const int64_t kn = end - k0 < DOT_KEY_BLOCK ? end - k0 : DOT_KEY_BLOCK;
        lay_out_block(k_cache, v_cache, table, block_size, key_stride, h * D, k0, kn,
                      (kn + 63) / 64 * 64, D, kl, vl, fp8);
        for (int64_t r0 = 0; r0 < padded; r0 += DOT_ROWS) {
            const int64_t see = last[r0 + DOT_ROWS - 1] - k0;  /* the block's last row */
            if (see <= 0) continue;
            const int64_t vis = see < kn ? see : kn;
            int64_t valid[DOT_ROWS];
            for (int r = 0; r < DOT_ROWS; r++) {
                const int64_t i = r0 + r;
                dot_load_query(&st, r, q + TOKEN(i) * q_token_stride
                                          + (h * group + GROUP_ROW(i)) * D, D, 1);
                row_in(&st, r, o, m, l, i, D);
                valid[r] = (last[i] - k0 < vis ? last[i] - k0 : vis);
            }
            dot_block(&st, kl, vl, (kn + 63) / 64 * 64, D, scale * (float)M_LOG2E, vis, valid,
                      1);
            for (int r = 0; r < DOT_ROWS; r++) row_out(&st, r, o, m, l, r0 + r, D);
        }
    }
    for (int64_t i = 0; i < rows; i++) {
        const int64_t token = TOKEN(i), head = h * group + GROUP_ROW(i);
        row_in(&st, 0, o, m, l, i, D);
        const float row_lse = dot_finish_row(&st, 0, out + (token * heads + head) * D, D, 1,
                                             v_scale);
        if (lse) lse[token * heads + head] = row_lse;
    }
#undef TOKEN
#undef GROUP_ROW
    return 0;
}

/* whether prefill_item_dot runs on the AVX512-BF16 instructions (else on FMAs) */
int prefill_bf16_dot_available(void) { return HAVE_BF16_DOT; }

/* Entry points, one per element type and cache type (that type, or E4M3 codes: FP8, with
 * v_scale; k_scale is the caller's to fold into scale). chunks: num_chunks rows of
 * (s, q0, q1, lo, hi), int32.
 * q [tokens, heads, head_dim] with rows q_token_stride elements apart; out contiguous in the
 * same shape; lse (optional) [tokens, heads] float32. init_out [tokens, num_kv_heads, group,
 * head_dim] and init_lse [tokens, num_kv_heads, group], both or neither, with strides
 * (token, KV head, group row) os0..os2 and ls0..ls2 (head_dim contiguous). bf16_dot: long
 * bfloat16 chunks take prefill_item_dot.
 * Returns nonzero, touching nothing, for a shape it does not handle; 2 when out of memory
 * (out then holds the rows of the items that ran). */
#define ENTRY(NAME, T, CT, BF16, FP8)                                                         \
int NAME(const T *q, int64_t q_token_stride, const CT *k_cache, const CT *v_cache,             \
         const int32_t *block_tables, int64_t bt_stride, int64_t block_size,                   \
         const int32_t *chunks, int64_t num_chunks, int64_t num_kv_heads, int64_t group,       \
         int64_t head_dim, float scale, T *out, float *lse, const T *init_out,                \
         const float *init_lse, int64_t os0, int64_t os1, int64_t os2, int64_t ls0,            \
         int64_t ls1, int64_t ls2, int64_t bf16_dot, float v_scale) {                          \
    const int64_t init_strides[6] = {os0, os1, os2, ls0, ls1, ls2};                           \
    if (!FP8) v_scale = 1.f;                                                                  \
    if (group < 1 || group > MAX_GROUP || head_dim < 16 || head_dim % 16                     \
        || head_dim > MAX_HEAD_DIM                                                            \
        || !init_out != !init_lse)                                                            \
        return 1;                                                                             \
    const int64_t per_item = ITEM_ROWS / group > 0 ? ITEM_ROWS / group : 1;                   \
    int64_t items = 0;                                                                        \
    for (int64_t c = 0; c < num_chunks; c++)                                                  \
        items += (chunks[5 * c + 2] - chunks[5 * c + 1] + per_item - 1) / per_item;           \
    int64_t *item_chunk = malloc(2 * (items + 1) * sizeof(int64_t));                          \
    if (!item_chunk) return 2;                                                                \
    int64_t *item_t0 = item_chunk + items + 1;                                                \
    int failed = 0;  /* a work item could not get its scratch */                              \
    for (int64_t c = 0, i = 0; c < num_chunks; c++)                                           \
        for (int64_t t = 0; t < chunks[5 * c + 2] - chunks[5 * c + 1]; t += per_item, i++) {  \
            item_chunk[i] = c;                                                                \
            item_t0[i] = t;                                                                   \
        }                                                                                     \
    _Pragma("omp parallel for schedule(dynamic, 1)")                                           \
    for (int64_t it = 0; it < items * num_kv_heads; it++) {                                    \
        const int64_t i = it / num_kv_heads, h = it % num_kv_heads;                            \
        const int32_t *ch = chunks + 5 * item_chunk[i];                                        \
        const int64_t n = ch[2] - ch[1], t0 = item_t0[i];                                      \
        const int64_t t1 = t0 + per_item < n ? t0 + per_item : n;                              \
        const int32_t *table = block_tables + ch[0] * bt_stride;                              \
        if (BF16 && bf16_dot && head_dim % 32 == 0                                             \
                && (ch[4] - ch[3]) * head_dim >= DOT_MIN_KEY_ELEMENTS                          \
            ? prefill_item_dot((const uint16_t *)q, q_token_stride, k_cache, v_cache, table,   \
                               block_size, ch[1], n, ch[3], ch[4], t0, t1, h, num_kv_heads,    \
                               group, head_dim, scale, (uint16_t *)out, lse,                   \
                               (const uint16_t *)init_out, init_lse, init_strides, v_scale,    \
                               FP8)                                                            \
            : prefill_item(q, q_token_stride, k_cache, v_cache, table, block_size, ch[1], n,    \
                           ch[3], ch[4], t0, t1, h, num_kv_heads, group, head_dim, scale, out, \
                           lse, init_out, init_lse, init_strides, v_scale, BF16, FP8))         \
            __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);                                    \
    }                                                                                         \
    free(item_chunk);                                                                         \
    return failed ? 2 : 0;                                                                    \
}
ENTRY(prefill_attn_f32, float, float, 0, 0)
ENTRY(prefill_attn_bf16, uint16_t, uint16_t, 1, 0)
ENTRY(prefill_attn_f32_fp8, float, uint8_t, 0, 1)
ENTRY(prefill_attn_bf16_fp8, uint16_t, uint8_t, 1, 1)
