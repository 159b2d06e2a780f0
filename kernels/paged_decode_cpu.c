/* Paged decode attention for CPUs: one query token per sequence, keys and values read in
 * place from the paged cache, with no gather and no padding. kernels/cpu_build.py compiles
 * it on first use; kernels/cpu_decode.py checks the arguments and calls it through ctypes.
 *
 * Cache layout: [num_blocks, block_size, num_kv_heads, head_dim]. Sequence t's key at
 * position p is row p % block_size of block block_tables[t, p / block_size]; the sequence
 * attends to positions [lo[t], hi[t]). Query head h * group + g reads KV head h (GQA).
 *
 * A work item is one sequence and a run of its KV heads, so a key row is read as one
 * contiguous span. Keys are taken 16 at a time (never across a block): each key's dot
 * products are summed along head_dim as 16-lane partials, and the 16 partial vectors are
 * reduced together by a transpose-add tree into one vector of 16 scores. Softmax is online
 * (running max and sum per query row) with a vectorised exp. Accumulation and the
 * log-sum-exp are float32 for float32 and bfloat16 caches alike. Float32 chunks are walked
 * one query row at a time (accumulators stay in registers); bfloat16 chunks key by key, so
 * that each key row is widened to float32 once for all the query rows that read it.
 *
 * Written with GCC/Clang vector extensions rather than intrinsics, so the compiler maps
 * them to whatever the host has (AVX-512, AVX2, NEON). The OpenMP loop runs on the OpenMP
 * runtime torch itself loaded, so its threads are torch's threads.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_vec.h"

#define MAX_GROUP 16   /* query heads per KV head */
#define MAX_CHUNKS 16  /* head_dim / 16 */

/* the maximum of v's lanes, in every lane (a butterfly: no serial chain of 16 steps) */
static inline f32x16 max_all(f32x16 v) {
    v = vmax(v, SHUFFLE(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    v = vmax(v, SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    v = vmax(v, SHUFFLE(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    return vmax(v, SHUFFLE(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
}

/* out[i] = sum of the 16 lanes of x[i], for 16 vectors, in 15 adds and 30 shuffles */
static inline f32x16 transpose_sum16(const f32x16 *x) {
    f32x16 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = SHUFFLE(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + SHUFFLE(x[2 * i], x[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        b[i] = SHUFFLE(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
             + SHUFFLE(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        c[i] = SHUFFLE(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
             + SHUFFLE(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return SHUFFLE(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + SHUFFLE(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

#define MAX_ROWS 32    /* query rows one work item carries (heads_per_item * group) */

/* Elements are float32 (bf16 == 0) or bfloat16 (bf16 == 1); the functions below are
 * inlined with a constant flag, so each entry point compiles to its own straight code. */
static inline f32x16 load16(const void *base, int64_t i, int bf16) {
    return bf16 ? load_bf16((const uint16_t *)base + i) : load_f32((const float *)base + i);
}
static inline void store16(void *base, int64_t i, f32x16 v, int bf16) {
    if (bf16) store_bf16((uint16_t *)base + i, v);
    else store_f32((float *)base + i, v);
}
static inline void prefetch_rows(const void *cache, int64_t first, int64_t rows,
                                 int64_t row_stride, int64_t bytes, int bf16) {
    const char *p = (const char *)cache + first * (bf16 ? 2 : 4);
    const int64_t stride = row_stride * (bf16 ? 2 : 4);
    for (int64_t j = 0; j < rows; j++)
        for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(p + j * stride + c);
}

/* Keys [j0, j0 + n) of a sequence lie in one block: the chunk starting at j0. */
static inline int64_t chunk_len(int64_t j0, int64_t end, int64_t block_size) {
    int64_t n = block_size - j0 % block_size;
    if (n > 16) n = 16;
    return n < end - j0 ? n : end - j0;
}

/* One row's online-softmax step over a chunk: part holds the 16 keys' partial dot products
 * (lanes past the chunk's end must be 0 and are masked to weight 0). Updates the running
 * max m and per-lane sum l, rescales the accumulators acc[0..nc), and returns the keys'
 * weights. */
static inline __attribute__((always_inline)) f32x16 softmax_step(
        f32x16 *part, i32x16 valid, f32x16 *m, f32x16 *l, f32x16 *acc, int64_t nc) {
    f32x16 s = transpose_sum16(part);
    s = (f32x16)(((i32x16)s & valid) | ((i32x16)((f32x16){0} - INFINITY) & ~valid));
    const f32x16 m_new = vmax(*m, max_all(s));
    const f32x16 corr = vexp(*m - m_new);
    const f32x16 e = (f32x16)((i32x16)vexp(s - m_new) & valid);
    *m = m_new;
    if (corr[0] != 1.f) {
        *l *= corr;
        for (int64_t c = 0; c < nc; c++) acc[c] *= corr;
    }
    *l += e;
    return e;
}

/* One work item: sequence t, KV heads [h0, h0 + nh). */
static inline __attribute__((always_inline)) void decode_item(
        const void *q, int64_t q_token_stride, const void *k_cache, const void *v_cache,
        const int32_t *table, int64_t lo, int64_t hi, int64_t t, int64_t h0, int64_t nh,
        int64_t num_kv_heads, int64_t group, int64_t head_dim, int64_t block_size,
        float scale, void *out, float *lse, int bf16) {
    const int64_t nc = head_dim / 16, key_stride = num_kv_heads * head_dim, rows = nh * group;
    const int64_t span = nh * head_dim * (bf16 ? 2 : 4);  /* bytes of one key row we read */
    const i32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    f32x16 qv[MAX_ROWS][MAX_CHUNKS], acc[MAX_ROWS][MAX_CHUNKS];
    /* per row: running max (the same in every lane) and running sum (per lane) */
    f32x16 m[MAX_ROWS], l[MAX_ROWS];
    const int64_t q0 = t * q_token_stride + h0 * group * head_dim;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c = 0; c < nc; c++) {
            qv[r][c] = load16(q, q0 + r * head_dim + c * 16, bf16) * scale;
            acc[r][c] = (f32x16){0};
        }
        m[r] = (f32x16){0} - INFINITY;
        l[r] = (f32x16){0};
    }
    for (int64_t j0 = lo; j0 < hi;) {
        const int64_t n = chunk_len(j0, hi, block_size);
        const int64_t base = ((int64_t)table[j0 / block_size] * block_size + j0 % block_size)
                             * key_stride + h0 * head_dim;
        const i32x16 valid = lane < (int32_t)n;
        if (j0 + n < hi) {  /* start loading the next chunk's rows */
            const int64_t j1 = j0 + n;
            const int64_t next = ((int64_t)table[j1 / block_size] * block_size + j1 % block_size)
                                 * key_stride + h0 * head_dim;
            const int64_t n1 = chunk_len(j1, hi, block_size);
            prefetch_rows(k_cache, next, n1, key_stride, span, bf16);
            prefetch_rows(v_cache, next, n1, key_stride, span, bf16);
        }
        if (!bf16) {
            /* float32: one query row at a time, its q and accumulators in registers; the
             * chunk's rows stay in L1 after the first query row has read them */
            const float *kf = (const float *)k_cache + base, *vf = (const float *)v_cache + base;
            for (int64_t r = 0; r < rows; r++) {
                const int64_t hoff = (r / group) * head_dim;
                f32x16 qr[MAX_CHUNKS], a[MAX_CHUNKS], part[16];
                for (int64_t c = 0; c < nc; c++) qr[c] = qv[r][c], a[c] = acc[r][c];
                for (int64_t j = 0; j < 16; j++) {
                    f32x16 x = {0};
                    if (j < n)
                        for (int64_t c = 0; c < nc; c++)
                            x += qr[c] * load_f32(kf + j * key_stride + hoff + c * 16);
                    part[j] = x;
                }
                const f32x16 e = softmax_step(part, valid, &m[r], &l[r], a, nc);
                for (int64_t j = 0; j < n; j++)
                    for (int64_t c = 0; c < nc; c++)
                        a[c] += e[j] * load_f32(vf + j * key_stride + hoff + c * 16);
                for (int64_t c = 0; c < nc; c++) acc[r][c] = a[c];
            }
        } else {
            /* bfloat16: each key row is widened once and used by all its query rows */
            f32x16 part[MAX_ROWS][16], p[MAX_ROWS];
            for (int64_t j = 0; j < n; j++)
                for (int64_t hh = 0; hh < nh; hh++) {
                    f32x16 kv[MAX_CHUNKS];
                    for (int64_t c = 0; c < nc; c++)
                        kv[c] = load16(k_cache, base + j * key_stride + hh * head_dim + c * 16,
                                       bf16);
                    for (int64_t g = 0; g < group; g++) {
                        const int64_t r = hh * group + g;
                        f32x16 x = qv[r][0] * kv[0];
                        for (int64_t c = 1; c < nc; c++) x += qv[r][c] * kv[c];
                        part[r][j] = x;
                    }
                }
            for (int64_t r = 0; r < rows; r++) {
                for (int64_t j = n; j < 16; j++) part[r][j] = (f32x16){0};
                p[r] = softmax_step(part[r], valid, &m[r], &l[r], acc[r], nc);
            }
            for (int64_t j = 0; j < n; j++)
                for (int64_t hh = 0; hh < nh; hh++) {
                    f32x16 vv[MAX_CHUNKS];
                    for (int64_t c = 0; c < nc; c++)
                        vv[c] = load16(v_cache, base + j * key_stride + hh * head_dim + c * 16,
                                       bf16);
                    for (int64_t g = 0; g < group; g++) {
                        const int64_t r = hh * group + g;
                        for (int64_t c = 0; c < nc; c++) acc[r][c] += p[r][j] * vv[c];
                    }
                }
        }
        j0 += n;
    }
    const int64_t o0 = (t * num_kv_heads + h0) * group;
    for (int64_t r = 0; r < rows; r++) {
        const float sum = hsum(l[r]);
        const float inv = sum == 0.f ? 0.f : 1.f / sum;  /* 0 only for an empty range */
        for (int64_t c = 0; c < nc; c++)
            store16(out, (o0 + r) * head_dim + c * 16, acc[r][c] * inv, bf16);
        if (lse) lse[o0 + r] = sum == 0.f ? -INFINITY : m[r][0] + logf(sum);
    }
}

static inline int unsupported(int64_t group, int64_t head_dim, int64_t heads_per_item) {
    return group < 1 || group > MAX_GROUP || head_dim % 16 || head_dim / 16 > MAX_CHUNKS
        || heads_per_item < 1 || heads_per_item * group > MAX_ROWS;
}

/* Entry points, one per element type (each with its own parallel loop, so the element type
 * is a constant inside it). q [num_seqs, num_kv_heads * group, head_dim] with rows
 * q_token_stride elements apart; out contiguous in the same shape; lse (optional)
 * [num_seqs, heads]. Returns nonzero, touching nothing, for a shape it does not handle. */
#define ENTRY(NAME, T, BF16)                                                                  \
int NAME(const T *q, int64_t q_token_stride, const T *k_cache, const T *v_cache,               \
         const int32_t *block_tables, int64_t bt_stride, const int32_t *lo, const int32_t *hi, \
         int64_t num_seqs, int64_t num_kv_heads, int64_t group, int64_t head_dim,              \
         int64_t block_size, float scale, T *out, float *lse, int64_t heads_per_item) {        \
    if (unsupported(group, head_dim, heads_per_item)) return 1;                               \
    const int64_t splits = (num_kv_heads + heads_per_item - 1) / heads_per_item;               \
    _Pragma("omp parallel for schedule(dynamic, 1)")                                           \
    for (int64_t item = 0; item < num_seqs * splits; item++) {                                 \
        const int64_t t = item / splits, h0 = (item % splits) * heads_per_item;                \
        const int64_t nh = num_kv_heads - h0 < heads_per_item ? num_kv_heads - h0              \
                                                              : heads_per_item;                \
        decode_item(q, q_token_stride, k_cache, v_cache, block_tables + t * bt_stride, lo[t],  \
                    hi[t], t, h0, nh, num_kv_heads, group, head_dim, block_size, scale, out,   \
                    lse, BF16);                                                                \
    }                                                                                          \
    return 0;                                                                                  \
}
ENTRY(paged_decode_f32, float, 0)
ENTRY(paged_decode_bf16, uint16_t, 1)
