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

/* A 16-lane vector as NSUB fvecs (v[h]: lanes h * NLANES ...), for the helpers below. */
typedef struct { fvec v[NSUB]; } fv16;

/* fvec shuffles within one vector and across two (clang's and GCC's spellings) */
#if defined(__clang__)
#define SHUF1(a, ...) __builtin_shufflevector(a, a, __VA_ARGS__)
#define SHUF2(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF1(a, ...) __builtin_shuffle(a, (ivec){__VA_ARGS__})
#define SHUF2(a, b, ...) __builtin_shuffle(a, b, (ivec){__VA_ARGS__})
#endif

/* the maximum of v's 16 lanes, in every lane (a butterfly: lanes 8 apart, then 4, 2, 1;
 * vmax keeps its second argument when it is NaN, so the lanes can differ only then) */
INLINE fv16 max_all(fv16 x) {
#if NLANES == 16
    fvec v = x.v[0];
    v = fvmax(v, SHUF1(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    v = fvmax(v, SHUF1(v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    v = fvmax(v, SHUF1(v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    x.v[0] = fvmax(v, SHUF1(v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
#elif NLANES == 8
    fvec lo = fvmax(x.v[0], x.v[1]), hi = fvmax(x.v[1], x.v[0]);
    lo = fvmax(lo, SHUF1(lo, 4, 5, 6, 7, 0, 1, 2, 3));
    hi = fvmax(hi, SHUF1(hi, 4, 5, 6, 7, 0, 1, 2, 3));
    lo = fvmax(lo, SHUF1(lo, 2, 3, 0, 1, 6, 7, 4, 5));
    hi = fvmax(hi, SHUF1(hi, 2, 3, 0, 1, 6, 7, 4, 5));
    x.v[0] = fvmax(lo, SHUF1(lo, 1, 0, 3, 2, 5, 4, 7, 6));
    x.v[1] = fvmax(hi, SHUF1(hi, 1, 0, 3, 2, 5, 4, 7, 6));
#else
    float f[16], g[16];
    memcpy(f, x.v, sizeof f);
    for (int step = 8; step >= 1; step /= 2) {
        for (int i = 0; i < 16; i++) g[i] = f[i] > f[i ^ step] ? f[i] : f[i ^ step];
        memcpy(f, g, sizeof f);
    }
    memcpy(x.v, f, sizeof f);
#endif
    return x;
}

/* out: the sums of the 16 lanes of x[0..16), key j's in lane j, added in vec.h's
 * transpose_sum16 order (lanes 8 apart first, then 4, 2, 1). */
INLINE fv16 transpose_sum(const fv16 *x) {
    fv16 out;
#if NLANES == 16
    out.v[0] = transpose_sum16(&x[0].v[0]);
#elif NLANES == 8
    for (int half = 0; half < 2; half++) {
        fvec z[8], a[4], b[2];
        for (int j = 0; j < 8; j++) z[j] = x[8 * half + j].v[0] + x[8 * half + j].v[1];
        for (int i = 0; i < 4; i++)
            a[i] = SHUF2(z[2 * i], z[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11)
                 + SHUF2(z[2 * i], z[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
        for (int i = 0; i < 2; i++)
            b[i] = SHUF2(a[2 * i], a[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13)
                 + SHUF2(a[2 * i], a[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
        out.v[half] = SHUF2(b[0], b[1], 0, 2, 4, 6, 8, 10, 12, 14)
                    + SHUF2(b[0], b[1], 1, 3, 5, 7, 9, 11, 13, 15);
    }
#else
    float o[16];
    for (int j = 0; j < 16; j++) {
        float f[16];
        memcpy(f, x[j].v, sizeof f);
        o[j] = ((f[0] + f[8]) + (f[4] + f[12]) + ((f[2] + f[10]) + (f[6] + f[14])))
             + (((f[1] + f[9]) + (f[5] + f[13])) + ((f[3] + f[11]) + (f[7] + f[15])));
    }
    memcpy(out.v, o, sizeof o);
#endif
    return out;
}

#define MAX_PASS 8     /* query rows walked together (their q and accumulators in registers) */
/* How far ahead of the walk its prefetches run, in K and V bytes (at least one chunk).
 * Measured on a 2-core Zen 4 VM: 16 KiB was as fast as or faster than 32 KiB to 128 KiB, by
 * up to 25% on SmolLM2's heads. */
#define AHEAD_BYTES (16 * 1024)

/* Elements are float32 (bf16 == 0) or bfloat16 (bf16 == 1); the functions below are
 * inlined with a constant flag, so each entry point compiles to its own straight code. */
/* One head row of nc * 16 elements as nc * NSUB vectors of the register width (vec.h's fvec),
 * lane for lane as nc 16-lane vectors would hold it. bfloat16 rows with an even nc are read
 * 32 elements at a time and split into their even and odd elements (a shift and a mask,
 * where widening in order takes a load, a conversion and a shift per 16): 16-lane vector 2b
 * holds elements 32b, 32b + 2, ..., vector 2b + 1 elements 32b + 1, 32b + 3, .... q, k, v and
 * the accumulators all use this order, so dot products and weighted sums are unchanged;
 * store_row puts the elements back in place. */
INLINE void load_row(const void *base, int64_t i, fvec *dst, int64_t nc, int bf16) {
    if (bf16 && nc % 2 == 0) {
        for (int64_t b = 0; b < nc / 2; b++)
            for (int h = 0; h < NSUB; h++) {
                uvec w;
                memcpy(&w, (const uint16_t *)base + i + 32 * b + 2 * NLANES * h, sizeof w);
                const uvec even = w << 16, odd = w & 0xffff0000u;
                memcpy(&dst[2 * b * NSUB + h], &even, sizeof even);
                memcpy(&dst[(2 * b + 1) * NSUB + h], &odd, sizeof odd);
            }
    } else if (bf16) {
        for (int64_t c = 0; c < nc * NSUB; c++) {
            hvec h;
            memcpy(&h, (const uint16_t *)base + i + NLANES * c, sizeof h);
            const uvec w = __builtin_convertvector(h, uvec) << 16;
            memcpy(&dst[c], &w, sizeof w);
        }
    } else {
        for (int64_t c = 0; c < nc * NSUB; c++) dst[c] = load_fv((const float *)base + i + NLANES * c);
    }
}
/* v rounded to bfloat16 (vec.h's bf16_bits) */
INLINE uvec bf16_bits_fv(fvec v) {
    uvec u;
    memcpy(&u, &v, sizeof u);
    const uvec nan = (uvec)((u & 0x7fffffffu) > 0x7f800000u);
    const uvec r = u + 0x7fffu + ((u >> 16) & 1u);
    return (r & ~nan) | ((u | 0x400000u) & nan);
}
INLINE void store_row(void *base, int64_t i, const fvec *src, float scale, int64_t nc,
                      int bf16) {
    if (bf16 && nc % 2 == 0) {
        for (int64_t b = 0; b < nc / 2; b++)
            for (int h = 0; h < NSUB; h++) {
                const uvec even = bf16_bits_fv(src[2 * b * NSUB + h] * scale) >> 16;
                const uvec odd = bf16_bits_fv(src[(2 * b + 1) * NSUB + h] * scale) & 0xffff0000u;
                const uvec w = even | odd;
                memcpy((uint16_t *)base + i + 32 * b + 2 * NLANES * h, &w, sizeof w);
            }
    } else if (bf16) {
        for (int64_t c = 0; c < nc * NSUB; c++) {
            const hvec h = __builtin_convertvector(bf16_bits_fv(src[c] * scale) >> 16, hvec);
            memcpy((uint16_t *)base + i + NLANES * c, &h, sizeof h);
        }
    } else {
        for (int64_t c = 0; c < nc * NSUB; c++)
            store_fv((float *)base + i + NLANES * c, src[c] * scale);
    }
}

/* vec.h's fp8_to_f32 on fvecs */
INLINE fvec fp8_to_fv(uvec b) {
    const uvec mag = b & 0x7fu;
    const uvec normal = (mag << 20) + (120u << 23);
    const fvec subf = __builtin_convertvector((ivec)mag, fvec) * (1.0f / 512);
    uvec sub;
    memcpy(&sub, &subf, sizeof sub);
    const uvec is_normal = (uvec)(mag >= 8u), nan = (uvec)(mag == 0x7fu);
    const uvec bits = ((normal & is_normal) | (sub & ~is_normal) | (0x7fc00000u & nan))
                      | (b & 0x80u) << 24;
    fvec v;
    memcpy(&v, &bits, sizeof v);
    return v;
}
/* One head row of an FP8 cache (E4M3 codes) as load_row would give it in float32 for queries
 * of the element type bf16: in the even/odd order of bfloat16 rows with an even nc. */
INLINE void load_fp8_row(const uint8_t *base, int64_t i, fvec *dst, int64_t nc, int bf16) {
    if (bf16 && nc % 2 == 0) {
        for (int64_t b = 0; b < nc / 2; b++)
            for (int h = 0; h < NSUB; h++) {
                hvec w;
                memcpy(&w, base + i + 32 * b + 2 * NLANES * h, sizeof w);
                dst[2 * b * NSUB + h] = fp8_to_fv(__builtin_convertvector(w & 0xff, uvec));
                dst[(2 * b + 1) * NSUB + h] = fp8_to_fv(__builtin_convertvector(w >> 8, uvec));
            }
    } else {
        typedef uint8_t bvec __attribute__((vector_size(NLANES)));
        for (int64_t c = 0; c < nc * NSUB; c++) {
            bvec w;
            memcpy(&w, base + i + NLANES * c, sizeof w);
            dst[c] = fp8_to_fv(__builtin_convertvector(w, uvec));
        }
    }
}
/* A K or V row: of the element type, or E4M3 codes (fp8) */
INLINE void load_kv_row(const void *base, int64_t i, fvec *dst, int64_t nc, int bf16,
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
 * max m and per-lane sum l, rescales the accumulators acc[0..w), and returns the keys'
 * weights (in w16). */
INLINE void softmax_step(const fv16 *part, const ivec *valid, fv16 *m, fv16 *l, fvec *acc,
                         int64_t w, float *w16) {
    fv16 s = transpose_sum(part);
    for (int h = 0; h < NSUB; h++)
        s.v[h] = (fvec)(((ivec)s.v[h] & valid[h])
                        | ((ivec)((fvec){0} - INFINITY) & ~valid[h]));
    const fv16 top = max_all(s);
    fvec corr[NSUB];
    for (int h = 0; h < NSUB; h++) {
        const fvec m_new = fvmax(m->v[h], top.v[h]);
        corr[h] = vexp_fv(m->v[h] - m_new);
        const fvec e = (fvec)((ivec)vexp_fv(s.v[h] - m_new) & valid[h]);
        m->v[h] = m_new;
        s.v[h] = e;
    }
    if (corr[0][0] != 1.f) {
        for (int h = 0; h < NSUB; h++) l->v[h] *= corr[h];
        for (int64_t c = 0; c < w; c++) acc[c] *= corr[c % NSUB];
    }
    for (int h = 0; h < NSUB; h++) l->v[h] += s.v[h];
    memcpy(w16, s.v, 16 * sizeof(float));
}

/* One pass (G query rows of one KV head) over one chunk of n keys: the keys' rows start at
 * element `base` of the caches, key_stride apart. The pass's state lives in memory between
 * chunks (q: its queries, scaled, in load_row's order; a: accumulators; m, l: running max
 * and per-lane sum) and in registers within one; inlined with constant nc and G. Between
 * its keys it issues `lines` of the prefetches ahead. */
INLINE void pass_chunk(
        const fvec *q_mem, fvec *a_mem, fv16 *m_mem, fv16 *l_mem,
        const void *k_cache, const void *v_cache, int64_t base, int64_t key_stride, int64_t n,
        const ivec *valid, ahead_rows *ahead, int64_t lines, const int64_t nc, const int64_t G,
        const int bf16, const int fp8) {
    const int64_t W = nc * NSUB;  /* vectors a row */
    fvec qr[MAX_PASS * MAX_CHUNKS * NSUB], a[MAX_PASS * MAX_CHUNKS * NSUB];
    fv16 m[MAX_PASS], l[MAX_PASS];
    for (int64_t i = 0; i < G * W; i++) { qr[i] = q_mem[i]; a[i] = a_mem[i]; }
    for (int64_t g = 0; g < G; g++) { m[g] = m_mem[g]; l[g] = l_mem[g]; }
    fv16 part[MAX_PASS][16];
    float p[MAX_PASS][16];
    int64_t spread = 0;
    for (int64_t j = 0; j < 16; j++) {
        if (j < n) {
            for (spread += lines; spread >= n; spread -= n) prefetch_lines(ahead, 1);
            fvec kv[MAX_CHUNKS * NSUB];
            load_kv_row(k_cache, base + j * key_stride, kv, nc, bf16, fp8);
            for (int64_t g = 0; g < G; g++) {
                fvec x[NSUB];
                for (int h = 0; h < NSUB; h++) x[h] = qr[g * W + h] * kv[h];
                for (int64_t c = 1; c < nc; c++)
                    for (int h = 0; h < NSUB; h++) x[h] += qr[g * W + c * NSUB + h] * kv[c * NSUB + h];
                memcpy(part[g][j].v, x, sizeof x);
            }
        } else {
            for (int64_t g = 0; g < G; g++)
                for (int h = 0; h < NSUB; h++) part[g][j].v[h] = (fvec){0};
        }
    }
    for (int64_t g = 0; g < G; g++)
        softmax_step(part[g], valid, &m[g], &l[g], a + g * W, W, p[g]);
    for (int64_t j = 0; j < n; j++) {
        fvec vv[MAX_CHUNKS * NSUB];
        load_kv_row(v_cache, base + j * key_stride, vv, nc, bf16, fp8);
        for (int64_t g = 0; g < G; g++)
            for (int64_t c = 0; c < W; c++) a[g * W + c] += p[g][j] * vv[c];
    }
    for (int64_t i = 0; i < G * W; i++) a_mem[i] = a[i];
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
    ivec lane;
    for (int i = 0; i < NLANES; i++) lane[i] = i;
    const int64_t head_dim = nc * 16, group = d->group, per_head = group / G;
    const int64_t key_stride = d->num_kv_heads * head_dim, block_size = d->block_size;
    const int64_t passes = nh * per_head;
    const int64_t *is = d->is;
    const int64_t W = nc * NSUB;  /* vectors a row */
    fvec qs[passes * G * W], as[passes * G * W];
    fv16 ms[passes * G], ls[passes * G];
    for (int64_t p = 0; p < passes; p++) {
        const int64_t h = h0 + p / per_head, r0 = p % per_head * G;
        for (int64_t g = 0; g < G; g++) {
            const int64_t r = r0 + g, s = p * G + g;
            /* a partial result enters as its (normalised) output with weight 1 at its
             * log-sum-exp; one over no keys (-inf) as nothing */
            const float init = d->init_lse ? d->init_lse[t * is[3] + h * is[4] + r * is[5]]
                                           : -INFINITY;
            load_row(d->q, t * d->q_token_stride + (h * group + r) * head_dim, qs + s * W,
                     nc, bf16);
            for (int64_t c = 0; c < W; c++) qs[s * W + c] *= d->scale;
            if (init != -INFINITY) {
                /* in the units the walk sums V in (see v_scale) */
                load_row(d->init_out, t * is[0] + h * is[1] + r * is[2], as + s * W, nc,
                         bf16);
                for (int64_t c = 0; c < W; c++) as[s * W + c] *= 1.f / d->v_scale;
            } else
                for (int64_t c = 0; c < W; c++) as[s * W + c] = (fvec){0};
            for (int h = 0; h < NSUB; h++) {
                ms[s].v[h] = (fvec){0} + init;
                ls[s].v[h] = (fvec){0};
            }
            ls[s].v[0][0] = init != -INFINITY ? 1.f : 0.f;  /* its weight, in lane 0 */
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
        ivec valid[NSUB];
        for (int h = 0; h < NSUB; h++) valid[h] = lane < (int32_t)(n - NLANES * h);
        /* as many lines prefetched as the chunk reads, spread over its passes */
        const int64_t chunk_lines = n * row_lines;
        for (int64_t p = 0; p < passes; p++)
            pass_chunk(qs + p * G * W, as + p * G * W, ms + p * G, ls + p * G, d->k_cache,
                       d->v_cache, base + (h0 + p / per_head) * head_dim, key_stride, n, valid,
                       &ahead, chunk_lines * (p + 1) / passes - chunk_lines * p / passes, nc,
                       G, bf16, fp8);
        j0 += n;
    }
    for (int64_t p = 0; p < passes; p++) {
        const int64_t h = h0 + p / per_head, r0 = p % per_head * G;
        for (int64_t g = 0; g < G; g++) {
            const int64_t s = p * G + g, row = (t * d->num_kv_heads + h) * group + r0 + g;
            float lanes[16], sum = 0.f;  /* in lane order, as vec.h's hsum */
            memcpy(lanes, ls[s].v, sizeof lanes);
            for (int i = 0; i < 16; i++) sum += lanes[i];
            const float inv = sum == 0.f ? 0.f : 1.f / sum;  /* 0 only for an empty range */
            store_row(d->out, row * head_dim, as + s * W, inv * d->v_scale, nc, bf16);
            if (d->lse) d->lse[row] = sum == 0.f ? -INFINITY : ms[s].v[0][0] + logf(sum);
        }
    }
}

/* How many query rows a pass takes for nc chunks per row: their queries and accumulators
 * (2 * rows * nc 16-lane vectors) must about fit in the vector registers, or the spills
 * cost more than reading the chunk once more from L1 (measured with AVX-512's 32: twice as
 * slow). With 16 AVX2 registers (or NEON's 32 of 4 lanes) a 16-lane vector takes two (four),
 * and passes of more than one row pay only for head_dim 32. The count divides group, so
 * every pass of a head has the same rows. */
#if NLANES == 16
#define WIDE_PASSES 1
#else
#define WIDE_PASSES 0
#endif
INLINE int64_t pass_rows(int64_t nc, int64_t group) {
    int64_t rows = WIDE_PASSES ? (nc <= 2 ? 4 : nc <= 4 ? 3 : nc <= 8 ? 2 : 1) : nc <= 2 ? 2 : 1;
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
    case 4 * 16 + 1: WALK(4, 1); break;
    case 8 * 16 + 1: WALK(8, 1); break;
    case 16 * 16 + 1: WALK(16, 1); break;
#if WIDE_PASSES  /* pass_rows gives these only there */
    case 2 * 16 + 3: WALK(2, 3); break;
    case 2 * 16 + 4: WALK(2, 4); break;
    case 4 * 16 + 2: WALK(4, 2); break;
    case 4 * 16 + 3: WALK(4, 3); break;
    case 8 * 16 + 2: WALK(8, 2); break;
#endif
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
