/* Attention of many query rows over one set of keys, for CPUs: the shared part of a
 * cascade, where every sequence of a step that shares a cached prefix sees all of its keys
 * (no mask). kernels/cpu/build.py compiles it on first use; kernels/cpu/shared_prefix.py
 * checks the arguments and calls it through ctypes.
 *
 * The keys are few (a system prompt) and the query rows many (every token of the step
 * times its group): two small matrix products with a softmax between them, built from
 * dot_attn.h's micro-kernel. Each KV head's keys are laid out once per call (see
 * prepare); blocks of DOT_ROWS query rows then take them DOT_KEY_BLOCK keys at a time,
 * the softmax online across blocks.
 *
 * float32 needs nothing beyond the vector extensions of vec.h. bfloat16 runs on the
 * AVX512-BF16 dot products where the build has them, elsewhere on FMAs (dot_attn.h).
 *
 * K and V gathered from an FP8 cache come as E4M3 codes, which prepare widens exactly to
 * the query's type (every E4M3 value is a bfloat16 value); the K scale is the caller's to
 * fold into the scores' scale, the V scale multiplies each row's result.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "dot_attn.h"

#define ITEM_ROWS 48    /* query rows per work item */

/* 32-bit words of the scratch a call needs: K and V of every KV head, keys padded to 64
 * (bfloat16 packs two elements a word). */
int64_t shared_prefix_scratch_words(int64_t num_keys, int64_t num_kv_heads, int64_t head_dim,
                                    int64_t bf16) {
    return (bf16 ? 1 : 2) * num_kv_heads * head_dim * ((num_keys + 63) / 64 * 64);
}

/* whether bfloat16 runs on the AVX512-BF16 instructions (else on FMAs) */
int shared_prefix_bf16_available(void) { return HAVE_BF16_DOT; }

typedef struct {
    const void *q;
    int64_t q_token_stride;
    const uint32_t *keys;  /* per KV head: K's layout, then V's (see prepare) */
    int64_t num_tokens, num_kv_heads, group, head_dim, num_keys, keys_pad;
    float scale, v_scale;
    void *out;
    float *lse;
} shared_args;

/* Query rows [r0, r0 + rows) (rows <= DOT_ROWS) of KV head h; row i is token i / group, query
 * head h * group + i % group. */
INLINE void row_block(const shared_args *d, int64_t h, int64_t r0, int64_t rows,
                      const int bf16) {
    const int64_t D = d->head_dim, group = d->group;
    const int64_t k_words = (bf16 ? D / 2 : D) * d->keys_pad;
    const uint32_t *kp = d->keys + h * (bf16 ? 1 : 2) * D * d->keys_pad, *vp = kp + k_words;
    dot_rows st;
    for (int r = 0; r < DOT_ROWS; r++) {
        const int64_t i = r0 + r, t = i / group, head = h * group + i % group;
        dot_load_query(&st, r, r < rows ? (const char *)d->q
                                          + (t * d->q_token_stride + head * D) * (bf16 ? 2 : 4)
                                        : NULL, D, bf16);
        dot_start_row(&st, r, -INFINITY, NULL, D, bf16, d->v_scale);
    }
    for (int64_t p0 = 0; p0 < d->num_keys; p0 += DOT_KEY_BLOCK) {
        const int64_t n = d->num_keys - p0 < DOT_KEY_BLOCK ? d->num_keys - p0 : DOT_KEY_BLOCK;
        int64_t valid[DOT_ROWS];
        for (int r = 0; r < DOT_ROWS; r++) valid[r] = n;
        /* an odd n's pair ends in a V row of zeros (see prepare) */
        dot_block(&st, kp + p0, vp + (bf16 ? p0 / 2 : p0) * D, d->keys_pad, D,
                  d->scale * (float)M_LOG2E, n, valid, bf16);
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t i = r0 + r, t = i / group, g = i % group;
        const int64_t row = (t * d->num_kv_heads + h) * group + g;
        d->lse[row] = dot_finish_row(&st, r, (char *)d->out + row * D * (bf16 ? 2 : 4), D, bf16,
                                     d->v_scale);
    }
}

/* Element i of a K or V array: bfloat16 bits (bf16) or a float32 value, from an array of
 * that type or of E4M3 codes (fp8). */
INLINE uint32_t kv_bf16(const void *x, int64_t i, const int fp8) {
    return fp8 ? fp8_bf16(((const uint8_t *)x)[i]) : ((const uint16_t *)x)[i];
}
INLINE float kv_f32(const void *x, int64_t i, const int fp8) {
    return fp8 ? fp8_value(((const uint8_t *)x)[i]) : ((const float *)x)[i];
}

/* K and V [num_keys, num_kv_heads, head_dim] (of the query's type, or E4M3 codes: fp8)
 * into the scratch, per KV head, keys padded to keys_pad with zeros: float32 K^T
 * [D][keys_pad] and V [keys_pad][D]; bfloat16 K's pairs of dimensions key-major
 * ([D/2][keys_pad] words) and V's pairs of keys ([keys_pad/2][D] words, the first key in the
 * low half). */
INLINE void prepare(const void *k, const void *v, uint32_t *scratch, int64_t num_keys,
                    int64_t keys_pad, int64_t num_kv_heads, int64_t head_dim, const int bf16,
                    const int fp8) {
    const int64_t D = head_dim, row = num_kv_heads * D;
    _Pragma("omp parallel for schedule(static)")
    for (int64_t h = 0; h < num_kv_heads; h++) {
        uint32_t *kp = scratch + h * (bf16 ? 1 : 2) * D * keys_pad;
        uint32_t *vp = kp + (bf16 ? D / 2 : D) * keys_pad;
        if (bf16) {
            for (int64_t p = 0; p < keys_pad; p++)
                for (int64_t e = 0; e < D / 2; e++) {
                    const int64_t at = p * row + h * D + 2 * e;
                    kp[e * keys_pad + p] = p < num_keys
                        ? kv_bf16(k, at, fp8) | kv_bf16(k, at + 1, fp8) << 16 : 0;
                }
            for (int64_t f = 0; f < keys_pad / 2; f++)
                for (int64_t e = 0; e < D; e++) {
                    const uint32_t lo = 2 * f < num_keys ? kv_bf16(v, 2 * f * row + h * D + e, fp8)
                                                         : 0;
                    const uint32_t hi = 2 * f + 1 < num_keys
                                        ? kv_bf16(v, (2 * f + 1) * row + h * D + e, fp8) : 0;
                    vp[f * D + e] = lo | hi << 16;
                }
        } else {
            float *kt = (float *)kp, *vt = (float *)vp;
            for (int64_t p = 0; p < keys_pad; p++)
                for (int64_t e = 0; e < D; e++) {
                    kt[e * keys_pad + p] = p < num_keys ? kv_f32(k, p * row + h * D + e, fp8) : 0.f;
                    vt[p * D + e] = p < num_keys ? kv_f32(v, p * row + h * D + e, fp8) : 0.f;
                }
        }
    }
}

/* The parallel loop over work items; a macro, so that each element type gets its own: GCC
 * outlines an OpenMP region before inlining, and a region in an inlined function would
 * take bf16 as a variable, leaving the micro-kernel's register blocks (which depend on it)
 * unknown at compile time. */
#define RUN(d, BF16)                                                                          \
    do {                                                                                      \
        const int64_t rows = (d)->num_tokens * (d)->group;                                    \
        const int64_t per_head = (rows + ITEM_ROWS - 1) / ITEM_ROWS;                          \
        _Pragma("omp parallel for schedule(static)")                                          \
        for (int64_t item = 0; item < (d)->num_kv_heads * per_head; item++) {                 \
            const int64_t h = item / per_head, first = item % per_head * ITEM_ROWS;           \
            const int64_t last = rows - first < ITEM_ROWS ? rows : first + ITEM_ROWS;         \
            for (int64_t r0 = first; r0 < last; r0 += DOT_ROWS)                               \
                row_block((d), h, r0, last - r0 < DOT_ROWS ? last - r0 : DOT_ROWS, BF16);     \
        }                                                                                     \
    } while (0)

/* Entry points, one per element type and K/V type (that type, or E4M3 codes with v_scale).
 * q [num_tokens, num_kv_heads * group, head_dim] (tokens q_token_stride elements apart);
 * k, v [num_keys, num_kv_heads, head_dim], contiguous; out [num_tokens, num_kv_heads,
 * group, head_dim] in q's type and lse
 * (float32) [num_tokens, num_kv_heads, group], contiguous; scratch:
 * shared_prefix_scratch_words() 32-bit words. Returns nonzero, touching nothing, for a
 * shape it does not handle. */
#define ENTRY(NAME, T, CT, BF16, FP8)                                                         \
int NAME(const T *q, int64_t q_token_stride, const CT *k, const CT *v, int64_t num_tokens,     \
         int64_t num_keys, int64_t num_kv_heads, int64_t group, int64_t head_dim, float scale, \
         T *out, float *lse, uint32_t *scratch, float v_scale) {                               \
    if (head_dim % 16 || head_dim > DOT_MAX_HEAD_DIM                                          \
            || head_dim < 16 || group < 1 || num_keys < 1)                                     \
        return 1;                                                                              \
    const int64_t keys_pad = (num_keys + 63) / 64 * 64;                                       \
    prepare(k, v, scratch, num_keys, keys_pad, num_kv_heads, head_dim, BF16, FP8);            \
    const shared_args d = {q, q_token_stride, scratch, num_tokens, num_kv_heads, group,        \
                           head_dim, num_keys, keys_pad, scale, FP8 ? v_scale : 1.f, out, lse}; \
    RUN(&d, BF16);                                                                             \
    return 0;                                                                                  \
}
ENTRY(shared_prefix_f32, float, float, 0, 0)
ENTRY(shared_prefix_bf16, uint16_t, uint16_t, 1, 0)
ENTRY(shared_prefix_f32_fp8, float, uint8_t, 0, 1)
ENTRY(shared_prefix_bf16_fp8, uint16_t, uint8_t, 1, 1)
