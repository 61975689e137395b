/* y = x W^T (+ b) as one dot product per output, in an order that depends on nothing but K.
 *
 * Why by hand: two jobs with one design.
 * - Decode on CPUs with AVX512-BF16: with one to a few rows a linear layer is a pass over the
 *   weights, and oneDNN's bf16 GEMM reached 10-16 GB/s of a 20 GB/s read bandwidth on this model's
 *   decode shapes (2-core Xeon with AMX). Here `vdpbf16ps` multiplies bf16 pairs straight from the
 *   weight row (no widening), and four weight rows are in flight at once for a single row of x.
 * - Batch-invariant (deterministic) serving: every output y[r][j] is accumulated the same way
 *   whatever the number of rows, the row's place in the batch or the thread count: two vector
 *   accumulators taking alternate chunks of K, then one fixed reduction tree. Threads split the
 *   columns, never K. So a token's logits do not change with what it is batched with.
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

#include "vec8.h"

enum { ISA_GENERIC = 0, ISA_AVX512_BF16 = 1 };
enum { OUT_F32 = 0, OUT_BF16 = 1 };

#define ROWS 4                /* rows of x per pass over a column panel */
#define PREFETCH_GROUPS 2     /* four-row groups ahead that dot4_bf16 asks memory for */
#define PANEL_BYTES 262144    /* weights per column panel: a quarter of a 1 MiB L2, reread by every row block */

static inline void store(void *y, int64_t index, float v, const float *bias, int64_t j, int out_mode) {
    if (bias) v += bias[j];
    if (out_mode == OUT_BF16)
        ((uint16_t *)y)[index] = f32_to_bf16(v);
    else
        ((float *)y)[index] = v;
}

/* ---- generic: fp32 x, bf16 or fp32 w, eight-float vectors ------------------------------------ */

static inline f32x8 load_w8(const void *w, int64_t index, const int w_bf16) {
    return w_bf16 ? load_bf16x8((const uint16_t *)w + index) : load8((const float *)w + index);
}

/* One output: even 8-chunks of K into a0, odd ones into a1. Every path below computes exactly this. */
static inline float dot_generic(const float *x, const void *w, int64_t row, int64_t k, const int w_bf16) {
    f32x8 a0 = {0}, a1 = {0};
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
        a0 += load8(x + i) * load_w8(w, row * k + i, w_bf16);
        a1 += load8(x + i + 8) * load_w8(w, row * k + i + 8, w_bf16);
    }
    if (i < k) a0 += load8(x + i) * load_w8(w, row * k + i, w_bf16);
    return hsum8(a0 + a1);
}

/* Four columns of one row at once (more loads in flight); per output the same sums as dot_generic. */
static inline void dot4_generic(const float *x, const void *w, int64_t j, int64_t k, const int w_bf16,
                                float out[4]) {
    f32x8 a[4][2] = {{{0}}};
    const int elem = w_bf16 ? 2 : 4;
    const char *ahead = (const char *)w + (j + PREFETCH_GROUPS * 4) * k * elem;  /* as in dot4_bf16 */
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
        for (int line = 0; line < elem; line++) __builtin_prefetch(ahead + i * 4 * elem + line * 64);
        const f32x8 x0 = load8(x + i), x1 = load8(x + i + 8);
        for (int c = 0; c < 4; c++) {
            a[c][0] += x0 * load_w8(w, (j + c) * k + i, w_bf16);
            a[c][1] += x1 * load_w8(w, (j + c) * k + i + 8, w_bf16);
        }
    }
    if (i < k) {
        const f32x8 x0 = load8(x + i);
        for (int c = 0; c < 4; c++) a[c][0] += x0 * load_w8(w, (j + c) * k + i, w_bf16);
    }
    for (int c = 0; c < 4; c++) out[c] = hsum8(a[c][0] + a[c][1]);
}

static void panel_generic(const float *x, const void *w, const float *bias, void *y, int64_t m, int64_t n,
                          int64_t k, int64_t j0, int64_t j1, const int w_bf16, int out_mode) {
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * k;
        int64_t j = j0;
        for (; j + 4 <= j1; j += 4) {
            float v[4];
            dot4_generic(xr, w, j, k, w_bf16, v);
            for (int c = 0; c < 4; c++) store(y, r * n + j + c, v[c], bias, j + c, out_mode);
        }
        for (; j < j1; j++) store(y, r * n + j, dot_generic(xr, w, j, k, w_bf16), bias, j, out_mode);
    }
}

/* ---- AVX512-BF16: bf16 x and w, vdpbf16ps ------------------------------------------------------ */

#define AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))

AVX512_BF16 static inline __m512bh load_bh(const uint16_t *p, int64_t left) {
    if (left >= 32) return (__m512bh)_mm512_loadu_si512(p);
    return (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1u << left) - 1u), p);  /* zeros past K */
}

/* One output: even 32-chunks of K into a0, odd ones into a1, then one fixed reduction. */
AVX512_BF16 static inline float dot_bf16(const uint16_t *x, const uint16_t *w, int64_t k) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 64 <= k; i += 64) {
        a0 = _mm512_dpbf16_ps(a0, load_bh(x + i, 32), load_bh(w + i, 32));
        a1 = _mm512_dpbf16_ps(a1, load_bh(x + i + 32, 32), load_bh(w + i + 32, 32));
    }
    if (i < k) a0 = _mm512_dpbf16_ps(a0, load_bh(x + i, k - i), load_bh(w + i, k - i));
    if (i + 32 < k) a1 = _mm512_dpbf16_ps(a1, load_bh(x + i + 32, k - i - 32), load_bh(w + i + 32, k - i - 32));
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

AVX512_BF16 static inline void dot4_bf16(const uint16_t *x, const uint16_t *w, int64_t k, float out[4]) {
    __m512 a[4][2];
    for (int c = 0; c < 4; c++) a[c][0] = a[c][1] = _mm512_setzero_ps();
    /* The four rows two groups ahead, 512 bytes per step: the rows are contiguous, so this walks them in
     * address order; the hardware prefetcher alone reached ~60% of a plain read's bandwidth here. */
    const char *ahead = (const char *)(w + PREFETCH_GROUPS * 4 * k);
    int64_t i = 0;
    for (; i + 64 <= k; i += 64) {
        for (int line = 0; line < 8; line++) _mm_prefetch(ahead + i * 8 + line * 64, _MM_HINT_T0);
        const __m512bh x0 = load_bh(x + i, 32), x1 = load_bh(x + i + 32, 32);
        for (int c = 0; c < 4; c++) {
            a[c][0] = _mm512_dpbf16_ps(a[c][0], x0, load_bh(w + c * k + i, 32));
            a[c][1] = _mm512_dpbf16_ps(a[c][1], x1, load_bh(w + c * k + i + 32, 32));
        }
    }
    for (int c = 0; c < 4; c++) {
        if (i < k) a[c][0] = _mm512_dpbf16_ps(a[c][0], load_bh(x + i, k - i), load_bh(w + c * k + i, k - i));
        if (i + 32 < k)
            a[c][1] = _mm512_dpbf16_ps(a[c][1], load_bh(x + i + 32, k - i - 32),
                                       load_bh(w + c * k + i + 32, k - i - 32));
        out[c] = _mm512_reduce_add_ps(_mm512_add_ps(a[c][0], a[c][1]));
    }
}

AVX512_BF16 static void panel_bf16(const uint16_t *x, const uint16_t *w, const float *bias, void *y, int64_t m,
                                   int64_t n, int64_t k, int64_t j0, int64_t j1, int out_mode) {
    for (int64_t r = 0; r < m; r++) {
        const uint16_t *xr = x + r * k;
        int64_t j = j0;
        for (; j + 4 <= j1; j += 4) {
            float v[4];
            dot4_bf16(xr, w + j * k, k, v);
            for (int c = 0; c < 4; c++) store(y, r * n + j + c, v[c], bias, j + c, out_mode);
        }
        for (; j < j1; j++) store(y, r * n + j, dot_bf16(xr, w + j * k, k), bias, j, out_mode);
    }
}

/* ---- entry point ------------------------------------------------------------------------------ */

int kvbaton_linear_dot(const void *x, const void *w, int w_elem_bytes, const float *bias, void *y, int out_mode,
                       int64_t m, int64_t n, int64_t k, int isa, int num_threads) {
    if (m < 1 || n < 1 || k < 1) return -1;
    if (isa == ISA_GENERIC && (k % 8 || (w_elem_bytes != 2 && w_elem_bytes != 4))) return -1;
    if (isa == ISA_AVX512_BF16 && w_elem_bytes != 2) return -1;
    if (isa != ISA_GENERIC && isa != ISA_AVX512_BF16) return -1;
    /* Column panels small enough to stay in L2 while every block of ROWS rows reads them; a multiple
     * of 4 columns so the four-column path covers all but the last panel's tail. */
    int64_t cols = PANEL_BYTES / (k * w_elem_bytes);
    cols = cols < 4 ? 4 : cols & ~(int64_t)3;
    const int64_t row_blocks = (m + ROWS - 1) / ROWS;
    /* Few rows: split the columns finely across threads (the pass over the weights is the work). */
    if (m <= ROWS && (n + cols - 1) / cols < 4 * num_threads)
        cols = ((n + 4 * num_threads - 1) / (4 * num_threads) + 3) & ~(int64_t)3;
    const int64_t num_panels = (n + cols - 1) / cols;
#pragma omp parallel for collapse(2) schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < num_panels; p++) {
        for (int64_t rb = 0; rb < row_blocks; rb++) {
            const int64_t j0 = p * cols, j1 = j0 + cols < n ? j0 + cols : n;
            const int64_t r0 = rb * ROWS, rows = m - r0 < ROWS ? m - r0 : ROWS;
            char *y_rows = (char *)y + r0 * n * (out_mode == OUT_BF16 ? 2 : 4);
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
