/* y = x W^T (+ b) on AMX tiles (bf16 in, fp32 sums): decode batches, and every row count in
 * deterministic mode, on CPUs with AMX-BF16.
 *
 * Why by hand: oneDNN's bf16 GEMM took ~2.5x the weights' read time on the 8-64 rows of a decode
 * batch (2-core Xeon; it is built for large shapes), and a dot product per output (linear_dot.c) is
 * compute-bound from ~8 rows. Here a 16-row block of x is one A tile, the weights are packed once
 * into B tiles (16 k-pairs x 16 columns, 1 KiB each, [N/16][K/32][16][16][2]), and `tdpbf16ps`
 * accumulates four 16x16 fp32 C tiles (64 columns) over K.
 *
 * Batch-invariant: an output's sums run over the same K blocks in the same order, in the same tile
 * instruction, whatever the number of rows in its block, their place or the thread count (threads
 * split columns and row blocks, never K). So deterministic mode can use it for every row count.
 *
 * Tiles are per-thread state: each thread loads its own configuration for the rows of its work
 * item. A process must be granted the AMX state once (`kvbaton_amx_enable`, Linux arch_prctl).
 *
 * x: [M, K] bf16, K a multiple of 32; packed: see above, N padded to 16; bias: [N_pad] fp32 or
 * NULL; y: [M, N] fp32 (OUT_F32) or bf16 rounded to nearest even (OUT_BF16).
 */
#define _GNU_SOURCE  /* syscall() */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "team.h"
#include "vec8.h"

#define AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw")))
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define TILE_ROWS 16
#define TILE_K 32        /* bf16 elements of K per tile step */
#define TILE_BYTES 1024  /* one B tile: 16 k-pairs x 16 columns x 2 bf16 */
#define GROUP 4          /* B tiles (16 columns each) per pass: C tiles 0-3 */

enum { OUT_F32 = 0, OUT_BF16 = 1 };

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Ask the kernel for the AMX register state (once per process; later calls are no-ops). */
int kvbaton_amx_enable(void) {
#ifdef SYS_arch_prctl
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1;
#else
    return -1;
#endif
}

/* C tiles 0-3: rows x 16 fp32; A tile 4: rows x 32 bf16; B tiles 5-6: 16 k-pairs x 64 bytes. */
AMX static void configure(int rows) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 5; t++) cfg.rows[t] = (uint8_t)rows, cfg.colsb[t] = 64;
    for (int t = 5; t < 7; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

static void store_tile(const float *c, int rows, const float *bias, void *y, int64_t ldy, int64_t col, int cols,
                       int out_mode) {
    for (int r = 0; r < rows; r++) {
        for (int j = 0; j < cols; j++) {
            const float v = c[r * 16 + j] + (bias ? bias[col + j] : 0.0f);
            const int64_t at = (int64_t)r * ldy + col + j;
            if (out_mode == OUT_BF16)
                ((uint16_t *)y)[at] = f32_to_bf16(v);
            else
                ((float *)y)[at] = v;
        }
    }
}

/* `rows` rows of x against column blocks [b0, b1), GROUP at a time. */
AMX static void row_block(const uint16_t *x, int rows, const uint16_t *packed, const float *bias, void *y, int64_t n,
                          int64_t k, int64_t b0, int64_t b1, int out_mode) {
    const int64_t kblocks = k / TILE_K, stride = k * 2;
    float c[GROUP][TILE_ROWS * 16];
    for (int64_t b = b0; b < b1; b += GROUP) {
        const int count = b1 - b < GROUP ? (int)(b1 - b) : GROUP;
        const char *w = (const char *)packed + b * kblocks * TILE_BYTES;
        const int64_t block_bytes = kblocks * TILE_BYTES;  /* one column block's whole K */
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kb = 0; kb < kblocks; kb++) {
            _tile_loadd(4, x + kb * TILE_K, stride);
            const char *wk = w + kb * TILE_BYTES;
            _tile_loadd(5, wk, 64);
            _tile_dpbf16ps(0, 4, 5);
            if (count > 1) {
                _tile_loadd(6, wk + block_bytes, 64);
                _tile_dpbf16ps(1, 4, 6);
            }
            if (count > 2) {
                _tile_loadd(5, wk + 2 * block_bytes, 64);
                _tile_dpbf16ps(2, 4, 5);
            }
            if (count > 3) {
                _tile_loadd(6, wk + 3 * block_bytes, 64);
                _tile_dpbf16ps(3, 4, 6);
            }
        }
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        _tile_stored(2, c[2], 64);
        _tile_stored(3, c[3], 64);
        for (int t = 0; t < count; t++) {
            const int64_t col = (b + t) * 16;
            store_tile(c[t], rows, bias, y, n, col, n - col < 16 ? (int)(n - col) : 16, out_mode);
        }
    }
}

AMX static void work_item(const uint16_t *x, const uint16_t *packed, const float *bias, void *y, int64_t m, int64_t n,
                          int64_t k, int64_t b0, int64_t b1, int64_t r0, int out_mode) {
    const int rows = m - r0 < TILE_ROWS ? (int)(m - r0) : TILE_ROWS;
    configure(rows);
    const int64_t y_row = out_mode == OUT_BF16 ? 2 : 4;
    row_block(x + r0 * k, rows, packed, bias, (char *)y + r0 * n * y_row, n, k, b0, b1, out_mode);
    _tile_release();
}

/* On the calling team (team.h). */
int kvbaton_gemm_amx_team(const uint16_t *x, const uint16_t *packed, const float *bias, void *y, int out_mode,
                          int64_t m, int64_t n, int64_t k, int num_threads) {
    if (m < 1 || n < 1 || k < TILE_K || k % TILE_K) return -1;
    const int64_t blocks = (n + 15) / 16, row_blocks = (m + TILE_ROWS - 1) / TILE_ROWS;
    /* Column blocks per work item: enough items for every thread to get ~4 when rows are few (the
     * pass over the weights is the work), else ~256 KiB of weights (they stay in L2 across row blocks). */
    int64_t per_item = 262144 / ((k / TILE_K) * TILE_BYTES);
    if (row_blocks * ((blocks + per_item - 1) / per_item) < 4 * num_threads)
        per_item = (blocks + 4 * num_threads - 1) / (4 * num_threads);
    if (per_item < 1) per_item = 1;
    const int64_t items = (blocks + per_item - 1) / per_item;
#pragma omp for collapse(2) schedule(static)
    for (int64_t it = 0; it < items; it++) {
        for (int64_t rb = 0; rb < row_blocks; rb++) {
            const int64_t b0 = it * per_item, b1 = b0 + per_item < blocks ? b0 + per_item : blocks;
            work_item(x, packed, bias, y, m, n, k, b0, b1, rb * TILE_ROWS, out_mode);
        }
    }
    return 0;
}

int kvbaton_gemm_amx(const uint16_t *x, const uint16_t *packed, const float *bias, void *y, int out_mode, int64_t m,
                     int64_t n, int64_t k, int num_threads) {
    return ON_TEAM(num_threads, kvbaton_gemm_amx_team(x, packed, bias, y, out_mode, m, n, k, num_threads));
}
