/* SwiGLU's activation over bf16: out = bf16(bf16(silu(gate)) * up), rounded where PyTorch's
 * `F.silu(gate) * up` rounds.
 *
 * Why by hand: one implementation for both callers of a decode step, the Python layer loop (through
 * kvbaton.kernels.activation) and the C one (decode_layers.c), so the two give the same bits and a
 * token's output never depends on which of them ran its step (deterministic serving).
 * Row by row, so an element's arithmetic (vector body or scalar tail) depends on its column only,
 * never on the number of rows.
 */
#include <math.h>
#include <stdint.h>

#include "vec8.h"

/* gate_up: [rows, 2 * inter] bf16 (each row: the gate half, then the up half); out: [rows, inter] bf16.
 * Rows split across the calling team (team.h). */
void kvbaton_silu_mul_bf16_team(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = gate_up + r * 2 * inter, *up = gate + inter;
        uint16_t *o = out + r * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) {
            const float g = bf16_to_f32(gate[i]);
            const float act = round_bf16(g / (1.0f + expf(-g)));
            o[i] = f32_to_bf16(act * bf16_to_f32(up[i]));
        }
    }
}

void kvbaton_silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (rows * inter > 65536)
    kvbaton_silu_mul_bf16_team(gate_up, out, rows, inter);
}
