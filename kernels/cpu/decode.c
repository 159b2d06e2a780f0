/* Paged decode attention for CPUs: one query token per sequence, keys and values read in
 * place from the paged cache, with no gather and no padding. kernels/cpu/build.py compiles
 * it on first use; kernels/cpu/decode.py checks the arguments and calls it through ctypes.
 *
 * Cache layout: [num_blocks, block_size, num_kv_heads, head_dim]. Sequence t's key at
 * position p is row p % block_size of block block_tables[t, p / block_size]; the sequence
 * attends to positions [lo[t], hi[t]). Query head h * group + g reads KV head h (GQA).
 *
 * A work item is one sequence and a run of its KV heads. Their query rows are split into
 * passes of a few rows of one KV head; the walk over the keys is compiled for each common
 * head size and row count, so every loop bound is a constant. Keys are taken 16 at a time
 * (a chunk, never across a block), and each chunk serves every pass before the next one
 * is read, a pass's queries, accumulators and softmax state in registers while it runs.
 * Each key row is loaded (and, for bfloat16, widened) once per pass. Each key's dot products
 * are summed along head_dim as 16-lane partials, and the 16 partial vectors are reduced
 * together by a transpose-add tree into one vector of 16 scores. Softmax is online (running
 * max and sum per query row) with a vectorised exp. Accumulation and the log-sum-exp are
 * float32 for float32 and bfloat16 caches alike; bfloat16 rows are widened 32 elements at a
 * time, split into even and odd elements (see load_row). A sequence's blocks lie anywhere
 * in the cache, where the hardware prefetcher cannot follow them. Software prefetches bring
 * them in instead: while a walk computes, a few cache lines at a time between its keys, a
 * fixed distance ahead of it (the rest of its keys, then the next walk's: each thread takes
 * its next work item one item early so that it knows which). Measured on a 2-core Zen 4 VM
 * against prefetching a chunk's rows in one burst after it and reading each group of rows
 * with plain loads before walking it: a third faster on SmolLM2's decode steps and on
 * contexts of 1-4k keys, as fast where the step is bound by memory bandwidth.
 *
 * An FP8 cache holds E4M3 codes (kernels/fp8.py): rows are widened to float32 exactly as they
 * are read, k_scale is folded into the queries' scale by the caller, and v_scale multiplies
 * the result (a partial result to start from is divided by it first), so the walk itself is
 * the same.
 *
 * Written with GCC/Clang vector extensions rather than intrinsics, so the compiler maps
 * them to whatever the host has (AVX-512, AVX2, NEON). The OpenMP loop runs on the OpenMP
 * runtime torch itself loaded, so its threads are torch's threads.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"

/* Every helper is inlined, so each specialised walk is straight code with constant bounds
 * (left to its own heuristics, GCC stopped inlining helpers once the walks grew). */
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

#define MAX_PASS 8     /* query rows walked together (their q and accumulators in registers) */
/* How far ahead of the walk its prefetches run, in K and V bytes (at least one chunk).
 * Measured on a 2-core Zen 4 VM: 16 KiB was as fast as or faster than 32 KiB to 128 KiB, by
 * up to 25% on SmolLM2's heads. */
#define AHEAD_BYTES (16 * 1024)

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

/* One head row of an FP8 cache (E4M3 codes) as load_row would give it in float32 for queries
 * of the element type bf16: in the even/odd order of bfloat16 rows with an even nc. */
INLINE void load_fp8_row(const uint8_t *base, int64_t i, f32x16 *dst, int64_t nc, int bf16) {
    if (bf16 && nc % 2 == 0) {
        for (int64_t b = 0; b < nc / 2; b++) {
            u16x16 w;
            memcpy(&w, base + i + 32 * b, sizeof w);
            dst[2 * b] = fp8_to_f32(__builtin_convertvector(w & 0xff, u32x16));
            dst[2 * b + 1] = fp8_to_f32(__builtin_convertvector(w >> 8, u32x16));
        }
    } else {
        for (int64_t c = 0; c < nc; c++) dst[c] = load_fp8(base + i + 16 * c);
    }
}
/* A K or V row: of the element type, or E4M3 codes (fp8) */
INLINE void load_kv_row(const void *base, int64_t i, f32x16 *dst, int64_t nc, int bf16,
                        int fp8) {
    if (fp8) load_fp8_row((const uint8_t *)base, i, dst, nc, bf16);
    else load_row(base, i, dst, nc, bf16);
}
/* bytes of one cache element */
INLINE int64_t kv_elt(int bf16, int fp8) { return fp8 ? 1 : bf16 ? 2 : 4; }

/* Where the walk after this one reads: keys [j, end) of a sequence (its block table), the
 * part of each row its heads take (element off, bytes long). Prefetched a few lines at a
 * time while this walk computes, so that its first rows are in cache when it starts. */
typedef struct {
    const int32_t *table;
    int64_t j, end, off, bytes;
} ahead_seg;

/* The rows still to prefetch: what is left of this walk past the distance ahead, then the
 * next walk's; taken a cache line at a time (line: the next one's byte offset in row j
 * of seg[cur], whose K and V start at k_row and v_row). */
typedef struct {
    ahead_seg seg[2];
    int cur;
    int64_t line;
    const char *k_row, *v_row;
    const char *k_cache, *v_cache;
    int64_t key_stride, block_size, elt;
} ahead_rows;

/* Software prefetches into L2 (prefetcht1) of the next `lines` cache lines of K and V of
 * what lies ahead. */
INLINE void prefetch_lines(ahead_rows *a, int64_t lines) {
    while (lines > 0 && a->cur < 2) {
        ahead_seg *s = &a->seg[a->cur];
        if (s->j >= s->end) { a->cur++; continue; }
        if (a->line == 0) {
            const int64_t at = (((int64_t)s->table[s->j / a->block_size] * a->block_size
                                 + s->j % a->block_size) * a->key_stride + s->off) * a->elt;
            a->k_row = a->k_cache + at;
            a->v_row = a->v_cache + at;
        }
        __builtin_prefetch(a->k_row + a->line, 0, 2);
        __builtin_prefetch(a->v_row + a->line, 0, 2);
        lines--;
        a->line += 64;
        if (a->line >= s->bytes) { a->line = 0; s->j++; }
    }
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

/* One pass (G query rows of one KV head) over one chunk of n keys: the keys' rows start at
 * element `base` of the caches, key_stride apart. The pass's state lives in memory between
 * chunks (q: its queries, scaled, in load_row's order; a: accumulators; m, l: running max
 * and per-lane sum) and in registers within one; inlined with constant nc and G. Between
 * its keys it issues `lines` of the prefetches ahead. */
INLINE void pass_chunk(
        const f32x16 *q_mem, f32x16 *a_mem, f32x16 *m_mem, f32x16 *l_mem,
        const void *k_cache, const void *v_cache, int64_t base, int64_t key_stride, int64_t n,
        i32x16 valid, ahead_rows *ahead, int64_t lines, const int64_t nc, const int64_t G,
        const int bf16, const int fp8) {
    f32x16 qr[MAX_PASS * MAX_CHUNKS], a[MAX_PASS * MAX_CHUNKS], m[MAX_PASS], l[MAX_PASS];
    for (int64_t i = 0; i < G * nc; i++) { qr[i] = q_mem[i]; a[i] = a_mem[i]; }
    for (int64_t g = 0; g < G; g++) { m[g] = m_mem[g]; l[g] = l_mem[g]; }
    f32x16 part[MAX_PASS][16], p[MAX_PASS];
    int64_t spread = 0;
    for (int64_t j = 0; j < 16; j++) {
        if (j < n) {
            for (spread += lines; spread >= n; spread -= n) prefetch_lines(ahead, 1);
            f32x16 kv[MAX_CHUNKS];
            load_kv_row(k_cache, base + j * key_stride, kv, nc, bf16, fp8);
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
        load_kv_row(v_cache, base + j * key_stride, vv, nc, bf16, fp8);
        for (int64_t g = 0; g < G; g++)
            for (int64_t c = 0; c < nc; c++) a[g * nc + c] += p[g][j] * vv[c];
    }
    for (int64_t i = 0; i < G * nc; i++) a_mem[i] = a[i];
    for (int64_t g = 0; g < G; g++) { m_mem[g] = m[g]; l_mem[g] = l[g]; }
}

/* Everything a work item needs to know about where its rows are. Strides of the partial
 * result to start from (init_out, init_lse) by sequence, KV head and group row: is[0..2]
 * for init_out (elements), is[3..5] for init_lse. */
typedef struct {
    const void *q, *k_cache, *v_cache, *init_out;
    void *out;
    float *lse;
    const float *init_lse;
    const int64_t *is;
    int64_t q_token_stride, num_kv_heads, group, block_size;
    float scale, v_scale;  /* v_scale: an FP8 cache's (1 otherwise) */
} decode_args;

/* KV heads [h0, h0 + nh) of sequence t over keys [lo, hi): every query row of those heads,
 * G rows to a pass. The keys are walked once, a chunk at a time, each chunk serving every
 * pass before the next (walking head by head read one head's slice of each row, a pattern
 * the hardware prefetcher does not follow, and left memory idle while later heads ran).
 * Inlined with constant nc (head_dim / 16) and G wherever a case exists (see walk()). */
INLINE void walk_heads(
        const decode_args *d, const int32_t *table, int64_t lo, int64_t hi, int64_t t,
        int64_t h0, int64_t nh, const ahead_seg *next, const int64_t nc, const int64_t G,
        const int bf16, const int fp8) {
    const i32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const int64_t head_dim = nc * 16, group = d->group, per_head = group / G;
    const int64_t key_stride = d->num_kv_heads * head_dim, block_size = d->block_size;
    const int64_t passes = nh * per_head;
    const int64_t *is = d->is;
    f32x16 qs[passes * G * nc], as[passes * G * nc], ms[passes * G], ls[passes * G];
    for (int64_t p = 0; p < passes; p++) {
        const int64_t h = h0 + p / per_head, r0 = p % per_head * G;
        for (int64_t g = 0; g < G; g++) {
            const int64_t r = r0 + g, s = p * G + g;
            /* a partial result enters as its (normalised) output with weight 1 at its
             * log-sum-exp; one over no keys (-inf) as nothing */
            const float init = d->init_lse ? d->init_lse[t * is[3] + h * is[4] + r * is[5]]
                                           : -INFINITY;
            load_row(d->q, t * d->q_token_stride + (h * group + r) * head_dim, qs + s * nc,
                     nc, bf16);
            for (int64_t c = 0; c < nc; c++) qs[s * nc + c] *= d->scale;
            if (init != -INFINITY) {
                /* in the units the walk sums V in (see v_scale) */
                load_row(d->init_out, t * is[0] + h * is[1] + r * is[2], as + s * nc, nc,
                         bf16);
                for (int64_t c = 0; c < nc; c++) as[s * nc + c] *= 1.f / d->v_scale;
            } else
                for (int64_t c = 0; c < nc; c++) as[s * nc + c] = (f32x16){0};
            ms[s] = (f32x16){0} + init;
            ls[s] = init != -INFINITY ? (f32x16){1.f} : (f32x16){0};
        }
    }
    /* while a chunk is walked, prefetches run AHEAD_BYTES of K and V rows (this walk's heads'
     * part of each row) ahead of it: through the rest of this walk, then into the next */
    const int64_t span_off = h0 * head_dim, span = nh * head_dim * kv_elt(bf16, fp8);
    int64_t ahead_keys = AHEAD_BYTES / (2 * span) / 16 * 16;
    if (ahead_keys < 16) ahead_keys = 16;
    ahead_rows ahead = {{{table, lo + ahead_keys, hi, span_off, span},
                         next ? *next : (ahead_seg){table, 0, 0, 0, 0}}, 0, 0, NULL, NULL,
                        d->k_cache, d->v_cache, key_stride, block_size, kv_elt(bf16, fp8)};
    const int64_t row_lines = (span + 63) / 64;
    for (int64_t j0 = lo; j0 < hi;) {
        const int64_t n = chunk_len(j0, hi, block_size);
        const int64_t base = ((int64_t)table[j0 / block_size] * block_size + j0 % block_size)
                             * key_stride;
        const i32x16 valid = lane < (int32_t)n;
        /* as many lines prefetched as the chunk reads, spread over its passes */
        const int64_t chunk_lines = n * row_lines;
        for (int64_t p = 0; p < passes; p++)
            pass_chunk(qs + p * G * nc, as + p * G * nc, ms + p * G, ls + p * G, d->k_cache,
                       d->v_cache, base + (h0 + p / per_head) * head_dim, key_stride, n, valid,
                       &ahead, chunk_lines * (p + 1) / passes - chunk_lines * p / passes, nc,
                       G, bf16, fp8);
        j0 += n;
    }
    for (int64_t p = 0; p < passes; p++) {
        const int64_t h = h0 + p / per_head, r0 = p % per_head * G;
        for (int64_t g = 0; g < G; g++) {
            const int64_t s = p * G + g, row = (t * d->num_kv_heads + h) * group + r0 + g;
            const float sum = hsum(ls[s]);
            const float inv = sum == 0.f ? 0.f : 1.f / sum;  /* 0 only for an empty range */
            store_row(d->out, row * head_dim, as + s * nc, inv * d->v_scale, nc, bf16);
            if (d->lse) d->lse[row] = sum == 0.f ? -INFINITY : ms[s][0] + logf(sum);
        }
    }
}

/* How many query rows a pass takes for nc chunks per row: their queries and accumulators
 * (2 * rows * nc vectors) must about fit in the 32 vector registers, or the spills cost
 * more than reading the chunk once more from L1 (measured: twice as slow). The count
 * divides group, so every pass of a head has the same rows. */
INLINE int64_t pass_rows(int64_t nc, int64_t group) {
    int64_t rows = nc <= 2 ? 4 : nc <= 4 ? 3 : nc <= 8 ? 2 : 1;
    while (group % rows) rows--;
    return rows;
}

/* Heads per walk: the passes' state (2 * group * nc vectors a head) stays within 32 KiB. */
#define STATE_VECTORS 256

/* walk_heads with constant nc and G for the common head sizes (32, 64, 128, 256). */
INLINE void walk(const decode_args *d, const int32_t *table, int64_t lo, int64_t hi,
                 int64_t t, int64_t h0, int64_t nh, const ahead_seg *next, int64_t nc,
                 const int bf16, const int fp8) {
    const int64_t G = pass_rows(nc, d->group);
#define WALK(NC, G) walk_heads(d, table, lo, hi, t, h0, nh, next, NC, G, bf16, fp8)
    switch (nc * 16 + G) {
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
    default: WALK(nc, 1);  /* other head sizes: one row a pass, nc not constant */
    }
#undef WALK
}

/* KV heads per walk: as many as the state budget allows. */
INLINE int64_t heads_per_walk(const decode_args *d, int64_t head_dim) {
    const int64_t per_walk = STATE_VECTORS / (2 * d->group * (head_dim / 16));
    return per_walk < 1 ? 1 : per_walk;
}

/* Work item `item` of a call: sequence t, KV heads [h0, h0 + nh). */
typedef struct {
    const int32_t *table;
    int64_t t, lo, hi, h0, nh;
} decode_item_t;

INLINE decode_item_t item_at(const decode_args *d, int64_t item, int64_t splits,
                             int64_t heads_per_item, const int32_t *block_tables,
                             int64_t bt_stride, const int32_t *lo, const int32_t *hi) {
    const int64_t t = item / splits, h0 = (item % splits) * heads_per_item;
    const int64_t nh = d->num_kv_heads - h0 < heads_per_item ? d->num_kv_heads - h0
                                                             : heads_per_item;
    return (decode_item_t){block_tables + t * bt_stride, t, lo[t], hi[t], h0, nh};
}

/* The rows of an item's walk that starts at KV head h, for the walk before it to
 * prefetch. */
INLINE ahead_seg walk_rows(const decode_item_t *it, int64_t h, int64_t per_walk,
                           int64_t head_dim, int64_t elt) {
    const int64_t left = it->h0 + it->nh - h, nh = left < per_walk ? left : per_walk;
    return (ahead_seg){it->table, it->lo, it->hi, h * head_dim, nh * head_dim * elt};
}

/* One work item in walks of heads_per_walk heads; next (or NULL) is the first walk of the
 * item this thread takes after it. */
INLINE void decode_item(const decode_args *d, const decode_item_t *it, const ahead_seg *next,
                        int64_t head_dim, int bf16, int fp8) {
    const int64_t nc = head_dim / 16, per_walk = heads_per_walk(d, head_dim);
    const int64_t end = it->h0 + it->nh;
    for (int64_t h = it->h0; h < end; h += per_walk) {
        const int64_t nh = end - h < per_walk ? end - h : per_walk;
        /* after this walk: the same sequence's next heads, or the next item */
        const ahead_seg following = walk_rows(it, h + nh, per_walk, head_dim, kv_elt(bf16, fp8));
        walk(d, it->table, it->lo, it->hi, it->t, h, nh, h + nh < end ? &following : next,
             nc, bf16, fp8);
    }
}

INLINE int unsupported(int64_t group, int64_t head_dim, int64_t heads_per_item) {
    return group < 1 || group > MAX_GROUP || head_dim % 16 || head_dim / 16 > MAX_CHUNKS
        || heads_per_item < 1;
}

/* Entry points, one per element type and cache type (each with its own parallel loop, so
 * both are constants inside it): the cache holds the element type T, or E4M3 codes (FP8,
 * with v_scale; k_scale is the caller's to fold into scale). q [num_seqs, num_kv_heads *
 * group, head_dim] with rows
 * q_token_stride elements apart; out contiguous in the same shape; lse (optional)
 * [num_seqs, heads]. init_out [num_seqs, num_kv_heads, group, head_dim] and init_lse
 * [num_seqs, num_kv_heads, group] (optional, both or neither; strides by sequence, KV head
 * and group row os0..os2 and ls0..ls2, head_dim contiguous) are a partial result over other
 * keys to merge with: a cascade's shared prefix, as the shared product left it.
 * Returns nonzero, touching nothing, for a shape it does not handle. */
#define ENTRY(NAME, T, CT, BF16, FP8)                                                         \
int NAME(const T *q, int64_t q_token_stride, const CT *k_cache, const CT *v_cache,             \
         const int32_t *block_tables, int64_t bt_stride, const int32_t *lo, const int32_t *hi, \
         int64_t num_seqs, int64_t num_kv_heads, int64_t group, int64_t head_dim,              \
         int64_t block_size, float scale, T *out, float *lse, const T *init_out,              \
         const float *init_lse, int64_t os0, int64_t os1, int64_t os2, int64_t ls0,            \
         int64_t ls1, int64_t ls2, int64_t heads_per_item, float v_scale) {                    \
    if (unsupported(group, head_dim, heads_per_item) || !init_out != !init_lse) return 1;     \
    const int64_t init_strides[6] = {os0, os1, os2, ls0, ls1, ls2};                           \
    const decode_args d = {q, k_cache, v_cache, init_out, out, lse, init_lse, init_strides,    \
                           q_token_stride, num_kv_heads, group, block_size, scale,             \
                           FP8 ? v_scale : 1.f};                                               \
    const int64_t splits = (num_kv_heads + heads_per_item - 1) / heads_per_item;               \
    const int64_t items = num_seqs * splits;                                                   \
    int64_t taken = 0;  /* items handed out: each thread takes its next one a step early */    \
    _Pragma("omp parallel")                                                                    \
    {                                                                                          \
        int64_t item = __atomic_fetch_add(&taken, 1, __ATOMIC_RELAXED);                        \
        while (item < items) {                                                                 \
            const int64_t after = __atomic_fetch_add(&taken, 1, __ATOMIC_RELAXED);             \
            const decode_item_t it = item_at(&d, item, splits, heads_per_item, block_tables,   \
                                             bt_stride, lo, hi);                               \
            ahead_seg next;                                                                    \
            if (after < items) {                                                               \
                const decode_item_t it2 = item_at(&d, after, splits, heads_per_item,           \
                                                  block_tables, bt_stride, lo, hi);            \
                next = walk_rows(&it2, it2.h0, heads_per_walk(&d, head_dim), head_dim,         \
                                 kv_elt(BF16, FP8));                                           \
            }                                                                                  \
            decode_item(&d, &it, after < items ? &next : NULL, head_dim, BF16, FP8);           \
            item = after;                                                                      \
        }                                                                                      \
    }                                                                                          \
    return 0;                                                                                  \
}
ENTRY(paged_decode_f32, float, float, 0, 0)
ENTRY(paged_decode_bf16, uint16_t, uint16_t, 1, 0)
ENTRY(paged_decode_f32_fp8, float, uint8_t, 0, 1)
ENTRY(paged_decode_bf16_fp8, uint16_t, uint8_t, 1, 1)
