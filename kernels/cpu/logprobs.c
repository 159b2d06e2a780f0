/* Log-probabilities from float32 or bfloat16 logits for CPUs: for each row, the top k
 * entries of its log-softmax (ids and values, largest first, ties by index) and the value
 * and rank of one given token (the sampled one), without writing the log-softmax of the
 * whole vocabulary. kernels/cpu/build.py compiles it on first use; kernels/cpu/logprobs.py
 * checks the arguments and calls it through ctypes.
 *
 * A row takes three passes over its logits z, one row per work item: the maximum m; the
 * sum s of exp(z - m); then every log-probability (z - m) - log s, in torch's order of
 * operations, counted against the given token's (its rank is 1 + the number above it)
 * and offered to the top k, a sorted list that a value enters only when it beats the
 * list's last (so a tie with it stays out, and among equal values the lower index comes
 * first). torch's way writes the whole [rows, vocab] log-softmax and then reads it three
 * more times (top k, gather, rank).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"

#define MAX_K 64  /* larger k is left to torch */

int logprobs_max_k(void) { return MAX_K; }

/* value v of token j into the descending list (vals, ids) of c <= k entries */
static inline void offer(float v, int64_t j, float *vals, int64_t *ids, int64_t *c, int64_t k) {
    int64_t p = *c < k ? *c : k - 1;  /* where v goes if it beats nothing */
    while (p > 0 && vals[p - 1] < v) p--;
    const int64_t last = *c < k ? *c : k - 1;
    for (int64_t q = last; q > p; q--) { vals[q] = vals[q - 1]; ids[q] = ids[q - 1]; }
    vals[p] = v;
    ids[p] = j;
    if (*c < k) (*c)++;
}

/* One row; returns 1 (writing nothing) for a row without a finite maximum (a NaN, +inf, or
 * every logit -inf), which the caller leaves to torch. Inlined with a constant bf16. */
static inline __attribute__((always_inline)) int logprobs_row(
        const void *z, int64_t n, int bf16, int64_t k, int64_t token, int64_t *ids,
        float *vals, int64_t *rank) {
    const float m = finite_row_max(z, n, bf16);
    if (m != m) return 1;
    int64_t i;

    f32x16 sv = (f32x16){0};
    for (i = 0; i + 16 <= n; i += 16) sv += vexp(load16(z, i, bf16) - m);
    float s = hsum(sv);
    for (; i < n; i++) s += expf(load1(z, i, bf16) - m);
    const float log_s = logf(s);

    const float chosen = (load1(z, token, bf16) - m) - log_s;
    i32x16 above = {0};
    int64_t c = 0, count = 0;
    float floor_v = -INFINITY;  /* the list's last value once it holds k */
    for (i = 0; i + 16 <= n; i += 16) {
        const f32x16 lp = (load16(z, i, bf16) - m) - log_s;
        above -= (i32x16)(lp > chosen);  /* true lanes are -1 */
        if (k == 0) continue;
        const i32x16 in = c < k ? (i32x16)(lp == lp) : (i32x16)(lp > floor_v);
        int any = 0;
        for (int l = 0; l < 16; l++) any |= in[l];
        if (!any) continue;
        for (int l = 0; l < 16; l++)
            if (c < k || lp[l] > floor_v) {
                offer(lp[l], i + l, vals, ids, &c, k);
                if (c == k) floor_v = vals[k - 1];
            }
    }
    for (; i < n; i++) {
        const float lp = (load1(z, i, bf16) - m) - log_s;
        count += lp > chosen;
        if (k && (c < k || lp > floor_v)) {
            offer(lp, i, vals, ids, &c, k);
            if (c == k) floor_v = vals[k - 1];
        }
    }
    for (int l = 0; l < 16; l++) count += above[l];
    vals[k] = chosen;
    *rank = count + 1;
    return 0;
}

/* Entry points, one per element type. z [rows, n] with rows row_stride elements apart;
 * token [rows] (int64, each < n); k <= MAX_K and k <= n; out: ids [rows, k] (int64), vals
 * [rows, k + 1] (float32: the top k, then the token's), rank [rows] (int64), and bad
 * [rows] (int32: 1 where the row was left unwritten, see logprobs_row). */
#define ENTRY(NAME, T, BF16)                                                                  \
void NAME(const T *z, int64_t rows, int64_t n, int64_t row_stride, int64_t k,                  \
          const int64_t *token, int64_t *ids, float *vals, int64_t *rank, int32_t *bad) {      \
    _Pragma("omp parallel for schedule(dynamic, 1)")                                           \
    for (int64_t r = 0; r < rows; r++)                                                         \
        bad[r] = logprobs_row(z + r * row_stride, n, BF16, k, token[r], ids + r * k,           \
                              vals + r * (k + 1), rank + r);                                   \
}
ENTRY(logprobs_f32, float, 0)
ENTRY(logprobs_bf16, uint16_t, 1)
