/* Residual add + RMSNorm over bf16 activations in one pass, rounded where HF's Llama rounds.
 *
 * Why by hand: in PyTorch a bf16 RMSNorm with its residual add is ~8 elementwise ops (upcast,
 * square, mean, rsqrt, scale, downcast, weight, add), each a pass over the activations and a
 * dispatch; for a 2048-token chunk of a 135M model they cost ~1/8 of the step. HF computes
 * residual = bf16(x + delta); n = bf16(residual * rsqrt(mean(residual^2) + eps)); out = bf16(n * w),
 * with fp32 arithmetic inside each step, and so does this kernel, row by row.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec8.h"

/* x, delta (or NULL), weight: bf16; writes residual = x + delta (skipped when delta is NULL:
 * the residual is x itself) and out = RMSNorm(residual) * weight. Rows split across the calling team
 * (team.h). */
void kvbaton_add_rms_norm_bf16_team(const uint16_t *x, const uint16_t *delta, uint16_t *residual, uint16_t *out,
                                    const uint16_t *weight, int64_t rows, int64_t dim, float eps) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * dim;
        uint16_t *res = residual + r * dim, *o = out + r * dim;
        float sum = 0.0f;
        if (delta) {
            const uint16_t *dr = delta + r * dim;
            for (int64_t i = 0; i < dim; i++) {
                const float v = round_bf16(bf16_to_f32(xr[i]) + bf16_to_f32(dr[i]));
                res[i] = f32_to_bf16(v);
                sum += v * v;
            }
        } else {
            for (int64_t i = 0; i < dim; i++) {
                const float v = bf16_to_f32(xr[i]);
                sum += v * v;
            }
        }
        const uint16_t *src = delta ? res : xr;
        const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++)
            o[i] = f32_to_bf16(round_bf16(bf16_to_f32(src[i]) * inv) * bf16_to_f32(weight[i]));
    }
}

void kvbaton_add_rms_norm_bf16(const uint16_t *x, const uint16_t *delta, uint16_t *residual, uint16_t *out,
                               const uint16_t *weight, int64_t rows, int64_t dim, float eps, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (rows > 16)
    kvbaton_add_rms_norm_bf16_team(x, delta, residual, out, weight, rows, dim, eps);
}

/* Per-head RMSNorm in place (Qwen3's q/k norms): heads [0, heads) of every row, each `dim` values long and the
 * row `row_stride` elements after the last, normalized with one [dim] weight, rounded as above. The Python loop
 * and the C layer loop both call it on a step's qkv rows, so their q and k heads carry the same bits. (Team form,
 * team.h: the (row, head) vectors split across the calling team.) */
void kvbaton_rms_norm_heads_bf16_team(uint16_t *x, int64_t row_stride, int64_t rows, int64_t heads, int64_t dim,
                                      const uint16_t *weight, float eps) {
#pragma omp for schedule(static)
    for (int64_t v = 0; v < rows * heads; v++) {
        uint16_t *xv = x + v / heads * row_stride + v % heads * dim;
        float sum = 0.0f;
        for (int64_t i = 0; i < dim; i++) {
            const float f = bf16_to_f32(xv[i]);
            sum += f * f;
        }
        const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++)  /* each value read before it is written: in place is safe */
            xv[i] = f32_to_bf16(round_bf16(bf16_to_f32(xv[i]) * inv) * bf16_to_f32(weight[i]));
    }
}

void kvbaton_rms_norm_heads_bf16(uint16_t *x, int64_t row_stride, int64_t rows, int64_t heads, int64_t dim,
                                 const uint16_t *weight, float eps, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (rows * heads > 64)
    kvbaton_rms_norm_heads_bf16_team(x, row_stride, rows, heads, dim, weight, eps);
}
