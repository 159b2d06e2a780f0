/* Fused elementwise operations for bfloat16 models on CPUs, where torch runs each step as
 * its own pass over memory (converting to float32 and back every time). batchinfer's
 * kernels/cpu_ops.py builds this file on first use and calls it through ctypes.
 *
 * Each function rounds where torch's sequence of bfloat16 operations rounds, so silu_mul
 * gives torch's bits and rms_norm differs only where its float32 sum of squares, added in
 * another order, lands on the other side of a bfloat16 rounding boundary (a few in a
 * million elements, by one unit in the last place).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_vec.h"

/* Rows are walked 32 elements at a time as even and odd halves (load_bf16x2), with a last
 * 16 in order when n is an odd multiple of 16. */

static inline f32x16 silu_rounded(f32x16 g) { return round_bf16(g / (1.0f + vexp(-g))); }

/* out = silu(gate) * up over [rows, n] (n a multiple of 16), as torch computes
 * F.silu(gate) * up in bfloat16: silu in float32, rounded, then the product, rounded.
 * Rows are *_stride elements apart; out may be gate. */
void silu_mul_bf16(const uint16_t *gate, const uint16_t *up, uint16_t *out, int64_t rows,
                   int64_t n, int64_t gate_stride, int64_t up_stride, int64_t out_stride) {
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate + r * gate_stride, *u = up + r * up_stride;
        uint16_t *o = out + r * out_stride;
        int64_t i = 0;
        for (; i + 32 <= n; i += 32) {
            f32x16 ge, go, ue, uo;
            load_bf16x2(g + i, &ge, &go);
            load_bf16x2(u + i, &ue, &uo);
            store_bf16x2(o + i, silu_rounded(ge) * ue, silu_rounded(go) * uo);
        }
        if (i < n) store_bf16(o + i, silu_rounded(load_bf16(g + i)) * load_bf16(u + i));
    }
}

/* out = weight * round(x * 1/sqrt(mean(x^2) + eps)) per row of [rows, n] (n a multiple of
 * 16), as transformers' RMSNorm computes it for bfloat16: the statistics and the scaling in
 * float32, rounded to bfloat16, then multiplied by the weight and rounded again. With a
 * residual, x is first added to it (rounded, as torch's bfloat16 add), the sum is written
 * back to residual and normalised in place of x. */
void rms_norm_bf16(const uint16_t *x, uint16_t *residual, const uint16_t *weight,
                   uint16_t *out, int64_t rows, int64_t n, float eps) {
    const int64_t n32 = n / 32 * 32;
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = x + r * n;
        uint16_t *o = out + r * n;
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
        for (int64_t i = 0; i < n32; i += 32) {
            load_bf16x2(row + i, &e, &od);
            load_bf16x2(weight + i, &e2, &o2);
            store_bf16x2(o + i, e2 * round_bf16(e * inv), o2 * round_bf16(od * inv));
        }
        if (n32 < n) {
            const f32x16 v = round_bf16(load_bf16(row + n32) * inv);
            store_bf16(o + n32, load_bf16(weight + n32) * v);
        }
    }
}

/* out[r] = the index of the first maximum of row r of [rows, n] (rows stride elements
 * apart), as torch.argmax: a NaN counts as larger than any number, so the first NaN wins.
 * Rows are read 32 elements at a time as even and odd halves; each lane keeps its first
 * maximum (a strictly greater value replaces it), and the lanes are then reduced to the
 * smallest index holding the row's maximum. */
void argmax_bf16(const uint16_t *x, int64_t rows, int64_t n, int64_t stride, int64_t *out) {
    const i32x16 lane2 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const int64_t n32 = n / 32 * 32;
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = x + r * stride;
        f32x16 best_e = (f32x16){0} - INFINITY, best_o = best_e;
        i32x16 at_e = (i32x16){0} + (int32_t)n, at_o = at_e, nan = {0};
        for (int64_t i = 0; i < n32; i += 32) {
            f32x16 e, o;
            load_bf16x2(row + i, &e, &o);
            const i32x16 ge = (i32x16)(e > best_e), go = (i32x16)(o > best_o);
            best_e = (f32x16)(((i32x16)e & ge) | ((i32x16)best_e & ~ge));
            best_o = (f32x16)(((i32x16)o & go) | ((i32x16)best_o & ~go));
            at_e = ((lane2 + (int32_t)i) & ge) | (at_e & ~ge);
            at_o = ((lane2 + (int32_t)(i + 1)) & go) | (at_o & ~go);
            nan |= (i32x16)(e != e) | (i32x16)(o != o);
        }
        float best = -INFINITY;
        int64_t at = n;  /* stays n only for a row of -inf (handled below) */
        int any_nan = 0;
        for (int k = 0; k < 16; k++) {
            any_nan |= nan[k] != 0;
            if (best_e[k] > best || (best_e[k] == best && at_e[k] < at))
                best = best_e[k], at = at_e[k];
            if (best_o[k] > best || (best_o[k] == best && at_o[k] < at))
                best = best_o[k], at = at_o[k];
        }
        for (int64_t i = n32; i < n; i++) {  /* the tail, after every earlier index */
            uint32_t w = (uint32_t)row[i] << 16;
            float v;
            memcpy(&v, &w, sizeof v);
            any_nan |= v != v;
            if (v > best) best = v, at = i;
        }
        if (any_nan) {  /* the first NaN */
            for (at = 0; at < n; at++) {
                uint32_t w = (uint32_t)row[at] << 16;
                float v;
                memcpy(&v, &w, sizeof v);
                if (v != v) break;
            }
        }
        out[r] = at == n ? 0 : at;  /* n: every value is -inf */
    }
}
