/* y = x W^T (+ b) for many rows of x against pre-packed weights: prefill and batched decode.
 *
 * Why by hand: on CPUs without native bf16 arithmetic PyTorch runs these layers in fp32 through
 * MKL's sgemm, which on a 2-core AVX2 EPYC reached 40-90 GFLOP/s on the 64-row shapes of a
 * decode batch (~45 on the lm_head) and ~100-120 on prefill chunks, of a ~170 GFLOP/s FMA peak;
 * MKL's own pre-packed API barely changed that. Here the weights are packed once, at load time,
 * into 16-column panels [ceil(N/16)][K][16] (bf16 or fp32), and a 6x16 register tile (the BLIS
 * shape for 16 AVX2 registers: 12 accumulators, 2 weight vectors, 1 broadcast) runs over the
 * whole K: 110-165 GFLOP/s on the same shapes.
 *
 * Rows are processed in blocks small enough for one core's L2, so x is read from L2 by every
 * panel; threads split the panels of a row block. bf16 weights are widened in registers, so the
 * packed copy costs the same memory as the original weights. The output is fp32, or bf16
 * rounded to nearest-even (what `tensor.to(torch.bfloat16)` does).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "team.h"
#include "vec8.h"

#define NR 16            /* columns per panel */
#define MR 6             /* rows per register tile */
#define L2_X_BYTES 786432 /* rows of x per block: this many bytes (about 3/4 of a 1 MiB L2) */

typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef int16_t i16x16 __attribute__((vector_size(32)));

/* Columns 0-7 and 8-15 of one packed row. bf16 rows are stored in the order
 * [c0-3, c8-11, c4-7, c12-15] so that interleaving one 32-byte load with zeros (x86's
 * punpcklwd / punpckhwd, which work within 128-bit halves) yields both fp32 vectors in column
 * order: one load and two shuffles instead of two widening loads and two shifts. */
static inline void load_weights(const void *p, int64_t index, const int bf16, f32x8 *lo, f32x8 *hi) {
    if (bf16) {
        u16x16 v;
        memcpy(&v, (const uint16_t *)p + index, sizeof v);
        const u16x16 zero = {0};
        const u16x16 a = __builtin_shuffle(zero, v, (i16x16){0, 16, 0, 17, 0, 18, 0, 19, 0, 24, 0, 25, 0, 26, 0, 27});
        const u16x16 b = __builtin_shuffle(zero, v, (i16x16){0, 20, 0, 21, 0, 22, 0, 23, 0, 28, 0, 29, 0, 30, 0, 31});
        memcpy(lo, &a, sizeof a);
        memcpy(hi, &b, sizeof b);
    } else {
        *lo = load8((const float *)p + index);
        *hi = load8((const float *)p + index + 8);
    }
}

enum { OUT_F32, OUT_BF16, OUT_SILU_MUL };

static inline void store_row(f32x8 lo, f32x8 hi, const float *bias, void *y, int64_t index, int cols,
                             const int mode) {
    if (bias) lo += load8(bias), hi += load8(bias + 8);
    float vals[NR];
    memcpy(vals, &lo, sizeof lo);
    memcpy(vals + 8, &hi, sizeof hi);
    if (mode == OUT_SILU_MUL) {
        /* lo: 8 gate columns, hi: the matching up columns -> silu(gate) * up, rounded to bf16 after
         * each op as PyTorch's bf16 silu and mul do. */
        uint16_t *out = (uint16_t *)y + index;
        float act[8];
#pragma omp simd
        for (int c = 0; c < 8; c++) {
            const float g = round_bf16(vals[c]);
            act[c] = round_bf16(g / (1.0f + expf(-g))) * round_bf16(vals[8 + c]);
        }
        for (int c = 0; c < 8; c++) out[c] = f32_to_bf16(act[c]);
    } else if (mode == OUT_BF16) {
        uint16_t *out = (uint16_t *)y + index;
        for (int c = 0; c < cols; c++) out[c] = f32_to_bf16(vals[c]);
    } else {
        memcpy((float *)y + index, vals, sizeof(float) * (size_t)cols);
    }
}

/* rows x 16 outputs over the whole K; `rows`, `bf16` and `mode` are constants after inlining. */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t k, const void *panel, const int rows,
                                                        const int bf16, const float *bias, void *y, int64_t ldy,
                                                        int cols, const int mode) {
    f32x8 acc[MR][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = (f32x8){0};
    for (int64_t kk = 0; kk < k; kk++) {
        f32x8 w0, w1;
        load_weights(panel, kk * NR, bf16, &w0, &w1);
        for (int r = 0; r < rows; r++) {
            const float xv = x[r * k + kk];
            acc[r][0] += w0 * xv;
            acc[r][1] += w1 * xv;
        }
    }
    for (int r = 0; r < rows; r++) store_row(acc[r][0], acc[r][1], bias, y, r * ldy, cols, mode);
}

/* NOTE: every (rows, weight dtype, output mode) combination is its own fully unrolled instance. */
#define TILE_CASE(R, BF16, MODE) \
    case R: \
        tile(x, k, panel, R, BF16, bias, y, ldy, cols, MODE); \
        return;
#define TILE_ROWS(BF16, MODE) \
    switch (rows) { TILE_CASE(1, BF16, MODE) TILE_CASE(2, BF16, MODE) TILE_CASE(3, BF16, MODE) \
                    TILE_CASE(4, BF16, MODE) TILE_CASE(5, BF16, MODE) TILE_CASE(6, BF16, MODE) }

static void tile_any(const float *x, int64_t k, const void *panel, int rows, const float *bias, void *y,
                     int64_t ldy, int cols, int bf16, int mode) {
    if (bf16) {
        if (mode == OUT_F32) TILE_ROWS(1, OUT_F32)
        else if (mode == OUT_BF16) TILE_ROWS(1, OUT_BF16)
        else TILE_ROWS(1, OUT_SILU_MUL)
    } else {
        if (mode == OUT_F32) TILE_ROWS(0, OUT_F32)
        else if (mode == OUT_BF16) TILE_ROWS(0, OUT_BF16)
        else TILE_ROWS(0, OUT_SILU_MUL)
    }
}

/* x: [M, K] fp32 (contiguous); packed: [ceil(N/16), K, 16] with `weight_bytes` 2 (bf16) or 4;
 * bias: [ceil(N/16) * 16] fp32 (zero-padded) or NULL. mode OUT_F32 / OUT_BF16: y = [M, N] fp32 / bf16;
 * OUT_SILU_MUL: each panel holds 8 gate columns then their 8 up columns (N a multiple of 16) and
 * y = silu(gate) * up, [M, N / 2] bf16. Returns 0, or -1 for arguments it does not handle. */
/* On the calling team (team.h). */
int kvbaton_gemm_packed_team(const float *x, const void *packed, int weight_bytes, const float *bias, void *y,
                             int mode, int64_t m, int64_t n, int64_t k) {
    if (m < 1 || n < 1 || k < 1 || (weight_bytes != 2 && weight_bytes != 4) || mode < OUT_F32 || mode > OUT_SILU_MUL
        || (mode == OUT_SILU_MUL && n % NR))
        return -1;
    const int bf16 = weight_bytes == 2;
    const int64_t panels = (n + NR - 1) / NR;
    int64_t block_rows = L2_X_BYTES / (k * (int64_t)sizeof(float)) / MR * MR;
    if (block_rows < MR) block_rows = MR;
    const size_t out_bytes = mode == OUT_F32 ? 4 : 2;
    /* a panel's outputs start at column p * 16 of y (p * 8 when each panel yields 8 gated values) */
    const int64_t ldy = mode == OUT_SILU_MUL ? n / 2 : n, panel_cols = mode == OUT_SILU_MUL ? NR / 2 : NR;
    for (int64_t m0 = 0; m0 < m; m0 += block_rows) {
        const int64_t m1 = m0 + block_rows < m ? m0 + block_rows : m;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const char *panel = (const char *)packed + (size_t)p * k * NR * weight_bytes;
            const int cols = n - p * NR < NR ? (int)(n - p * NR) : NR;
            const float *b = bias ? bias + p * NR : NULL;
            for (int64_t r = m0; r < m1; r += MR) {
                const int rows = m1 - r < MR ? (int)(m1 - r) : MR;
                tile_any(x + r * k, k, panel, rows, b, (char *)y + ((size_t)r * ldy + p * panel_cols) * out_bytes, ldy,
                         cols, bf16, mode);
            }
        }
    }
    return 0;
}

int kvbaton_gemm_packed(const float *x, const void *packed, int weight_bytes, const float *bias, void *y,
                        int mode, int64_t m, int64_t n, int64_t k, int num_threads) {
    return ON_TEAM(num_threads, kvbaton_gemm_packed_team(x, packed, weight_bytes, bias, y, mode, m, n, k));
}
