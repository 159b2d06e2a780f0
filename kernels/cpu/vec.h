/* 16-lane float vectors for the CPU kernels (GCC/Clang vector extensions; the compiler maps
 * them to AVX-512, AVX2 or NEON), with loads and stores of float32 and bfloat16 and a
 * vectorised exp. */
#ifndef BATCHINFER_CPU_VEC_H
#define BATCHINFER_CPU_VEC_H

#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

/* Vectors of the build's register width: 16 lanes with AVX-512, 8 with AVX2, 4 otherwise
 * (NEON, SSE). A 16-lane vector spans two AVX2 registers, and GCC keeps such values in memory
 * between operations, so hot loops hold fvecs, NSUB of them per 16 elements. */
#if defined(__AVX512F__)
#define NLANES 16
#elif defined(__AVX__)
#define NLANES 8
#else
#define NLANES 4
#endif
#define NSUB (16 / NLANES)
typedef float fvec __attribute__((vector_size(4 * NLANES)));
typedef int32_t ivec __attribute__((vector_size(4 * NLANES)));
typedef uint32_t uvec __attribute__((vector_size(4 * NLANES)));
typedef uint16_t hvec __attribute__((vector_size(2 * NLANES)));

static inline fvec load_fv(const void *p) { fvec v; memcpy(&v, p, sizeof v); return v; }
static inline void store_fv(void *p, fvec v) { memcpy(p, &v, sizeof v); }
static inline fvec fvmax(fvec a, fvec b) {
    const ivec gt = (ivec)(a > b);
    return (fvec)(((ivec)a & gt) | ((ivec)b & ~gt));
}

#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (i32x16){__VA_ARGS__})
#endif

static inline f32x16 load_f32(const float *p) { f32x16 v; memcpy(&v, p, sizeof v); return v; }
static inline void store_f32(float *p, f32x16 v) { memcpy(p, &v, sizeof v); }

static inline f32x16 load_bf16(const uint16_t *p) {
    u16x16 h; memcpy(&h, p, sizeof h);
    u32x16 w = __builtin_convertvector(h, u32x16) << 16;
    f32x16 v; memcpy(&v, &w, sizeof v); return v;
}
/* v rounded to bfloat16 (nearest even; a NaN stays a quiet NaN), in each lane's high 16 bits */
static inline u32x16 bf16_bits(f32x16 v) {
    u32x16 u; memcpy(&u, &v, sizeof u);
    u32x16 nan = (u32x16)((u & 0x7fffffffu) > 0x7f800000u);
    u32x16 r = u + 0x7fffu + ((u >> 16) & 1u);
    return (r & ~nan) | ((u | 0x400000u) & nan);
}
static inline void store_bf16(uint16_t *p, f32x16 v) {
    u16x16 h = __builtin_convertvector(bf16_bits(v) >> 16, u16x16); memcpy(p, &h, sizeof h);
}

/* 16 elements at element offset i of a float32 (bf16 == 0) or bfloat16 (bf16 == 1) array;
 * callers pass a constant flag, so each use compiles to one of the two */
static inline __attribute__((always_inline)) f32x16 load16(const void *base, int64_t i,
                                                          int bf16) {
    return bf16 ? load_bf16((const uint16_t *)base + i) : load_f32((const float *)base + i);
}
/* element i of a float32 (bf16 == 0) or bfloat16 (bf16 == 1) array, widened */
static inline __attribute__((always_inline)) float load1(const void *base, int64_t i,
                                                         int bf16) {
    if (!bf16) return ((const float *)base)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)base)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
static inline __attribute__((always_inline)) void store16(void *base, int64_t i, f32x16 v,
                                                         int bf16) {
    if (bf16) store_bf16((uint16_t *)base + i, v);
    else store_f32((float *)base + i, v);
}

/* 32 bfloat16 values as their even (p[0], p[2], ...) and odd elements: a shift and a mask,
 * where two load_bf16 take two loads, conversions and shifts. For elementwise work whose
 * operands are all read this way and stored with store_bf16x2, the order does not matter. */
static inline void load_bf16x2(const uint16_t *p, f32x16 *even, f32x16 *odd) {
    u32x16 w; memcpy(&w, p, sizeof w);
    const u32x16 e = w << 16, o = w & 0xffff0000u;
    memcpy(even, &e, sizeof e); memcpy(odd, &o, sizeof o);
}
static inline void store_bf16x2(uint16_t *p, f32x16 even, f32x16 odd) {
    const u32x16 w = (bf16_bits(even) >> 16) | (bf16_bits(odd) & 0xffff0000u);
    memcpy(p, &w, sizeof w);
}

/* the value a bfloat16 tensor would hold: store_bf16 and load_bf16 in registers */
static inline f32x16 round_bf16(f32x16 v) {
    u32x16 r = bf16_bits(v) & 0xffff0000u;
    memcpy(&v, &r, sizeof v); return v;
}

/* FP8 KV caches hold E4M3 (torch.float8_e4m3fn) codes: 1 sign, 4 exponent (bias 7) and 3
 * mantissa bits; 0x7f and 0xff are NaN, 448 the largest finite value. */
typedef uint8_t u8x16 __attribute__((vector_size(16)));

/* The float32 values of 16 E4M3 codes (one per lane, in the low byte), exact for every
 * code: normals by moving the exponent and mantissa into place and rebiasing (+120), the
 * subnormals (exponent 0) as m * 2^-9, NaN for 0x7f and 0xff. No float32 denormal is made
 * on the way (those can cost a microcode assist per operation). */
static inline f32x16 fp8_to_f32(u32x16 b) {
    const u32x16 mag = b & 0x7fu;
    const u32x16 normal = (mag << 20) + (120u << 23);
    const f32x16 subf = __builtin_convertvector((i32x16)mag, f32x16) * (1.0f / 512);
    u32x16 sub; memcpy(&sub, &subf, sizeof sub);
    const u32x16 is_normal = (u32x16)(mag >= 8u), nan = (u32x16)(mag == 0x7fu);
    const u32x16 bits = ((normal & is_normal) | (sub & ~is_normal) | (0x7fc00000u & nan))
                        | (b & 0x80u) << 24;
    f32x16 v; memcpy(&v, &bits, sizeof v); return v;
}
/* one E4M3 code's float32 value (fp8_to_f32 for a single code) */
static inline float fp8_value(uint8_t b) {
    const uint32_t mag = b & 0x7fu;
    uint32_t bits;
    if (mag >= 8u) {
        bits = mag == 0x7fu ? 0x7fc00000u : (mag << 20) + (120u << 23);
    } else {
        const float sub = (float)mag * (1.0f / 512);
        memcpy(&bits, &sub, sizeof bits);
    }
    bits |= (uint32_t)(b & 0x80u) << 24;
    float v; memcpy(&v, &bits, sizeof v); return v;
}
/* ... as the bfloat16 that holds it exactly (every E4M3 value is a bfloat16 value) */
static inline uint16_t fp8_bf16(uint8_t b) {
    const float v = fp8_value(b);
    uint32_t bits; memcpy(&bits, &v, sizeof bits);
    return (uint16_t)(bits >> 16);
}
/* 16 E4M3 codes at p, widened */
static inline f32x16 load_fp8(const uint8_t *p) {
    u8x16 h; memcpy(&h, p, sizeof h);
    return fp8_to_f32(__builtin_convertvector(h, u32x16));
}

/* v / scale as E4M3 codes (one per lane): clamped to [-448, 448] (NaN stays NaN), then
 * rounded to nearest even, as torch's (x / scale).clamp(-448, 448).to(float8_e4m3fn).
 * Normals round in the float32 bits (the rounding bias added below the 3 kept mantissa
 * bits); values below 2^-6 are m * 2^-9 with m = |v| * 2^9 rounded to an integer by adding
 * 2^23 (exact: the product is, and the sum's rounding is the float unit's). */
static inline u32x16 f32_to_fp8(f32x16 v, float scale) {
    v = v / scale;
    const i32x16 hi = (i32x16)(v > 448.0f), lo = (i32x16)(v < -448.0f);
    v = (f32x16)(((i32x16)v & ~(hi | lo)) | ((i32x16)((f32x16){0} + 448.0f) & hi)
                 | ((i32x16)((f32x16){0} - 448.0f) & lo));
    u32x16 u; memcpy(&u, &v, sizeof u);
    const u32x16 a = u & 0x7fffffffu;
    const u32x16 normal = ((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - 0x3c0u;
    f32x16 af; memcpy(&af, &a, sizeof af);
    const f32x16 t = af * 512.0f + 8388608.0f;
    u32x16 sub; memcpy(&sub, &t, sizeof sub);
    sub -= 0x4b000000u;
    const u32x16 is_normal = (u32x16)(a >= 0x3c800000u), nan = (u32x16)(a > 0x7f800000u);
    const u32x16 code = (((normal & is_normal) | (sub & ~is_normal)) & ~nan) | (0x7fu & nan);
    return code | ((u >> 24) & 0x80u);
}
/* 16 values of v / scale as E4M3 at p */
static inline void store_fp8(uint8_t *p, f32x16 v, float scale) {
    const u8x16 h = __builtin_convertvector(f32_to_fp8(v, scale), u8x16);
    memcpy(p, &h, sizeof h);
}

static inline float hsum(f32x16 v) {
    float s = 0.f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}
/* out[i] = sum of the 16 lanes of x[i], for 16 vectors, in 15 adds and 30 shuffles */
static inline __attribute__((always_inline)) f32x16 transpose_sum16(const f32x16 *x) {
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

static inline f32x16 vmax(f32x16 a, f32x16 b) {
    i32x16 gt = (i32x16)(a > b);
    return (f32x16)(((i32x16)a & gt) | ((i32x16)b & ~gt));
}
/* The largest of a row's n elements (float32, or bfloat16 widened), or NaN when the row
 * has no finite maximum (a NaN anywhere, +inf, or every element -inf): one pass, for the
 * kernels that take a row's softmax from its maximum. */
static inline __attribute__((always_inline)) float finite_row_max(const void *z, int64_t n,
                                                                  int bf16) {
    f32x16 mv = (f32x16){0} - INFINITY;
    i32x16 nan = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const f32x16 v = load16(z, i, bf16);
        nan |= (i32x16)(v != v);
        mv = vmax(mv, v);
    }
    float m = -INFINITY;
    for (int l = 0; l < 16; l++) {
        if (nan[l]) return NAN;
        if (mv[l] > m) m = mv[l];
    }
    for (; i < n; i++) {
        const float v = load1(z, i, bf16);
        if (v != v) return NAN;
        if (v > m) m = v;
    }
    return m > -INFINITY && m < INFINITY ? m : NAN;
}

/* exp(x) (Cephes' polynomial). Below -87 it gives ~1e-38, not 0 (callers zero masked lanes
 * themselves); past float's range, +inf, as expf does. A NaN stays NaN. vexp on 16-lane
 * vectors, vexp_fv on fvecs. */
#define DEFINE_VEXP(NAME, F, I)                                                               \
static inline F NAME(F x) {                                                                   \
    const F lo = (F){0} - 87.0f, hi = (F){0} + 88.0f;                                         \
    const I below = (I)(x < lo), above = (I)(x > hi);                                         \
    const I overflow = (I)(x > 88.72283935546875f);  /* log(FLT_MAX) */                      \
    x = (F)(((I)x & ~below) | ((I)lo & below));                                               \
    x = (F)(((I)x & ~above) | ((I)hi & above));                                               \
    const float magic = 12582912.0f;  /* 1.5 * 2^23: adding it rounds to an integer */       \
    F t = x * 1.44269504088896341f + magic;                                                   \
    F n = t - magic;                                                                          \
    I ni = (I)t - (I)((F){0} + magic);                                                        \
    F r = x - n * 0.693359375f + n * 2.12194440e-4f;                                          \
    F p = (F){0} + 1.9875691500e-4f;                                                          \
    p = p * r + 1.3981999507e-3f;                                                             \
    p = p * r + 8.3334519073e-3f;                                                             \
    p = p * r + 4.1665795894e-2f;                                                             \
    p = p * r + 1.6666665459e-1f;                                                             \
    p = p * r + 5.0000001201e-1f;                                                             \
    p = p * r * r + r + 1.0f;                                                                 \
    const F e = p * (F)((ni + 127) << 23);                                                    \
    return (F)(((I)e & ~overflow) | ((I)((F){0} + INFINITY) & overflow));                     \
}
DEFINE_VEXP(vexp, f32x16, i32x16)
DEFINE_VEXP(vexp_fv, fvec, ivec)
#undef DEFINE_VEXP

#endif
