/* Fused elementwise operations for models on CPUs, where torch runs each step as its own
 * pass over memory (for bfloat16, converting to float32 and back every time; for float32,
 * with a temporary tensor between steps). batchinfer's kernels/cpu/ops.py builds this file
 * on first use and calls it through ctypes.
 *
 * For bfloat16 each function rounds where torch's sequence of bfloat16 operations rounds,
 * so silu_mul gives torch's bits, and gelu_tanh_mul and rms_norm differ only where a float32
 * value computed another way (gelu_tanh's form; the sum of squares' order; in Gemma's
 * order, 1/sqrtf against torch's rsqrt) lands on the other side of a bfloat16 rounding
 * boundary (a few in a million elements, by one unit in the last place). For float32
 * nothing is rounded between steps, as in torch; the sum of squares' order, the exp
 * polynomial (vexp against torch's) and gelu_tanh's form differ in the last bits.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"

/* Rows are walked 32 elements at a time as even and odd halves (load_bf16x2), with a last
 * 16 in order when n is an odd multiple of 16. */

static inline f32x16 silu(f32x16 g) { return g / (1.0f + vexp(-g)); }

/* GELU with the tanh approximation, 0.5 g (1 + tanh(y)) with y = sqrt(2 / pi) (g + 0.044715
 * g^3), in torch's order of operations. tanh(y) = sign(y) (1 - 2 / (exp(2|y|) + 1)), and
 * exactly +-1 past |y| = 12.5 ln 2 as in torch's (SLEEF's) tanh: the negative tail then
 * gives torch's -0 rather than a smaller-than-rounding remainder. */
static inline f32x16 gelu_tanh(f32x16 g) {
    const f32x16 y = 0.7978845608028654f * (g + 0.044715f * (g * g * g));
    const i32x16 sign = (i32x16)y & (int32_t)0x80000000u;
    const f32x16 a = (f32x16)((i32x16)y ^ sign);  /* |y| */
    const i32x16 saturated = (i32x16)(a > 8.664339742f);
    const f32x16 t = 1.0f - 2.0f / (vexp(a + a) + 1.0f);
    const f32x16 t1 = (f32x16)(((i32x16)t & ~saturated) | ((i32x16)((f32x16){0} + 1.0f) & saturated));
    return 0.5f * g * (1.0f + (f32x16)((i32x16)t1 | sign));
}

/* NAME_bf16: out = act(gate) * up over [rows, n] (n a multiple of 16), as torch computes
 * F.act(gate) * up in bfloat16: the activation in float32, rounded, then the product,
 * rounded (for SiLU, torch's bits). NAME_f32: the same in float32, in one pass. Rows are
 * *_stride elements apart; out may be gate. */
#define ACT_MUL(NAME, ACT)                                                                    \
void NAME##_bf16(const uint16_t *gate, const uint16_t *up, uint16_t *out, int64_t rows,       \
                 int64_t n, int64_t gate_stride, int64_t up_stride, int64_t out_stride) {     \
    _Pragma("omp parallel for schedule(static)")                                              \
    for (int64_t r = 0; r < rows; r++) {                                                      \
        const uint16_t *g = gate + r * gate_stride, *u = up + r * up_stride;                  \
        uint16_t *o = out + r * out_stride;                                                   \
        int64_t i = 0;                                                                        \
        for (; i + 32 <= n; i += 32) {                                                        \
            f32x16 ge, go, ue, uo;                                                            \
            load_bf16x2(g + i, &ge, &go);                                                     \
            load_bf16x2(u + i, &ue, &uo);                                                     \
            store_bf16x2(o + i, round_bf16(ACT(ge)) * ue, round_bf16(ACT(go)) * uo);          \
        }                                                                                     \
        if (i < n) store_bf16(o + i, round_bf16(ACT(load_bf16(g + i))) * load_bf16(u + i));   \
    }                                                                                         \
}                                                                                             \
void NAME##_f32(const float *gate, const float *up, float *out, int64_t rows, int64_t n,      \
                int64_t gate_stride, int64_t up_stride, int64_t out_stride) {                 \
    _Pragma("omp parallel for schedule(static)")                                              \
    for (int64_t r = 0; r < rows; r++) {                                                      \
        const float *g = gate + r * gate_stride, *u = up + r * up_stride;                     \
        float *o = out + r * out_stride;                                                      \
        for (int64_t i = 0; i < n; i += 16)                                                   \
            store_f32(o + i, ACT(load_f32(g + i)) * load_f32(u + i));                         \
    }                                                                                         \
}
ACT_MUL(silu_mul, silu)
ACT_MUL(gelu_tanh_mul, gelu_tanh)

/* Row r of x lies at element (r / inner) * x_outer + (r % inner) * n, and of out at
 * (r / inner) * out_outer + (r % inner) * n: contiguous rows have inner == rows, and a
 * per-head norm walks a run of `inner` heads in each token's row of a projection. out may
 * be x (in place). A residual, when given, is contiguous [rows, n]. */
static inline int64_t row_at(int64_t r, int64_t inner, int64_t outer, int64_t n) {
    return r / inner * outer + r % inner * n;
}

/* out = weight * round(x * 1/sqrt(mean(x^2) + eps)) per row of n elements (a multiple of
 * 16), as transformers' RMSNorm computes it for bfloat16: the statistics and the scaling in
 * float32, rounded to bfloat16, then multiplied by the weight and rounded again. With
 * gemma_order, weight is float32 and the product is taken before the one rounding,
 * round(x * 1/sqrt(...) * weight), as Gemma's norm does with its 1 + w. With a residual, x
 * is first added to it (rounded, as torch's bfloat16 add), the sum is written back to
 * residual and normalised in place of x. */
void rms_norm_bf16(const uint16_t *x, uint16_t *residual, const void *weight, uint16_t *out,
                   int64_t rows, int64_t n, int64_t inner, int64_t x_outer, int64_t out_outer,
                   float eps, int gemma_order) {
    const int64_t n32 = n / 32 * 32;
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = x + row_at(r, inner, x_outer, n);
        uint16_t *o = out + row_at(r, inner, out_outer, n);
        f32x16 e, od, e2, o2;
        if (residual) {
            uint16_t *sum = residual + r * n;
            for (int64_t i = 0; i < n32; i += 32) {
                load_bf16x2(row + i, &e, &od);
                load_bf16x2(sum + i, &e2, &o2);
                store_bf16x2(sum + i, e + e2, od + o2);
            }
            if (n32 < n) store_bf16(sum + n32, load_bf16(row + n32) + load_bf16(sum + n32));
            row = sum;
        }
        f32x16 acc = {0};
        for (int64_t i = 0; i < n32; i += 32) {
            load_bf16x2(row + i, &e, &od);
            acc += e * e + od * od;
        }
        if (n32 < n) {
            const f32x16 v = load_bf16(row + n32);
            acc += v * v;
        }
        const float inv = 1.0f / sqrtf(hsum(acc) / (float)n + eps);
        if (gemma_order) {
            const float *w = weight;
            for (int64_t i = 0; i < n32; i += 32) {
                load_bf16x2(row + i, &e, &od);
                const f32x16 w0 = load_f32(w + i), w1 = load_f32(w + i + 16);
                store_bf16x2(o + i,
                             e * inv * SHUFFLE(w0, w1, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20,
                                               22, 24, 26, 28, 30),
                             od * inv * SHUFFLE(w0, w1, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21,
                                                23, 25, 27, 29, 31));
            }
            if (n32 < n) store_bf16(o + n32, load_bf16(row + n32) * inv * load_f32(w + n32));
            continue;
        }
        const uint16_t *w = weight;
        for (int64_t i = 0; i < n32; i += 32) {
            load_bf16x2(row + i, &e, &od);
            load_bf16x2(w + i, &e2, &o2);
            store_bf16x2(o + i, e2 * round_bf16(e * inv), o2 * round_bf16(od * inv));
        }
        if (n32 < n) {
            const f32x16 v = round_bf16(load_bf16(row + n32) * inv);
            store_bf16(o + n32, load_bf16(w + n32) * v);
        }
    }
}

/* RMSNorm for float32: weight * (x / sqrt(mean(x^2) + eps)) with the residual add before it
 * and rows laid out as for bfloat16, in one pass (n a multiple of 16). */
void rms_norm_f32(const float *x, float *residual, const float *weight, float *out,
                  int64_t rows, int64_t n, int64_t inner, int64_t x_outer, int64_t out_outer,
                  float eps) {
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + row_at(r, inner, x_outer, n);
        float *o = out + row_at(r, inner, out_outer, n);
        if (residual) {
            float *sum = residual + r * n;
            for (int64_t i = 0; i < n; i += 16)
                store_f32(sum + i, load_f32(row + i) + load_f32(sum + i));
            row = sum;
        }
        f32x16 acc = {0};
        for (int64_t i = 0; i < n; i += 16) {
            const f32x16 v = load_f32(row + i);
            acc += v * v;
        }
        const float inv = 1.0f / sqrtf(hsum(acc) / (float)n + eps);
        for (int64_t i = 0; i < n; i += 16)
            store_f32(o + i, load_f32(weight + i) * (load_f32(row + i) * inv));
    }
}

/* 32 elements of a row from i as two vectors: bfloat16 as its even and odd elements
 * (load_bf16x2), float32 as two runs of 16; *ia and *ib get each lane's index. */
static inline __attribute__((always_inline)) void load32(
        const void *row, int64_t i, int bf16, f32x16 *a, f32x16 *b, i32x16 *ia, i32x16 *ib) {
    const i32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    if (bf16) {
        load_bf16x2((const uint16_t *)row + i, a, b);
        *ia = lane * 2 + (int32_t)i;
        *ib = lane * 2 + (int32_t)(i + 1);
    } else {
        *a = load_f32((const float *)row + i);
        *b = load_f32((const float *)row + i + 16);
        *ia = lane + (int32_t)i;
        *ib = lane + (int32_t)(i + 16);
    }
}

/* out[r] = the index of the first maximum of row r of [rows, n] (rows stride elements
 * apart), as torch.argmax: a NaN counts as larger than any number, so the first NaN wins.
 * Rows are read 32 elements at a time (load32); each lane keeps its first maximum (only a
 * strictly greater value replaces it), and the lanes are then reduced to the smallest index
 * holding the row's maximum. One pass over the logits, where torch needs a value-only pass
 * and then a search, or a slower reduction that carries indices. */
static inline __attribute__((always_inline)) void argmax_rows(
        const void *x, int64_t rows, int64_t n, int64_t stride, int64_t *out, int bf16) {
    const int64_t n32 = n / 32 * 32, elem = bf16 ? 2 : 4;
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const char *row = (const char *)x + r * stride * elem;
        f32x16 best_a = (f32x16){0} - INFINITY, best_b = best_a;
        i32x16 at_a = (i32x16){0} + (int32_t)n, at_b = at_a, nan = {0};
        for (int64_t i = 0; i < n32; i += 32) {
            f32x16 a, b;
            i32x16 ia, ib;
            load32(row, i, bf16, &a, &b, &ia, &ib);
            const i32x16 ga = (i32x16)(a > best_a), gb = (i32x16)(b > best_b);
            best_a = (f32x16)(((i32x16)a & ga) | ((i32x16)best_a & ~ga));
            best_b = (f32x16)(((i32x16)b & gb) | ((i32x16)best_b & ~gb));
            at_a = (ia & ga) | (at_a & ~ga);
            at_b = (ib & gb) | (at_b & ~gb);
            nan |= (i32x16)(a != a) | (i32x16)(b != b);
        }
        float best = -INFINITY;
        int64_t at = n;  /* stays n only for a row of -inf (handled below) */
        int any_nan = 0;
        for (int k = 0; k < 16; k++) {
            any_nan |= nan[k] != 0;
            if (best_a[k] > best || (best_a[k] == best && at_a[k] < at))
                best = best_a[k], at = at_a[k];
            if (best_b[k] > best || (best_b[k] == best && at_b[k] < at))
                best = best_b[k], at = at_b[k];
        }
        for (int64_t i = n32; i < n; i++) {  /* the tail, after every earlier index */
            const float v = load1(row, i, bf16);
            any_nan |= v != v;
            if (v > best) best = v, at = i;
        }
        if (any_nan)  /* the first NaN */
            for (at = 0; at < n && load1(row, at, bf16) == load1(row, at, bf16); at++) {}
        out[r] = at == n ? 0 : at;  /* n: every value is -inf */
    }
}

void argmax_bf16(const uint16_t *x, int64_t rows, int64_t n, int64_t stride, int64_t *out) {
    argmax_rows(x, rows, n, stride, out, 1);
}
void argmax_f32(const float *x, int64_t rows, int64_t n, int64_t stride, int64_t *out) {
    argmax_rows(x, rows, n, stride, out, 0);
}
