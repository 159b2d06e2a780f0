/* Random sampling from float32 or bfloat16 logits for CPUs: temperature, min_p, top_k and
 * top_p, one row per work item, without sorting the vocabulary and with one random stream
 * per row. kernels/cpu/build.py compiles it on first use; kernels/cpu/sample.py checks the
 * arguments and calls it through ctypes.
 *
 * A row's weights w = exp((z - max z) / T) are computed once into per-thread scratch (so
 * the largest is 1). min_p keeps w >= min_p; top_k keeps w >= the k-th largest w (ties at
 * the boundary kept, as transformers' and vLLM's top_k do), found by binning the weights by
 * value and selecting within one bin; the mass left is M. top_p orders the tokens by
 * weight, ties by index (as a stable descending sort would), and keeps each token whose
 * predecessors hold less than top_p * M. It is applied by rejection rather than by
 * sorting: draw j with probability w_j / M among the kept tokens and measure j's
 * predecessors; if they hold too much, j and every token after it are out, so the draw is
 * repeated among j's predecessors alone (whose mass that same pass measured). Conditioned
 * on the set it ends in, every draw is proportional to w, so the result has exactly the
 * distribution of sampling from the top-p set; a likely token is accepted at once, so a row
 * takes about one or two passes beyond the exp pass.
 *
 * Each row's uniforms come from splitmix64 seeded by the caller (one 64-bit seed per row
 * and step, drawn from the row's torch generator), so a row's result does not depend on
 * the rest of the batch.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

static inline uint64_t splitmix64(uint64_t *state) {
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* a uniform double in [0, 1) with 53 random bits */
static inline double uniform(uint64_t *state) {
    return (double)(splitmix64(state) >> 11) * 0x1.0p-53;
}

/* the k-th largest (k >= 1) of a[0..n), reordering a: quickselect, median-of-three pivot */
static float kth_largest(float *a, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1, want = k - 1;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        float x = a[lo], y = a[mid], z = a[hi];
        const float pivot = x > y ? (y > z ? y : (x > z ? z : x)) : (x > z ? x : (y > z ? z : y));
        int64_t i = lo, j = hi;
        while (i <= j) {  /* descending: [lo, j] >= pivot >= [i, hi] */
            while (a[i] > pivot) i++;
            while (a[j] < pivot) j--;
            if (i <= j) {
                const float t = a[i]; a[i] = a[j]; a[j] = t;
                i++; j--;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return a[want];
    }
    return a[want];
}

/* The k-th largest of the weights w >= floor_w, w > 0 (0 when fewer than k are): their
 * float bits' top 13 (exponent and 4 mantissa bits; w <= 1) bin them by value, the bin
 * holding the k-th is found from the counts, and only that bin's weights are selected
 * from (all of them would take a quickselect over the whole vocabulary). */
#define TOP_K_BINS 2048
static float top_k_floor(const float *w, int64_t n, float floor_w, int64_t k, float *tmp) {
    int64_t hist[TOP_K_BINS] = {0}, count = 0;
    for (int64_t j = 0; j < n; j++) {
        if (!(w[j] >= floor_w && w[j] > 0.f)) continue;
        uint32_t bits;
        memcpy(&bits, &w[j], sizeof bits);
        hist[bits >> 19]++;  /* <= 0x3f800000 >> 19 = 2032 */
        count++;
    }
    if (count <= k) return 0.f;
    int64_t above = 0, bin = TOP_K_BINS - 1;
    while (above + hist[bin] < k) above += hist[bin--];
    int64_t m = 0;
    for (int64_t j = 0; j < n; j++) {
        if (!(w[j] >= floor_w && w[j] > 0.f)) continue;
        uint32_t bits;
        memcpy(&bits, &w[j], sizeof bits);
        if ((int64_t)(bits >> 19) == bin) tmp[m++] = w[j];
    }
    return kth_largest(tmp, m, k - above);
}

/* One row: the sampled token, or -1 for a greedy row (temperature <= 0) or one with no
 * finite maximum (all -inf, a NaN, or +inf): the caller takes its greedy token. Inlined with
 * a constant bf16. */
/* token i of weight wi comes before token r of weight wr in top_p's order */
static inline int before(float wi, int64_t i, float wr, int64_t r) {
    return wi > wr || (wi == wr && i < r);
}

static inline __attribute__((always_inline)) int64_t sample_row(
        const void *z, int64_t n, int bf16, float temperature, int64_t top_k, float top_p,
        float min_p, uint64_t seed, float *w, float *tmp) {
    if (!(temperature > 0.f)) return -1;
    const float m = finite_row_max(z, n, bf16);
    if (m != m) return -1;
    int64_t i;
    /* weights; exp of anything below -87 is taken as 0 (vexp gives ~1e-38 there), so a
     * masked (-inf) logit can never be drawn */
    const float inv_t = 1.0f / temperature;
    const f32x16 lo = (f32x16){0} - 87.0f;
    for (i = 0; i + 16 <= n; i += 16) {
        const f32x16 x = (load16(z, i, bf16) - m) * inv_t;
        store_f32(w + i, (f32x16)((i32x16)vexp(x) & (i32x16)(x >= lo)));
    }
    if (i < n) {  /* the last n % 16 through vexp too, so equal logits get equal weights */
        f32x16 x = (f32x16){0} - INFINITY;
        for (int64_t l = 0; l < n - i; l++) x[l] = (load1(z, i + l, bf16) - m) * inv_t;
        const f32x16 e = (f32x16)((i32x16)vexp(x) & (i32x16)(x >= lo));
        for (int64_t l = 0; l < n - i; l++) w[i + l] = e[l];
    }

    float floor_w = min_p > 0.f ? min_p : 0.f;  /* kept: w >= floor_w (and w > 0) */
    if (top_k > 0 && top_k < n) {
        const float kth = top_k_floor(w, n, floor_w, top_k, tmp);
        if (kth > floor_w) floor_w = kth;
    }
    double mass = 0.0;
    for (int64_t j = 0; j < n; j++)
        if (w[j] >= floor_w) mass += w[j];
    const double keep = top_p < 1.f ? (double)top_p * mass : INFINITY;
    uint64_t state = seed;
    /* candidates: w >= floor_w, and before (end_w, end_i) in top_p's order (at first,
     * every w > 0) */
    float end_w = 0.f;
    int64_t end_i = -1;
    for (;;) {
        /* draw j with probability w_j / mass among the candidates */
        const double target = uniform(&state) * mass;
        double acc = 0.0;
        int64_t pick = -1, last = -1;
        for (int64_t j = 0; j < n; j++) {
            if (w[j] < floor_w || !before(w[j], j, end_w, end_i)) continue;
            last = j;
            acc += w[j];
            if (acc > target) { pick = j; break; }
        }
        if (pick < 0) pick = last;  /* rounding left the target past the sum */
        if (pick < 0) return -1;
        if (keep == INFINITY) return pick;
        /* the mass of pick's predecessors */
        const float wp = w[pick];
        double ahead = 0.0;
        for (int64_t j = 0; j < n; j++)
            if (w[j] >= floor_w && before(w[j], j, wp, pick)) ahead += w[j];
        if (ahead < keep) return pick;
        end_w = wp;  /* pick is outside the top-p set, and so is every token after it */
        end_i = pick;
        mass = ahead;
    }
}

/* out[r] for each row r of logits [rows, n] (rows `stride` elements apart); per-row
 * temperature (<= 0: greedy), top_k (<= 0: off), top_p (>= 1: off), min_p (<= 0: off) and
 * seed.
 * Returns nonzero when scratch memory cannot be had (nothing written then). One entry
 * point per element type, each with its own parallel loop. */
#define ENTRY(NAME, T, BF16)                                                                  \
int NAME(const T *logits, int64_t rows, int64_t n, int64_t stride, const float *temperature, \
         const int64_t *top_k, const float *top_p, const float *min_p, const uint64_t *seeds,  \
         int64_t *out) {                                                                      \
    int failed = 0;                                                                           \
    _Pragma("omp parallel")                                                                   \
    {                                                                                         \
        float *w = malloc(2 * (size_t)n * sizeof(float));                                     \
        if (!w) {                                                                             \
            _Pragma("omp atomic write")                                                       \
            failed = 1;                                                                       \
        }                                                                                     \
        _Pragma("omp barrier")                                                                \
        if (!failed) {                                                                        \
            _Pragma("omp for schedule(dynamic, 1)")                                           \
            for (int64_t r = 0; r < rows; r++)                                                \
                out[r] = sample_row(logits + r * stride, n, BF16, temperature[r], top_k[r],   \
                                    top_p[r], min_p[r], seeds[r], w, w + n);                  \
        }                                                                                     \
        free(w);                                                                              \
    }                                                                                         \
    return failed;                                                                            \
}
ENTRY(sample_f32, float, 0)
ENTRY(sample_bf16, uint16_t, 1)
