/* Rotary embedding and KV-cache write in one pass for CPUs: each token's q and k heads are
 * rotated by its cos/sin, q goes to a new tensor, and k and v go straight to the token's
 * cache slot. torch runs the same as about seven passes (products, negation, concatenation,
 * sum, two index copies). kernels/cpu/rope.py builds this file on first use and calls it
 * through ctypes.
 *
 * The arithmetic is torch's, rounding where it rounds: out = x * cos + rotate_half(x) * sin
 * with each product and the sum rounded to the element type, so the bits match the model's
 * torch path. For that the compiler must not fuse a product and the sum into one
 * multiply-add (a single rounding), hence the pragma, which covers this file only.
 *
 * An FP8 cache (kernels/fp8.py) gets E4M3 codes of k / k_scale and v / v_scale, rounded as
 * torch rounds (vec.h's f32_to_fp8), so those bits are the torch path's too.
 */
#pragma GCC optimize("fp-contract=off")

#include <stdint.h>
#include <string.h>

#include "vec.h"

static inline f32x16 round_to(f32x16 v, int bf16) { return bf16 ? round_bf16(v) : v; }

/* dst = x * cos + rotate_half(x) * sin for one head of head_dim elements (a multiple of
 * 32), where rotate_half(x) = (-x[half:], x[:half]). */
static inline __attribute__((always_inline)) void rotate(
        const void *x, int64_t x0, const void *cos, const void *sin, int64_t c0, void *dst,
        int64_t d0, int64_t head_dim, int bf16) {
    const int64_t half = head_dim / 2;
    int64_t i = 0;
    if (bf16)  /* 32 at a time as even and odd elements (load_bf16x2), then any last 16 */
        for (; i + 32 <= half; i += 32) {
            const uint16_t *xp = (const uint16_t *)x + x0, *cp = (const uint16_t *)cos + c0,
                           *sp = (const uint16_t *)sin + c0;
            uint16_t *dp = (uint16_t *)dst + d0;
            f32x16 x1e, x1o, x2e, x2o, c1e, c1o, c2e, c2o, s1e, s1o, s2e, s2o;
            load_bf16x2(xp + i, &x1e, &x1o);
            load_bf16x2(xp + half + i, &x2e, &x2o);
            load_bf16x2(cp + i, &c1e, &c1o);
            load_bf16x2(cp + half + i, &c2e, &c2o);
            load_bf16x2(sp + i, &s1e, &s1o);
            load_bf16x2(sp + half + i, &s2e, &s2o);
            store_bf16x2(dp + i, round_bf16(x1e * c1e) + round_bf16(-x2e * s1e),
                         round_bf16(x1o * c1o) + round_bf16(-x2o * s1o));
            store_bf16x2(dp + half + i, round_bf16(x2e * c2e) + round_bf16(x1e * s2e),
                         round_bf16(x2o * c2o) + round_bf16(x1o * s2o));
        }
    for (; i < half; i += 16) {
        const f32x16 x1 = load16(x, x0 + i, bf16), x2 = load16(x, x0 + half + i, bf16);
        const f32x16 c1 = load16(cos, c0 + i, bf16), c2 = load16(cos, c0 + half + i, bf16);
        const f32x16 s1 = load16(sin, c0 + i, bf16), s2 = load16(sin, c0 + half + i, bf16);
        store16(dst, d0 + i, round_to(x1 * c1, bf16) + round_to(-x2 * s1, bf16), bf16);
        store16(dst, d0 + half + i, round_to(x2 * c2, bf16) + round_to(x1 * s2, bf16), bf16);
    }
}

/* qk [tokens, num_heads + num_kv_heads, head_dim] (rows qk_stride elements apart) and v
 * [tokens, num_kv_heads, head_dim] (rows v_stride apart); cos/sin [tokens, head_dim]. Writes
 * the rotated q heads to q_out [tokens, num_heads, head_dim], and the rotated k heads and v
 * to row slots[t] of the caches ([slots, num_kv_heads, head_dim]), unless slots[t] < 0. */
#define ENTRY(NAME, T, BF16)                                                                  \
void NAME(const T *qk, int64_t qk_stride, const T *v, int64_t v_stride, const T *cos,          \
          const T *sin, const int64_t *slots, T *q_out, T *k_cache, T *v_cache,                \
          int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {     \
    const int64_t kv_row = num_kv_heads * head_dim;                                            \
    _Pragma("omp parallel for schedule(static)")                                               \
    for (int64_t t = 0; t < num_tokens; t++) {                                                 \
        for (int64_t h = 0; h < num_heads; h++)                                                \
            rotate(qk, t * qk_stride + h * head_dim, cos, sin, t * head_dim, q_out,            \
                   (t * num_heads + h) * head_dim, head_dim, BF16);                            \
        if (slots[t] < 0)                                                                      \
            continue; /* a padding row: nothing to store */                                    \
        for (int64_t h = 0; h < num_kv_heads; h++)                                             \
            rotate(qk, t * qk_stride + (num_heads + h) * head_dim, cos, sin, t * head_dim,     \
                   k_cache, slots[t] * kv_row + h * head_dim, head_dim, BF16);                 \
        memcpy(v_cache + slots[t] * kv_row, v + t * v_stride, kv_row * sizeof(T));             \
    }                                                                                          \
}
ENTRY(rope_write_f32, float, 0)
ENTRY(rope_write_bf16, uint16_t, 1)

/* n elements (a multiple of 16) of src, float32 or bfloat16, divided by scale and stored as
 * E4M3 codes at dst (see f32_to_fp8) */
static inline __attribute__((always_inline)) void store_fp8_row(uint8_t *dst, const void *src,
                                                               int64_t n, float scale,
                                                               int bf16) {
    for (int64_t i = 0; i < n; i += 16) store_fp8(dst + i, load16(src, i, bf16), scale);
}

/* As ENTRY, into an FP8 (E4M3) cache: each rotated k head is rounded to the element type
 * first (what torch's rotation gives), then stored as k / k_scale; v as v / v_scale. */
#define ENTRY_FP8(NAME, T, BF16)                                                              \
void NAME(const T *qk, int64_t qk_stride, const T *v, int64_t v_stride, const T *cos,          \
          const T *sin, const int64_t *slots, T *q_out, uint8_t *k_cache, uint8_t *v_cache,    \
          int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,       \
          float k_scale, float v_scale) {                                                      \
    const int64_t kv_row = num_kv_heads * head_dim;                                            \
    _Pragma("omp parallel for schedule(static)")                                               \
    for (int64_t t = 0; t < num_tokens; t++) {                                                 \
        for (int64_t h = 0; h < num_heads; h++)                                                \
            rotate(qk, t * qk_stride + h * head_dim, cos, sin, t * head_dim, q_out,            \
                   (t * num_heads + h) * head_dim, head_dim, BF16);                            \
        if (slots[t] < 0)                                                                      \
            continue;                                                                          \
        T k[head_dim];                                                                         \
        for (int64_t h = 0; h < num_kv_heads; h++) {                                           \
            rotate(qk, t * qk_stride + (num_heads + h) * head_dim, cos, sin, t * head_dim, k,  \
                   0, head_dim, BF16);                                                         \
            store_fp8_row(k_cache + slots[t] * kv_row + h * head_dim, k, head_dim, k_scale,    \
                          BF16);                                                               \
        }                                                                                      \
        store_fp8_row(v_cache + slots[t] * kv_row, v + t * v_stride, kv_row, v_scale, BF16);  \
    }                                                                                          \
}
ENTRY_FP8(rope_write_f32_fp8, float, 0)
ENTRY_FP8(rope_write_bf16_fp8, uint16_t, 1)
