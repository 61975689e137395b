/* y = x W^T (+ b) for a few rows of x against bf16 weights: the decode-time linear layer.
 *
 * Why by hand: with one to a few rows a linear layer is a pass over the weights, so its speed is
 * the memory bandwidth; on CPUs without native bf16 arithmetic PyTorch's bf16 GEMM reaches well
 * under it (and falls further with every extra row). Here each weight row is read once, front to
 * back (one stream the prefetcher follows), widened to fp32 in registers and used for every row
 * of x; independent accumulators keep the FMA pipeline full.
 *
 * x: [M, K] fp32, w: [N, K] bf16, bias: [N] fp32 or NULL, y: [M, N] fp32; K a multiple of 8,
 * 1 <= M <= MAX_ROWS. Threads split N.
 */
#include <stdint.h>

#include "team.h"
#include "vec8.h"

#define MAX_ROWS 8

/* One row of x: four accumulators over consecutive chunks of K. */
static inline float dot_one(const float *x, const uint16_t *w, int64_t k) {
    f32x8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    int64_t i = 0;
    for (; i + 32 <= k; i += 32) {
        a0 += load8(x + i) * load_bf16x8(w + i);
        a1 += load8(x + i + 8) * load_bf16x8(w + i + 8);
        a2 += load8(x + i + 16) * load_bf16x8(w + i + 16);
        a3 += load8(x + i + 24) * load_bf16x8(w + i + 24);
    }
    for (; i < k; i += 8) a0 += load8(x + i) * load_bf16x8(w + i);
    return hsum8((a0 + a1) + (a2 + a3));
}

/* M rows of x (M a compile-time constant after inlining): one accumulator per row. */
static inline void dot_rows(const float *x, const uint16_t *w, int64_t k, const int m, float *out, int64_t out_stride) {
    f32x8 acc[MAX_ROWS];
    for (int r = 0; r < m; r++) acc[r] = (f32x8){0};
    for (int64_t i = 0; i < k; i += 8) {
        const f32x8 wv = load_bf16x8(w + i);
        for (int r = 0; r < m; r++) acc[r] += load8(x + r * k + i) * wv;
    }
    for (int r = 0; r < m; r++) out[r * out_stride] = hsum8(acc[r]);
}

#define ROWS_CASE(M) \
    case M: \
        dot_rows(x, w + j * k, k, M, y + j, n); \
        break;

/* On the calling team (team.h). */
int kvbaton_linear_bf16_team(const float *x, const uint16_t *w, const float *bias, float *y, int64_t m, int64_t n,
                             int64_t k) {
    if (m < 1 || m > MAX_ROWS || k % 8) return -1;
#pragma omp for schedule(static)
    for (int64_t j = 0; j < n; j++) {
        switch (m) {
        case 1:
            y[j] = dot_one(x, w + j * k, k);
            break;
            ROWS_CASE(2)
            ROWS_CASE(3)
            ROWS_CASE(4)
            ROWS_CASE(5)
            ROWS_CASE(6)
            ROWS_CASE(7)
            ROWS_CASE(8)
        }
        if (bias)
            for (int64_t r = 0; r < m; r++) y[r * n + j] += bias[j];
    }
    return 0;
}

int kvbaton_linear_bf16(const float *x, const uint16_t *w, const float *bias, float *y, int64_t m, int64_t n,
                        int64_t k, int num_threads) {
    return ON_TEAM(num_threads, kvbaton_linear_bf16_team(x, w, bias, y, m, n, k));
}
