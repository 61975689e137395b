/* y = x W^T (+ b) as one dot product per output, in an order that depends on nothing but K.
 *
 * Why by hand: two jobs with one design.
 * - Decode on CPUs with AVX512-BF16: with one to a few rows a linear layer is a pass over the
 *   weights, and oneDNN's bf16 GEMM reached 10-16 GB/s of a 20 GB/s read bandwidth on this model's
 *   decode shapes (2-core Xeon with AMX), and ~2.5x the weights' read time at 32 rows (a decode
 *   batch). Here `vdpbf16ps` multiplies bf16 pairs straight from the weight rows (no widening); up to
 *   4 rows read each thread's weights as a few address-ordered streams, more rows go through a
 *   register tile of 4 columns x 4 rows that reuses every weight load, with the weights ahead
 *   prefetched.
 * - Batch-invariant (deterministic) serving: every output y[r][j] is accumulated the same way
 *   whatever the number of rows, the row's place in the batch or the thread count: one vector
 *   accumulator over K front to back, then one fixed horizontal sum. Threads split columns and
 *   rows, never K. So a token's logits do not change with what it is batched with.
 *
 * Two instruction sets, chosen by the caller (kvbaton.platform): ISA_GENERIC (eight-float vectors,
 * any x86-64 with -march=native; x fp32, w bf16 or fp32) and ISA_AVX512_BF16 (x and w bf16; compiled
 * for that target only inside its functions, so the library still builds and loads on AVX2 CPUs).
 *
 * Compiled without -ffast-math (build.py): reassociation could reorder a sum differently where the
 * compiler inlines it for one row or for four, which is the one thing this kernel promises not to do.
 *
 * x: [M, K]; w: [N, K]; bias: [N] fp32 or NULL; y: [M, N] fp32 (OUT_F32) or bf16 rounded to nearest
 * even (OUT_BF16). Returns 0, or -1 for what it does not handle (generic: K % 8 != 0).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "team.h"
#include "vec8.h"

enum { ISA_GENERIC = 0, ISA_AVX512_BF16 = 1 };
enum { OUT_F32 = 0, OUT_BF16 = 1 };

#define ROWS 4                /* rows of x per register tile (AVX512; the generic tile takes 2) */
#define COLS 4                /* weight rows (output columns) per register tile */
#define PREFETCH_GROUPS 2     /* tiles of COLS weight rows ahead that a tile asks memory for */
#define PANEL_BYTES 262144    /* weights per column panel: a quarter of a 1 MiB L2, reread by every row block */
#define ROW_CHUNK 64          /* rows of x per work item (many rows: threads split rows too) */

static inline void store(void *y, int64_t index, float v, const float *bias, int64_t j, int out_mode) {
    if (bias) v += bias[j];
    if (out_mode == OUT_BF16)
        ((uint16_t *)y)[index] = f32_to_bf16(v);
    else
        ((float *)y)[index] = v;
}

/* Every output below is one accumulator over K in chunks taken front to back, then one fixed
 * horizontal sum: the same arithmetic whichever tile shape computes it. A single chain per output
 * is enough: a tile has COLS x rows independent chains, and the weights, not the arithmetic, are
 * the limit. The weights of a tile's COLS columns are loaded once per chunk and used by every row;
 * the COLS weight rows PREFETCH_GROUPS tiles ahead are requested as this tile walks its own (they
 * are contiguous, so that walk is in address order: the hardware prefetcher alone reached ~60% of a
 * plain read's bandwidth on decode shapes). */

/* ---- generic: fp32 x, bf16 or fp32 w, eight-float vectors ------------------------------------ */

#define GENERIC_ROWS 2  /* 2 x COLS accumulators + COLS weights + x: within 16 AVX2 registers */

static inline f32x8 load_w8(const void *w, int64_t index, const int w_bf16) {
    return w_bf16 ? load_bf16x8((const uint16_t *)w + index) : load8((const float *)w + index);
}

static inline __attribute__((always_inline)) void tile_generic(const float *x, const void *w, int64_t j, int64_t k,
                                                               const int w_bf16, const int rows, const int cols,
                                                               float out[GENERIC_ROWS][COLS]) {
    f32x8 acc[GENERIC_ROWS][COLS] = {{{0}}};
    const int elem = w_bf16 ? 2 : 4;
    const char *ahead = (const char *)w + (j + PREFETCH_GROUPS * COLS) * k * elem;
    for (int64_t i = 0; i < k; i += 8) {
        if (cols == COLS && i % 16 == 0)
            for (int line = 0; line < elem; line++) __builtin_prefetch(ahead + i * COLS * elem + line * 64);
        f32x8 wv[COLS];
        for (int c = 0; c < cols; c++) wv[c] = load_w8(w, (j + c) * k + i, w_bf16);
        for (int r = 0; r < rows; r++) {
            const f32x8 xv = load8(x + r * k + i);
            for (int c = 0; c < cols; c++) acc[r][c] += xv * wv[c];
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) out[r][c] = hsum8(acc[r][c]);
}

#define GENERIC_TILE(R, C) \
    tile_generic(x + r0 * k, w, j, k, w_bf16, R, C, v); \
    for (int r = 0; r < R; r++) \
        for (int c = 0; c < C; c++) store(y, (r0 + r) * n + j + c, v[r][c], bias, j + c, out_mode);

static void panel_generic(const float *x, const void *w, const float *bias, void *y, int64_t m, int64_t n,
                          int64_t k, int64_t j0, int64_t j1, const int w_bf16, int out_mode) {
    float v[GENERIC_ROWS][COLS];
    for (int64_t r0 = 0; r0 < m; r0 += GENERIC_ROWS) {
        const int two = m - r0 >= 2;
        int64_t j = j0;
        for (; j + COLS <= j1; j += COLS) {
            if (two) {
                GENERIC_TILE(2, COLS)
            } else {
                GENERIC_TILE(1, COLS)
            }
        }
        for (; j < j1; j++) {
            if (two) {
                GENERIC_TILE(2, 1)
            } else {
                GENERIC_TILE(1, 1)
            }
        }
    }
}

/* ---- AVX512-BF16: bf16 x and w, vdpbf16ps ------------------------------------------------------ */

#define AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))

AVX512_BF16 static inline __m512bh load_bh(const uint16_t *p, int64_t left) {
    if (left >= 32) return (__m512bh)_mm512_loadu_si512(p);
    return (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1u << left) - 1u), p);  /* zeros past K */
}

AVX512_BF16 static inline __attribute__((always_inline)) void tile_bf16(const uint16_t *x, const uint16_t *w,
                                                                        int64_t k, const int rows, const int cols,
                                                                        float out[ROWS][COLS]) {
    __m512 acc[ROWS][COLS];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) acc[r][c] = _mm512_setzero_ps();
    const char *ahead = (const char *)(w + PREFETCH_GROUPS * COLS * k);
    for (int64_t i = 0; i < k; i += 32) {
        if (cols == COLS)  /* COLS rows x 64 bytes per chunk */
            for (int line = 0; line < COLS; line++) _mm_prefetch(ahead + i * 2 * COLS + line * 64, _MM_HINT_T0);
        __m512bh wv[COLS];
        for (int c = 0; c < cols; c++) wv[c] = load_bh(w + c * k + i, k - i);
        for (int r = 0; r < rows; r++) {
            const __m512bh xv = load_bh(x + r * k + i, k - i);
            for (int c = 0; c < cols; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) out[r][c] = _mm512_reduce_add_ps(acc[r][c]);
}

/* Up to ROWS rows (decode): the linear is a read of the weights. Each thread takes one contiguous share of the
 * columns and reads it as STREAMS address-ordered streams, one per quarter of the share, each step taking one
 * column (a whole weight row, every 64-byte chunk used by every row of x) from every quarter: STREAMS
 * independent accumulator chains per row, over lines the hardware prefetcher follows on its own, as it does a
 * plain sum's. The register tile below walks 4 adjacent weight rows in step, which read at ~75% of one core's
 * plain-read bandwidth against 92-97% for this order (Zen 4, one thread, this model's decode linears; software
 * prefetch only slowed this order). Two cores behind one memory link hid the difference (the link is the limit);
 * two with a link each showed it: the layer loop's linears read at 57-65 GB/s with the tile and 72-79 with the
 * streams, where a plain 2-thread sum reads 78. Same arithmetic as the tile: one accumulator per output over K
 * front to back, one horizontal sum. */
#define STREAMS 4

AVX512_BF16 static inline __m512bh load_chunk(const uint16_t *p, int64_t left, const int whole) {
    return whole ? (__m512bh)_mm512_loadu_si512(p) : load_bh(p, left);  /* whole: K % 32 == 0, no tail */
}

AVX512_BF16 static inline __attribute__((always_inline)) void columns_bf16(const uint16_t *x, const uint16_t *w,
                                                                           int64_t k, const int whole,
                                                                           const int rows, const int streams,
                                                                           int64_t j, int64_t stride,
                                                                           float out[STREAMS][ROWS]) {
    __m512 acc[STREAMS][ROWS];
    const uint16_t *row[STREAMS];
    for (int s = 0; s < streams; s++) {
        row[s] = w + (j + s * stride) * k;
        for (int r = 0; r < rows; r++) acc[s][r] = _mm512_setzero_ps();
    }
    for (int64_t i = 0; i < k; i += 32) {
        __m512bh wv[STREAMS];
        for (int s = 0; s < streams; s++) wv[s] = load_chunk(row[s] + i, k - i, whole);
        for (int r = 0; r < rows; r++) {
            const __m512bh xv = load_chunk(x + r * k + i, k - i, whole);
            for (int s = 0; s < streams; s++) acc[s][r] = _mm512_dpbf16_ps(acc[s][r], xv, wv[s]);
        }
    }
    for (int s = 0; s < streams; s++)
        for (int r = 0; r < rows; r++) out[s][r] = _mm512_reduce_add_ps(acc[s][r]);
}

#define BF16_COLUMNS(R, S) \
    case R: \
        if (k % 32 == 0) columns_bf16(x, w, k, 1, R, S, j, stride, c); \
        else columns_bf16(x, w, k, 0, R, S, j, stride, c); \
        for (int s = 0; s < S; s++) \
            for (int r = 0; r < R; r++) store(y, r * n + j + s * stride, c[s][r], bias, j + s * stride, out_mode); \
        break;

/* Columns [j0, j1) for m <= ROWS rows of x, as STREAMS streams (the rest of an uneven split one by one). */
AVX512_BF16 static void streams_bf16(const uint16_t *x, const uint16_t *w, const float *bias, void *y, int64_t m,
                                     int64_t n, int64_t k, int64_t j0, int64_t j1, int out_mode) {
    float c[STREAMS][ROWS];
    const int64_t stride = (j1 - j0) / STREAMS;
    for (int64_t j = j0; j < j0 + stride; j++) {
        switch (m) { BF16_COLUMNS(1, STREAMS) BF16_COLUMNS(2, STREAMS) BF16_COLUMNS(3, STREAMS) BF16_COLUMNS(4, STREAMS) }
    }
    for (int64_t j = j0 + STREAMS * stride; j < j1; j++) {
        switch (m) { BF16_COLUMNS(1, 1) BF16_COLUMNS(2, 1) BF16_COLUMNS(3, 1) BF16_COLUMNS(4, 1) }
    }
}

#define BF16_TILE(R, C) \
    case R: \
        tile_bf16(x + r0 * k, w + j * k, k, R, C, v); \
        for (int r = 0; r < R; r++) \
            for (int c = 0; c < C; c++) store(y, (r0 + r) * n + j + c, v[r][c], bias, j + c, out_mode); \
        break;

AVX512_BF16 static void panel_bf16(const uint16_t *x, const uint16_t *w, const float *bias, void *y, int64_t m,
                                   int64_t n, int64_t k, int64_t j0, int64_t j1, int out_mode) {
    float v[ROWS][COLS];
    for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
        const int rows = m - r0 < ROWS ? (int)(m - r0) : ROWS;
        int64_t j = j0;
        for (; j + COLS <= j1; j += COLS) {
            switch (rows) { BF16_TILE(1, COLS) BF16_TILE(2, COLS) BF16_TILE(3, COLS) BF16_TILE(4, COLS) }
        }
        for (; j < j1; j++) {
            switch (rows) { BF16_TILE(1, 1) BF16_TILE(2, 1) BF16_TILE(3, 1) BF16_TILE(4, 1) }
        }
    }
}

/* ---- entry points ----------------------------------------------------------------------------- */

/* The linear on the calling team (team.h). */
int kvbaton_linear_dot_team(const void *x, const void *w, int w_elem_bytes, const float *bias, void *y,
                            int out_mode, int64_t m, int64_t n, int64_t k, int isa, int num_threads) {
    if (m < 1 || n < 1 || k < 1) return -1;
    if (isa == ISA_GENERIC && (k % 8 || (w_elem_bytes != 2 && w_elem_bytes != 4))) return -1;
    if (isa == ISA_AVX512_BF16 && w_elem_bytes != 2) return -1;
    if (isa != ISA_GENERIC && isa != ISA_AVX512_BF16) return -1;
    if (isa == ISA_AVX512_BF16 && m <= ROWS) {  /* a read of the weights: a share of the columns per thread */
#pragma omp for schedule(static)
        for (int t = 0; t < num_threads; t++)
            streams_bf16(x, w, bias, y, m, n, k, n * t / num_threads, n * (t + 1) / num_threads, out_mode);
        return 0;
    }
    /* Column panels small enough to stay in L2 while every block of rows reads them, a multiple of
     * COLS columns; with few rows (the pass over the weights is the work) at least 4 per thread. */
    int64_t cols = PANEL_BYTES / (k * w_elem_bytes);
    cols = cols < COLS ? COLS : cols / COLS * COLS;
    if (m <= 2 * ROWS && (n + cols - 1) / cols < 4 * num_threads)
        cols = ((n + 4 * num_threads - 1) / (4 * num_threads) + COLS - 1) / COLS * COLS;
    const int64_t num_panels = (n + cols - 1) / cols, row_chunks = (m + ROW_CHUNK - 1) / ROW_CHUNK;
    const int64_t y_row_bytes = n * (out_mode == OUT_BF16 ? 2 : 4);
#pragma omp for collapse(2) schedule(static)
    for (int64_t p = 0; p < num_panels; p++) {
        for (int64_t rc = 0; rc < row_chunks; rc++) {
            const int64_t j0 = p * cols, j1 = j0 + cols < n ? j0 + cols : n;
            const int64_t r0 = rc * ROW_CHUNK, rows = m - r0 < ROW_CHUNK ? m - r0 : ROW_CHUNK;
            char *y_rows = (char *)y + r0 * y_row_bytes;
            if (isa == ISA_AVX512_BF16)
                panel_bf16((const uint16_t *)x + r0 * k, (const uint16_t *)w, bias, y_rows, rows, n, k, j0, j1,
                           out_mode);
            else
                panel_generic((const float *)x + r0 * k, w, bias, y_rows, rows, n, k, j0, j1, w_elem_bytes == 2,
                              out_mode);
        }
    }
    return 0;
}

int kvbaton_linear_dot(const void *x, const void *w, int w_elem_bytes, const float *bias, void *y, int out_mode,
                       int64_t m, int64_t n, int64_t k, int isa, int num_threads) {
    return ON_TEAM(num_threads, kvbaton_linear_dot_team(x, w, w_elem_bytes, bias, y, out_mode, m, n, k, isa,
                                                        num_threads));
}
