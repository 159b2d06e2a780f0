/* Weight-only FP8 linear product for CPUs: y = x W^T (+ bias), with W kept as its E4M3
 * bytes and widened to float32 as it is used, so no full-precision copy of W is ever made.
 * kernels/cpu/fp8_linear.py builds this file on first use and calls it through ctypes.
 *
 * W is [N, K] float8_e4m3fn; its scales are float32 [N, G], one per group of group_size
 * input features (G = ceil(K / group_size); the last group may be partial), and
 * W[n, k] = float(byte[n, k]) * scale[n, k / group_size].
 *
 * An E4M3 byte's sign goes to bit 31 and its exponent and mantissa to bits 20-26 of a
 * float32, which is then the byte's value times 2^-120, exactly (E4M3's subnormals become float32
 * subnormals); multiplying by 2^120 * scale gives the dequantised weight, rounded once. The
 * NaN bytes (0x7f, 0xff) never occur in weights and are not handled.
 *
 * Each thread takes a contiguous run of W's rows and reads them once. NR rows x KC elements
 * of W are widened at a time into a small float32 buffer that stays in L1, and every row of
 * x takes its dot products from that buffer, MR rows of x x NR rows of W at a time as 16-lane
 * partial sums in registers, reduced together once per buffer (transpose_sum16), so a
 * decode batch of M sequences converts each weight once, not M times. When x is too large
 * to stay in L2, a thread takes PANEL_TILES tiles of NR rows through each KC-wide chunk of x
 * before moving on, so x is read from further out once per panel, not once per tile.
 * Accumulation is float32. x is float32 [M, ldx], its elements from K up to K rounded up to
 * 16 zero (the caller pads).
 *
 * fp8_dequantize writes dequant(W) out whole, in float32 or bfloat16, for a tile of W's rows
 * that a caller multiplies in that type (with the same vectorised conversion).
 *
 * Written with GCC/Clang vector extensions (vec.h), which the compiler maps to AVX-512,
 * AVX2 or NEON, and one AVX-512 intrinsic where the host has it (e4m3_scaled_down). The
 * OpenMP loops run on the OpenMP runtime torch itself loaded.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define INLINE static inline __attribute__((always_inline))

#define NR 4            /* rows of W widened and multiplied together */
#define MR 4            /* rows of x multiplied together: MR x NR = 16 partial sums */
#define KC 512          /* elements of K widened at a time: NR x KC floats, 8 KiB */
#define X_CACHED_BYTES (512 * 1024)  /* x up to this size is left to stay in L2 */
#define PANEL_TILES 8   /* tiles per pass over an x chunk when x is larger */
#if MR * NR != 16
#error "dot_tile reduces exactly 16 partial sums"
#endif

typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef int16_t i16x16 __attribute__((vector_size(32)));

/* 16 E4M3 bytes as float32 values times 2^-120: each byte sign-extended to 32 bits and
 * shifted left by 20 has its sign in bits 28-31 and its exponent and mantissa in bits 20-26;
 * the mask keeps bit 31 and bits 20-26. On AVX-512 the widening is one instruction, where
 * GCC makes a chain of shuffles of __builtin_convertvector's (two steps, as below, come out
 * better than one). */
INLINE f32x16 e4m3_scaled_down(const uint8_t *p) {
#if defined(__AVX512F__)
    const i32x16 w = (i32x16)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
#else
    i8x16 b;
    memcpy(&b, p, sizeof b);
    const i32x16 w = __builtin_convertvector(__builtin_convertvector(b, i16x16), i32x16);
#endif
    const u32x16 bits = ((u32x16)w << 20) & 0x87f00000u;
    f32x16 v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

INLINE float e4m3_value(uint8_t b) {
    const uint32_t bits = ((uint32_t)(b & 0x7f) << 20) | ((uint32_t)(b & 0x80) << 24);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f * 0x1p120f;
}

/* dst[i] = value(w[i]) * s for i < n */
INLINE void widen_run(const uint8_t *w, int64_t n, float s, float *dst) {
    int64_t i = 0;
    if (fabsf(s) < 0x1p8f) {  /* 2^120 * s is a float: one multiply */
        const float c = s * 0x1p120f;
        for (; i + 16 <= n; i += 16) store_f32(dst + i, e4m3_scaled_down(w + i) * c);
    } else {
        for (; i + 16 <= n; i += 16)
            store_f32(dst + i, e4m3_scaled_down(w + i) * 0x1p120f * s);
    }
    for (; i < n; i++) dst[i] = e4m3_value(w[i]) * s;
}

/* dst[k - k0] = W[n, k] for k in [k0, k_end), from row n's bytes and scales: one run per
 * group */
INLINE void widen_row(const uint8_t *row, const float *row_scale, int64_t group_size,
                      int64_t k0, int64_t k_end, float *dst) {
    for (int64_t k = k0; k < k_end;) {
        const int64_t g = k / group_size;
        const int64_t end = (g + 1) * group_size < k_end ? (g + 1) * group_size : k_end;
        widen_run(row + k, end - k, row_scale[g], dst + (k - k0));
        k = end;
    }
}

/* buf[r][k - k0] = W[n0 + r, k] for r < rows and k in [k0, k0 + kc); kc is a multiple of 16,
 * and the elements past K and the rows past `rows` are zeros. */
INLINE void widen_tile(const uint8_t *w, const float *scale, int64_t K, int64_t G,
                       int64_t group_size, int64_t n0, int64_t rows, int64_t k0, int64_t kc,
                       float *buf) {
    const int64_t k_end = k0 + kc < K ? k0 + kc : K;
    for (int64_t r = 0; r < NR; r++) {
        float *dst = buf + r * KC;
        if (r >= rows) {
            memset(dst, 0, (size_t)kc * sizeof(float));
            continue;
        }
        widen_row(w + (n0 + r) * K, scale + (n0 + r) * G, group_size, k0, k_end, dst);
        memset(dst + (k_end - k0), 0, (size_t)(k0 + kc - k_end) * sizeof(float));
    }
}

/* sums[m * NR + r] = x[m] . buf[r] over kc elements (a multiple of 16), for m < mr: mr rows
 * of x (ldx apart) against the buffer's NR rows. Inlined with a constant mr. */
INLINE f32x16 dot_tile(const float *x, int64_t ldx, const float *buf, int64_t kc, int mr) {
    f32x16 acc[MR * NR];
    for (int i = 0; i < MR * NR; i++) acc[i] = (f32x16){0};
    for (int64_t k = 0; k < kc; k += 16) {
        f32x16 wv[NR];
        for (int r = 0; r < NR; r++) wv[r] = load_f32(buf + r * KC + k);
        for (int m = 0; m < mr; m++) {
            const f32x16 xv = load_f32(x + m * ldx + k);
            for (int r = 0; r < NR; r++) acc[m * NR + r] += xv * wv[r];
        }
    }
    return transpose_sum16(acc);
}

/* y[m, n] = bias[n] + sum_k x[m, k] W[n, k], for x float32 [M, ldx] (ldx >= K rounded up to
 * 16, the elements past K zero), w E4M3 [N, K], scale float32 [N, G], bias float32 [N] or
 * NULL, y float32 [M, N]. */
void fp8_linear_f32(const float *x, int64_t ldx, const uint8_t *w, const float *scale,
                    const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                    int64_t group_size) {
    if (M <= 0 || N <= 0 || K <= 0 || group_size <= 0) return;
    const int64_t G = (K + group_size - 1) / group_size;
    const int64_t k16 = (K + 15) / 16 * 16;
    const int64_t tiles = (N + NR - 1) / NR;
    const int64_t panel = M * k16 * (int64_t)sizeof(float) <= X_CACHED_BYTES ? 1 : PANEL_TILES;
    const int64_t panels = (tiles + panel - 1) / panel;
    #pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        float buf[NR * KC] __attribute__((aligned(64)));
        const int64_t t_end = (p + 1) * panel < tiles ? (p + 1) * panel : tiles;
        for (int64_t k0 = 0; k0 < k16; k0 += KC) {
            const int64_t kc = k16 - k0 < KC ? k16 - k0 : KC;
            for (int64_t t = p * panel; t < t_end; t++) {
                const int64_t n0 = t * NR, rows = N - n0 < NR ? N - n0 : NR;
                widen_tile(w, scale, K, G, group_size, n0, rows, k0, kc, buf);
                for (int64_t m0 = 0; m0 < M; m0 += MR) {
                    const int mr = M - m0 < MR ? (int)(M - m0) : MR;
                    const float *xm = x + m0 * ldx + k0;
                    f32x16 sums;
                    switch (mr) {
                        case 4: sums = dot_tile(xm, ldx, buf, kc, 4); break;
                        case 3: sums = dot_tile(xm, ldx, buf, kc, 3); break;
                        case 2: sums = dot_tile(xm, ldx, buf, kc, 2); break;
                        default: sums = dot_tile(xm, ldx, buf, kc, 1); break;
                    }
                    for (int m = 0; m < mr; m++) {
                        float *out = y + (m0 + m) * N + n0;
                        for (int r = 0; r < rows; r++) {
                            const float s = sums[m * NR + r];
                            if (k0 > 0) out[r] += s;
                            else out[r] = bias ? bias[n0 + r] + s : s;
                        }
                    }
                }
            }
        }
    }
}

/* out = dequant(W) [N, K], float32 (bf16 == 0) or bfloat16 (bf16 == 1, rounded once to
 * nearest even, as torch rounds float32): for products that take W in a float type (a tile
 * of rows at a time). */
void fp8_dequantize(const uint8_t *w, const float *scale, void *out, int64_t N, int64_t K,
                    int64_t group_size, int bf16) {
    if (N <= 0 || K <= 0 || group_size <= 0) return;
    const int64_t G = (K + group_size - 1) / group_size;
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *row = w + n * K;
        const float *row_scale = scale + n * G;
        if (!bf16) {
            widen_row(row, row_scale, group_size, 0, K, (float *)out + n * K);
            continue;
        }
        float buf[KC] __attribute__((aligned(64)));
        uint16_t *dst = (uint16_t *)out + n * K;
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
            const int64_t kc = K - k0 < KC ? K - k0 : KC;
            widen_row(row, row_scale, group_size, k0, k0 + kc, buf);
            int64_t i = 0;
            for (; i + 16 <= kc; i += 16) store_bf16(dst + k0 + i, load_f32(buf + i));
            if (i < kc) {
                f32x16 v = {0};
                memcpy(&v, buf + i, (size_t)(kc - i) * sizeof(float));
                const u32x16 h = bf16_bits(v) >> 16;
                for (int64_t j = 0; j < kc - i; j++) dst[k0 + i + j] = (uint16_t)h[j];
            }
        }
    }
}
