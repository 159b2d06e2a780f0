/* Paged decode attention for CPUs: one query token per sequence, keys and values read in
 * place from the paged cache, with no gather and no padding. kernels/cpu_build.py compiles
 * it on first use; kernels/cpu_decode.py checks the arguments and calls it through ctypes.
 *
 * Cache layout: [num_blocks, block_size, num_kv_heads, head_dim]. Sequence t's key at
 * position p is row p % block_size of block block_tables[t, p / block_size]; the sequence
 * attends to positions [lo[t], hi[t]). Query head h * group + g reads KV head h (GQA).
 *
 * A work item is one sequence and a run of its KV heads. Each KV head's query rows walk its
 * keys together, a few rows per pass, with the rows' queries, accumulators and softmax
 * state in registers: the walk is compiled for each common head size and row count, so
 * every loop bound is a constant. Each key row is loaded (and, for bfloat16, widened) once
 * per pass. Keys are taken 16 at a time (never across a block): each key's dot products
 * are summed along head_dim as 16-lane partials, and the 16 partial vectors are reduced
 * together by a transpose-add tree into one vector of 16 scores. Softmax is online (running
 * max and sum per query row) with a vectorised exp. Accumulation and the log-sum-exp are
 * float32 for float32 and bfloat16 caches alike; bfloat16 rows are widened 32 elements at a
 * time, split into even and odd elements (see load_row). The rows of the next chunk are
 * requested before they are read, since a sequence's blocks lie anywhere in the cache.
 *
 * Written with GCC/Clang vector extensions rather than intrinsics, so the compiler maps
 * them to whatever the host has (AVX-512, AVX2, NEON). The OpenMP loop runs on the OpenMP
 * runtime torch itself loaded, so its threads are torch's threads.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_vec.h"

/* Every helper is inlined: left to its own heuristics, GCC stopped inlining the prefetch
 * helper into some of the specialised walks once they grew, and dropped their prefetches,
 * which cost 20% on a cold cache. */
#define INLINE static inline __attribute__((always_inline))

#define MAX_GROUP 16   /* query heads per KV head */
#define MAX_CHUNKS 16  /* head_dim / 16 */

/* the maximum of v's lanes, in every lane (a butterfly: no serial chain of 16 steps) */
INLINE f32x16 max_all(f32x16 v) {
    v = vmax(v, SHUFFLE(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    v = vmax(v, SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    v = vmax(v, SHUFFLE(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    return vmax(v, SHUFFLE(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
}

/* out[i] = sum of the 16 lanes of x[i], for 16 vectors, in 15 adds and 30 shuffles */
INLINE f32x16 transpose_sum16(const f32x16 *x) {
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

#define MAX_PASS 8     /* query rows walked together (their q and accumulators in registers) */
#define PF_AHEAD 2     /* chunks of K/V rows requested ahead of the one being read */

/* Elements are float32 (bf16 == 0) or bfloat16 (bf16 == 1); the functions below are
 * inlined with a constant flag, so each entry point compiles to its own straight code. */
/* One head row of nc * 16 elements as nc vectors. bfloat16 rows with an even nc are read
 * 32 elements at a time and split into their even and odd elements (a shift and a mask,
 * where widening in order takes a load, a conversion and a shift per 16): dst[2b] holds
 * elements 32b, 32b + 2, ..., dst[2b + 1] elements 32b + 1, 32b + 3, .... q, k, v and the
 * accumulators all use this order, so dot products and weighted sums are unchanged;
 * store_row puts the elements back in place. */
INLINE void load_row(const void *base, int64_t i, f32x16 *dst, int64_t nc, int bf16) {
    if (bf16 && nc % 2 == 0) {
        for (int64_t b = 0; b < nc / 2; b++) {
            u32x16 w;
            memcpy(&w, (const uint16_t *)base + i + 32 * b, sizeof w);
            const u32x16 even = w << 16, odd = w & 0xffff0000u;
            memcpy(&dst[2 * b], &even, sizeof even);
            memcpy(&dst[2 * b + 1], &odd, sizeof odd);
        }
    } else {
        for (int64_t c = 0; c < nc; c++) dst[c] = load16(base, i + 16 * c, bf16);
    }
}
INLINE void store_row(void *base, int64_t i, const f32x16 *src, float scale, int64_t nc,
                      int bf16) {
    if (bf16 && nc % 2 == 0) {
        for (int64_t b = 0; b < nc / 2; b++) {
            const u32x16 even = bf16_bits(src[2 * b] * scale) >> 16;
            const u32x16 odd = bf16_bits(src[2 * b + 1] * scale) & 0xffff0000u;
            const u32x16 w = even | odd;
            memcpy((uint16_t *)base + i + 32 * b, &w, sizeof w);
        }
    } else {
        for (int64_t c = 0; c < nc; c++) store16(base, i + 16 * c, src[c] * scale, bf16);
    }
}
INLINE void prefetch_rows(const void *cache, int64_t first, int64_t rows, int64_t row_stride,
                          int64_t bytes, int bf16) {
    const char *p = (const char *)cache + first * (bf16 ? 2 : 4);
    const int64_t stride = row_stride * (bf16 ? 2 : 4);
    for (int64_t j = 0; j < rows; j++)
        for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(p + j * stride + c);
}

/* Keys [j0, j0 + n) of a sequence lie in one block: the chunk starting at j0. */
INLINE int64_t chunk_len(int64_t j0, int64_t end, int64_t block_size) {
    int64_t n = block_size - j0 % block_size;
    if (n > 16) n = 16;
    return n < end - j0 ? n : end - j0;
}

/* One row's online-softmax step over a chunk: part holds the 16 keys' partial dot products
 * (lanes past the chunk's end must be 0 and are masked to weight 0). Updates the running
 * max m and per-lane sum l, rescales the accumulators acc[0..nc), and returns the keys'
 * weights. */
INLINE f32x16 softmax_step(
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

/* Where a pass's first row finds its partial result (elements into init_out, init_lse),
 * and how far apart its rows' are. */
typedef struct { int64_t out, out_step, lse, lse_step; } init_at;

/* Query rows [r0, r0 + G) of sequence t, all reading KV head h, over keys [lo, hi). Inlined
 * with constant nc (head_dim / 16) and G wherever a case exists for them (see walk()), so
 * the rows' queries, accumulators and softmax state stay in registers for the whole walk
 * and each key row is loaded (and widened) once for all G rows. With init_lse, the walk
 * starts from a partial result over other keys (init_out, its log-sum-exp) and so ends
 * with their merge. */
INLINE void walk_rows(
        const void *q, int64_t q0, const void *k_cache, const void *v_cache,
        const int32_t *table, int64_t lo, int64_t hi, int64_t block_size, int64_t key_stride,
        int64_t head_off, float scale, void *out, float *lse, const void *init_out,
        const float *init_lse, init_at at, int64_t o_row0, const int64_t nc, const int64_t G,
        const int bf16) {
    const i32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const int64_t head_dim = nc * 16, span = head_dim * (bf16 ? 2 : 4);
    f32x16 qr[MAX_PASS * MAX_CHUNKS], a[MAX_PASS * MAX_CHUNKS], m[MAX_PASS], l[MAX_PASS];
    for (int64_t g = 0; g < G; g++) {
        /* a partial result enters as its (normalised) output with weight 1 at its
         * log-sum-exp; one over no keys (-inf) as nothing */
        const float init = init_lse ? init_lse[at.lse + g * at.lse_step] : -INFINITY;
        load_row(q, q0 + g * head_dim, qr + g * nc, nc, bf16);
        for (int64_t c = 0; c < nc; c++) qr[g * nc + c] *= scale;
        if (init != -INFINITY)
            load_row(init_out, at.out + g * at.out_step, a + g * nc, nc, bf16);
        else
            for (int64_t c = 0; c < nc; c++) a[g * nc + c] = (f32x16){0};
        m[g] = (f32x16){0} + init;
        l[g] = init != -INFINITY ? (f32x16){1.f} : (f32x16){0};
    }
    int64_t pf = lo;
    for (int64_t j0 = lo; j0 < hi;) {
        const int64_t n = chunk_len(j0, hi, block_size);
        const int64_t base = ((int64_t)table[j0 / block_size] * block_size + j0 % block_size)
                             * key_stride + head_off;
        const i32x16 valid = lane < (int32_t)n;
        /* request the rows of this chunk and the next ahead of use: blocks lie anywhere in
         * the cache, so the hardware prefetcher cannot follow a sequence across them */
        for (; pf < hi && pf < j0 + PF_AHEAD * 16; ) {
            const int64_t n1 = chunk_len(pf, hi, block_size);
            const int64_t at = ((int64_t)table[pf / block_size] * block_size + pf % block_size)
                               * key_stride + head_off;
            prefetch_rows(k_cache, at, n1, key_stride, span, bf16);
            prefetch_rows(v_cache, at, n1, key_stride, span, bf16);
            pf += n1;
        }
        f32x16 part[MAX_PASS][16], p[MAX_PASS];
        for (int64_t j = 0; j < 16; j++) {
            if (j < n) {
                f32x16 kv[MAX_CHUNKS];
                load_row(k_cache, base + j * key_stride, kv, nc, bf16);
                for (int64_t g = 0; g < G; g++) {
                    f32x16 x = qr[g * nc] * kv[0];
                    for (int64_t c = 1; c < nc; c++) x += qr[g * nc + c] * kv[c];
                    part[g][j] = x;
                }
            } else {
                for (int64_t g = 0; g < G; g++) part[g][j] = (f32x16){0};
            }
        }
        for (int64_t g = 0; g < G; g++)
            p[g] = softmax_step(part[g], valid, &m[g], &l[g], a + g * nc, nc);
        for (int64_t j = 0; j < n; j++) {
            f32x16 vv[MAX_CHUNKS];
            load_row(v_cache, base + j * key_stride, vv, nc, bf16);
            for (int64_t g = 0; g < G; g++)
                for (int64_t c = 0; c < nc; c++) a[g * nc + c] += p[g][j] * vv[c];
        }
        j0 += n;
    }
    for (int64_t g = 0; g < G; g++) {
        const float sum = hsum(l[g]);
        const float inv = sum == 0.f ? 0.f : 1.f / sum;  /* 0 only for an empty range */
        store_row(out, (o_row0 + g) * head_dim, a + g * nc, inv, nc, bf16);
        if (lse) lse[o_row0 + g] = sum == 0.f ? -INFINITY : m[g][0] + logf(sum);
    }
}

/* How many query rows to walk together for nc chunks per row: their queries and
 * accumulators (2 * rows * nc vectors) must about fit in the 32 vector registers, or the
 * spills cost more than reading the chunk once more from L1 (measured: twice as slow). */
INLINE int64_t pass_rows(int64_t nc) {
    return nc <= 2 ? 4 : nc <= 4 ? 3 : nc <= 8 ? 2 : 1;
}

/* walk_rows with constant nc and G for the common head sizes (32, 64, 128, 256). */
INLINE void walk(
        const void *q, int64_t q0, const void *k_cache, const void *v_cache,
        const int32_t *table, int64_t lo, int64_t hi, int64_t block_size, int64_t key_stride,
        int64_t head_off, float scale, void *out, float *lse, const void *init_out,
        const float *init_lse, init_at at, int64_t o_row0, int64_t nc, int64_t rows,
        const int bf16) {
#define WALK(NC, G) walk_rows(q, q0, k_cache, v_cache, table, lo, hi, block_size,      \
                              key_stride, head_off, scale, out, lse, init_out, init_lse, \
                              at, o_row0, NC, G, bf16)
    switch (nc * 16 + rows) {
    case 2 * 16 + 1: WALK(2, 1); break;
    case 2 * 16 + 2: WALK(2, 2); break;
    case 2 * 16 + 3: WALK(2, 3); break;
    case 2 * 16 + 4: WALK(2, 4); break;
    case 4 * 16 + 1: WALK(4, 1); break;
    case 4 * 16 + 2: WALK(4, 2); break;
    case 4 * 16 + 3: WALK(4, 3); break;
    case 8 * 16 + 1: WALK(8, 1); break;
    case 8 * 16 + 2: WALK(8, 2); break;
    case 16 * 16 + 1: WALK(16, 1); break;
    default:  /* other head sizes: one row at a time, nc not constant */
        for (int64_t g = 0; g < rows; g++) {
            const init_at row = {at.out + g * at.out_step, at.out_step,
                                 at.lse + g * at.lse_step, at.lse_step};
            walk_rows(q, q0 + g * nc * 16, k_cache, v_cache, table, lo, hi, block_size,
                      key_stride, head_off, scale, out, lse, init_out, init_lse, row,
                      o_row0 + g, nc, 1, bf16);
        }
    }
#undef WALK
}

/* One work item: sequence t, KV heads [h0, h0 + nh), each head's query rows in passes. */
INLINE void decode_item(
        const void *q, int64_t q_token_stride, const void *k_cache, const void *v_cache,
        const int32_t *table, int64_t lo, int64_t hi, int64_t t, int64_t h0, int64_t nh,
        int64_t num_kv_heads, int64_t group, int64_t head_dim, int64_t block_size,
        float scale, void *out, float *lse, const void *init_out, const float *init_lse,
        const int64_t *is, int bf16) {
    const int64_t nc = head_dim / 16, key_stride = num_kv_heads * head_dim;
    const int64_t per_pass = pass_rows(nc);
    for (int64_t h = h0; h < h0 + nh; h++)
        for (int64_t r0 = 0; r0 < group; r0 += per_pass) {
            const int64_t rows = group - r0 < per_pass ? group - r0 : per_pass;
            const init_at at = {t * is[0] + h * is[1] + r0 * is[2], is[2],
                                t * is[3] + h * is[4] + r0 * is[5], is[5]};
            walk(q, t * q_token_stride + (h * group + r0) * head_dim, k_cache, v_cache, table,
                 lo, hi, block_size, key_stride, h * head_dim, scale, out, lse, init_out,
                 init_lse, at, (t * num_kv_heads + h) * group + r0, nc, rows, bf16);
        }
}

INLINE int unsupported(int64_t group, int64_t head_dim, int64_t heads_per_item) {
    return group < 1 || group > MAX_GROUP || head_dim % 16 || head_dim / 16 > MAX_CHUNKS
        || heads_per_item < 1;
}

/* Entry points, one per element type (each with its own parallel loop, so the element type
 * is a constant inside it). q [num_seqs, num_kv_heads * group, head_dim] with rows
 * q_token_stride elements apart; out contiguous in the same shape; lse (optional)
 * [num_seqs, heads]. init_out [num_seqs, num_kv_heads, group, head_dim] and init_lse
 * [num_seqs, num_kv_heads, group] (optional, both or neither; strides by sequence, KV head
 * and group row os0..os2 and ls0..ls2, head_dim contiguous) are a partial result over other
 * keys to merge with: a cascade's shared prefix, as the shared product left it.
 * Returns nonzero, touching nothing, for a shape it does not handle. */
#define ENTRY(NAME, T, BF16)                                                                  \
int NAME(const T *q, int64_t q_token_stride, const T *k_cache, const T *v_cache,               \
         const int32_t *block_tables, int64_t bt_stride, const int32_t *lo, const int32_t *hi, \
         int64_t num_seqs, int64_t num_kv_heads, int64_t group, int64_t head_dim,              \
         int64_t block_size, float scale, T *out, float *lse, const T *init_out,              \
         const float *init_lse, int64_t os0, int64_t os1, int64_t os2, int64_t ls0,            \
         int64_t ls1, int64_t ls2, int64_t heads_per_item) {                                   \
    if (unsupported(group, head_dim, heads_per_item) || !init_out != !init_lse) return 1;     \
    const int64_t init_strides[6] = {os0, os1, os2, ls0, ls1, ls2};                           \
    const int64_t splits = (num_kv_heads + heads_per_item - 1) / heads_per_item;               \
    _Pragma("omp parallel for schedule(dynamic, 1)")                                           \
    for (int64_t item = 0; item < num_seqs * splits; item++) {                                 \
        const int64_t t = item / splits, h0 = (item % splits) * heads_per_item;                \
        const int64_t nh = num_kv_heads - h0 < heads_per_item ? num_kv_heads - h0              \
                                                              : heads_per_item;                \
        decode_item(q, q_token_stride, k_cache, v_cache, block_tables + t * bt_stride, lo[t],  \
                    hi[t], t, h0, nh, num_kv_heads, group, head_dim, block_size, scale, out,   \
                    lse, init_out, init_lse, init_strides, BF16);                              \
    }                                                                                          \
    return 0;                                                                                  \
}
ENTRY(paged_decode_f32, float, 0)
ENTRY(paged_decode_bf16, uint16_t, 1)
