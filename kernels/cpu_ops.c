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

/* out = silu(gate) * up over [rows, n] (n a multiple of 16), as torch computes
 * F.silu(gate) * up in bfloat16: silu in float32, rounded, then the product, rounded.
 * Rows are *_stride elements apart; out may be gate. */
void silu_mul_bf16(const uint16_t *gate, const uint16_t *up, uint16_t *out, int64_t rows,
                   int64_t n, int64_t gate_stride, int64_t up_stride, int64_t out_stride) {
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < n; i += 16) {
            const f32x16 g = load_bf16(gate + r * gate_stride + i);
            const f32x16 s = round_bf16(g / (1.0f + vexp(-g)));
            store_bf16(out + r * out_stride + i, s * load_bf16(up + r * up_stride + i));
        }
}

/* out = weight * round(x * 1/sqrt(mean(x^2) + eps)) per row of [rows, n] (n a multiple of
 * 16), as transformers' RMSNorm computes it for bfloat16: the statistics and the scaling in
 * float32, rounded to bfloat16, then multiplied by the weight and rounded again. With a
 * residual, x is first added to it (rounded, as torch's bfloat16 add), the sum is written
 * back to residual and normalised in place of x. */
void rms_norm_bf16(const uint16_t *x, uint16_t *residual, const uint16_t *weight,
                   uint16_t *out, int64_t rows, int64_t n, float eps) {
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = x + r * n;
        if (residual) {
            uint16_t *sum = residual + r * n;
            for (int64_t i = 0; i < n; i += 16)
                store_bf16(sum + i, load_bf16(row + i) + load_bf16(sum + i));
            row = sum;
        }
        f32x16 acc = {0};
        for (int64_t i = 0; i < n; i += 16) {
            const f32x16 v = load_bf16(row + i);
            acc += v * v;
        }
        const float inv = 1.0f / sqrtf(hsum(acc) / (float)n + eps);
        for (int64_t i = 0; i < n; i += 16)
            store_bf16(out + r * n + i,
                       load_bf16(weight + i) * round_bf16(load_bf16(row + i) * inv));
    }
}
