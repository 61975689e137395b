/* Rotary position embedding (rotate-half layout) on bf16 rows in place: the one implementation both layer
 * loops use (Python's through kvbaton.kernels.rope, decode_layers.c directly), so a token's bits never depend
 * on which ran its step.
 *
 * Why by hand: PyTorch's form, `x.mul_(cos).addcmul_(swap_halves(x), signed_sin)`, is three passes over
 * the q and k heads with a copy for the swap: ~5 ms of a 512-token prefill of SmolLM2 (30 layers, 2 cores),
 * where this is one pass.
 *
 * For i < D/2: x[i] <- x[i] cos[i] + x[i + D/2] sin[i], and x[i + D/2] <- x[i + D/2] cos[i + D/2] +
 * x[i] sin[i + D/2], sin signed ([-sin, sin]). Rounded as PyTorch rounds its bf16 form: the product to
 * bf16, then the sum in fp32 (the bf16 x bf16 product is exact there, fused or not) to bf16. */
#include <stdint.h>

#include "vec8.h"

#define MAX_HEAD_DIM 256

/* x: `rows` rows `row_stride` elements apart, whose first `heads` heads of `head_dim` are rotated; cos, sin:
 * bf16 tables of head_dim per entry, row r taking entry positions[r] (positions NULL: entry r).
 * On the calling team (team.h). */
void kvbaton_rope_bf16_team(uint16_t *x, int64_t row_stride, const uint16_t *cos, const uint16_t *sin,
                            const int64_t *positions, int64_t rows, int64_t heads, int64_t head_dim) {
    const int64_t d = head_dim, half = d / 2;
    if (d > MAX_HEAD_DIM || d % 2) return;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t entry = positions ? positions[r] : r;
        const uint16_t *c = cos + entry * d, *s = sin + entry * d;
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *v = x + r * row_stride + h * d;
            float orig[MAX_HEAD_DIM];
#pragma omp simd
            for (int64_t i = 0; i < d; i++) orig[i] = bf16_to_f32(v[i]);
#pragma omp simd
            for (int64_t i = 0; i < d; i++) {
                const float swapped = orig[i < half ? i + half : i - half];
                const float scaled = round_bf16(orig[i] * bf16_to_f32(c[i]));
                v[i] = f32_to_bf16(scaled + swapped * bf16_to_f32(s[i]));
            }
        }
    }
}

void kvbaton_rope_bf16(uint16_t *x, int64_t row_stride, const uint16_t *cos, const uint16_t *sin,
                       const int64_t *positions, int64_t rows, int64_t heads, int64_t head_dim, int num_threads) {
    /* a decode step's few rows: not worth waking the threads */
#pragma omp parallel num_threads(num_threads) if (rows * heads >= 256)
    kvbaton_rope_bf16_team(x, row_stride, cos, sin, positions, rows, heads, head_dim);
}
