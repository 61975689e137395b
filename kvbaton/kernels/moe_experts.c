/* The routed experts of one MoE layer in one call (`kvbaton_moe_experts`): sort the (token, choice)
 * assignments by expert, run every hit expert's gate/up projection with silu(gate) * up in its epilogue, then
 * its down projection, then add each token's k weighted contributions. And its softmax gate in one call
 * (`kvbaton_moe_route`, at the end of this file).
 *
 * Why by hand: PyTorch's grouped path is a Python loop over the hit experts, two GEMM calls, a silu, a mul and
 * their allocations per expert, then a weighted index_add_; at decode each expert has one to a few rows, so
 * that is ~10 ops of ~10 us around each expert's weight pass, and oneDNN's bf16 GEMM reads the few-row shapes
 * at half the memory bandwidth (linear_dot.c). Here:
 * - the assignments are counting-sorted by expert (stable: token order within an expert), so the rows of an
 *   expert are contiguous and every count is known before the first GEMM; experts nobody chose cost nothing;
 * - the work is (expert, group of 64 output columns) items, over every hit expert at once, handed to the
 *   threads dynamically (phase 1: gate/up, phase 2: down, one barrier between): a decode step streams each
 *   hit expert's weights once over both cores, a prefill step keeps an item's weights in L2 across its rows;
 * - per item the instruction set the caller chose (kvbaton.platform's compute path):
 *     ISA_AMX: AMX tiles (16 rows x 16 columns x 32 K per tdpbf16ps, four C tiles) for experts with at least
 *       `amx_min_rows` rows, the AVX512-BF16 dot tile below for fewer (a few rows are a pass over memory);
 *     ISA_AVX512_BF16: vdpbf16ps on pairs of K, a register tile of up to 4 rows x 64 columns;
 *     ISA_AVX2: fp32 FMAs over bf16 weights widened in registers, a 6 x 16 register tile (gemm_packed.c's),
 *       1-2 rows x 32 columns for experts with a row or two (more independent FMA chains);
 * - the combine is one pass: out[t] = sum over j < k of weight[t][j] * y[row of (t, j)], in fp32, j in order,
 *   rounded once to bf16.
 * Deterministic: every output is computed by one item in one fixed order over K, whatever thread takes it,
 * so the result does not depend on the thread count; the item partition depends on the shapes only.
 * Batch-invariant with amx_min_rows = 1 (AMX) and on the other two sets: an output's sums do not depend on
 * the rows beside it (the tile instructions are exact per row; the FMA chains run over K in order).
 *
 * Weights, packed once at load time by kvbaton/kernels/moe.py, in place of the stacked originals (the same
 * bytes: no padding, so the shapes below must divide):
 * - tile layout (ISA_AMX, ISA_AVX512_BF16): per expert, blocks of 16 output columns, each
 *   [K/32][16 k-pairs][16 columns][2] (one 1 KiB AMX B tile per 32 K; a row of it, 16 columns of one k-pair,
 *   is one zmm for vdpbf16ps). gate_up's blocks alternate gate and up: block 2b = gate columns [16b, 16b+16),
 *   block 2b+1 = the up columns of the same outputs. Needs hidden % 32 == 0 and intermediate % 32 == 0.
 * - panel layout (ISA_AVX2): per expert, panels of 16 output columns, [K][16] with the columns stored in
 *   gemm_packed.c's order (c0-3, c8-11, c4-7, c12-15); a gate_up panel holds 8 gate columns, then their 8 up
 *   columns. Needs intermediate % 8 == 0 and hidden % 16 == 0.
 *
 * x: [T, H] bf16; ids: [T, k] int64 expert ids; route_w: [T, k] fp32 routing weights; gate_up: [E][2I * H]
 * and down: [E][H * I] packed bf16; out: [T, H] bf16. Returns 0, -1 for arguments it does not handle, -2 for
 * an expert id outside [0, E), -3 when scratch memory could not be had.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "team.h"
#include "vec8.h"


enum { ISA_AVX2 = 0, ISA_AVX512_BF16 = 1, ISA_AMX = 2 };

#define BLOCK 16      /* output columns per packed block (tile layout) or panel (panel layout) */
#define GROUP 4       /* blocks per work item: 64 output columns (32 gated activations) */
#define ITEM_COLS (GROUP * BLOCK)
#define TILE_K 32     /* tile layout: K per B tile */
#define TILE_ELEMS 512  /* bf16 elements per B tile: 16 k-pairs x 16 columns x 2 */
#define DOT_ROWS 4    /* rows per vdpbf16ps register tile: 4 x 4 accumulators + 4 weight vectors */
#define AVX2_ROWS 6   /* rows per AVX2 register tile: 12 accumulators + 2 weight vectors + 1 broadcast */
#define AMX_ROWS 16   /* rows per AMX A tile */
#define PREFETCH_PAIRS 16  /* vdpbf16ps tile: ask for each weight stream's line this many k-pairs (1 KiB) ahead */

#define AVX2 __attribute__((target("avx2,fma")))
#define AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))
#define AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw")))

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

typedef struct {
    int isa, amx_min_rows;
    int64_t h, inter;
    const uint16_t *gate_up, *down;
    const int64_t *seg_start, *seg_rows;  /* per expert: first sorted row, rows */
    const int64_t *hit;                   /* the experts with rows, ascending */
    void *xs;    /* sorted rows of x: [N, H] bf16 (tile ISAs) or fp32 (AVX2) */
    void *act;   /* silu(gate) * up: [N, I] bf16 (tile ISAs) or fp32 holding bf16 values (AVX2) */
    float *ys;   /* down projection: [N, H] fp32 */
} Ctx;

/* ---- epilogues: rows x up to 64 fp32 results in c (row stride ITEM_COLS) to their destination ------------ */

/* silu(gate) * up, rounded after each op as PyTorch's bf16 silu and mul do. */
static inline void silu_mul(const float *gate, const float *up, int n, float *out) {
#pragma omp simd
    for (int j = 0; j < n; j++) {
        const float g = round_bf16(gate[j]);
        out[j] = round_bf16(round_bf16(g / (1.0f + expf(-g))) * round_bf16(up[j]));
    }
}

/* Phase 1 results of blocks [b0, b0 + nblk) for rows [r0, r0 + rows) of the sorted batch. Tile layout: pairs
 * of blocks (gate, up) -> 16 activations each; panel layout: each panel (8 gate | 8 up) -> 8 activations. */
static void store_act(const Ctx *ctx, const float *c, int rows, int64_t r0, int64_t b0, int nblk, int panel_cols) {
    const int half = panel_cols ? 8 : BLOCK, unit = 2 * half;  /* columns of c per (gate, up) unit */
    const int units = panel_cols ? nblk : nblk / 2;
    const int64_t a0 = panel_cols ? b0 * 8 : b0 / 2 * BLOCK;
    float v[BLOCK];
    for (int r = 0; r < rows; r++) {
        for (int u = 0; u < units; u++) {
            const float *cr = c + r * ITEM_COLS + u * unit;
            silu_mul(cr, cr + half, half, v);
            const int64_t at = (r0 + r) * ctx->inter + a0 + u * half;
            if (ctx->isa == ISA_AVX2) {
                memcpy((float *)ctx->act + at, v, sizeof(float) * (size_t)half);
            } else {
                uint16_t *o = (uint16_t *)ctx->act + at;
                for (int j = 0; j < half; j++) o[j] = f32_to_bf16(v[j]);
            }
        }
    }
}

static void store_down(const Ctx *ctx, const float *c, int rows, int64_t r0, int64_t b0, int nblk) {
    for (int r = 0; r < rows; r++)
        memcpy(ctx->ys + (r0 + r) * ctx->h + b0 * BLOCK, c + r * ITEM_COLS, sizeof(float) * (size_t)(nblk * BLOCK));
}

/* ---- AVX512-BF16: `rows` (<= DOT_ROWS) bf16 rows of x against NBLK blocks of the tile layout ------------- */

AVX512_BF16 static inline __attribute__((always_inline)) void dot_tile(const uint16_t *x, int64_t k, const int rows,
                                                                       const uint16_t *w, int64_t blk_elems,
                                                                       const int nblk, float *c) {
    __m512 acc[DOT_ROWS][GROUP];
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < nblk; g++) acc[r][g] = _mm512_setzero_ps();
    const int64_t pairs = k / 2;
    for (int64_t p = 0; p < pairs; p++) {
        __m512i wv[GROUP];
        for (int g = 0; g < nblk; g++) {
            const uint16_t *wp = w + g * blk_elems + p * 32;
            if (p + PREFETCH_PAIRS < pairs) _mm_prefetch((const char *)(wp + PREFETCH_PAIRS * 32), _MM_HINT_T0);
            wv[g] = _mm512_loadu_si512(wp);
        }
        for (int r = 0; r < rows; r++) {
            int32_t pair;
            memcpy(&pair, x + r * k + 2 * p, sizeof pair);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            for (int g = 0; g < nblk; g++) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], xb, (__m512bh)wv[g]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < nblk; g++) _mm512_storeu_ps(c + r * ITEM_COLS + g * BLOCK, acc[r][g]);
}

#define DOT_CASE(R, B) \
    case (R) * 8 + (B): \
        dot_tile(x, k, R, w, blk_elems, B, c); \
        return;

AVX512_BF16 static void dot_any(const uint16_t *x, int64_t k, int rows, const uint16_t *w, int64_t blk_elems, int nblk,
                                float *c) {
    switch (rows * 8 + nblk) {
        DOT_CASE(1, 1) DOT_CASE(1, 2) DOT_CASE(1, 3) DOT_CASE(1, 4)
        DOT_CASE(2, 1) DOT_CASE(2, 2) DOT_CASE(2, 3) DOT_CASE(2, 4)
        DOT_CASE(3, 1) DOT_CASE(3, 2) DOT_CASE(3, 3) DOT_CASE(3, 4)
        DOT_CASE(4, 1) DOT_CASE(4, 2) DOT_CASE(4, 3) DOT_CASE(4, 4)
    }
}

/* ---- AMX: up to 16 rows of x (one A tile) against up to 4 blocks (C tiles 0-3) ---------------------------- */

/* C tiles 0-3: rows x 16 fp32; A tile 4: rows x 32 bf16; B tiles 5-6: 16 k-pairs x 64 bytes. */
AMX static void amx_configure(int rows) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 5; t++) cfg.rows[t] = (uint8_t)rows, cfg.colsb[t] = 64;
    for (int t = 5; t < 7; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

AMX static void amx_release(void) { _tile_release(); }

AMX static void amx_tile(const uint16_t *x, int64_t k, const uint16_t *w, int64_t blk_elems, int nblk, float *c) {
    const int64_t kblocks = k / TILE_K, stride = k * 2;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < kblocks; kb++) {
        const uint16_t *wk = w + kb * TILE_ELEMS;
        _tile_loadd(4, x + kb * TILE_K, stride);
        _tile_loadd(5, wk, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (nblk > 1) {
            _tile_loadd(6, wk + blk_elems, 64);
            _tile_dpbf16ps(1, 4, 6);
        }
        if (nblk > 2) {
            _tile_loadd(5, wk + 2 * blk_elems, 64);
            _tile_dpbf16ps(2, 4, 5);
        }
        if (nblk > 3) {
            _tile_loadd(6, wk + 3 * blk_elems, 64);
            _tile_dpbf16ps(3, 4, 6);
        }
    }
    const int ldc = ITEM_COLS * (int)sizeof(float);
    _tile_stored(0, c, ldc);
    if (nblk > 1) _tile_stored(1, c + BLOCK, ldc);
    if (nblk > 2) _tile_stored(2, c + 2 * BLOCK, ldc);
    if (nblk > 3) _tile_stored(3, c + 3 * BLOCK, ldc);
}

/* ---- AVX2: up to 6 fp32 rows of x against one bf16 panel [K][16], or up to 2 rows against two ------------- */

/* NP panels (one: 6 x 16 tile; two, for 1-2 rows: twice the independent FMA chains, which a row or two need
 * to keep the FMA units busy while streaming the weights). Every output is one chain over K either way. */
AVX2 static inline __attribute__((always_inline)) void panel_tile(const float *x, int64_t k, const int rows,
                                                                  const uint16_t *panel, int64_t panel_elems,
                                                                  const int np, float *c) {
    __m256 acc[AVX2_ROWS][4];
    for (int r = 0; r < rows; r++)
        for (int q = 0; q < 2 * np; q++) acc[r][q] = _mm256_setzero_ps();
    const __m256i zero = _mm256_setzero_si256();
    for (int64_t kk = 0; kk < k; kk++) {
        /* one 32-byte load, interleaved with zeros within 128-bit lanes: columns 0-7 and 8-15 as fp32 */
        __m256 wv[4];
        for (int q = 0; q < np; q++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(panel + q * panel_elems + kk * BLOCK));
            wv[2 * q] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
            wv[2 * q + 1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
        }
        for (int r = 0; r < rows; r++) {
            const __m256 xv = _mm256_broadcast_ss(x + r * k + kk);
            for (int q = 0; q < 2 * np; q++) acc[r][q] = _mm256_fmadd_ps(wv[q], xv, acc[r][q]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int q = 0; q < 2 * np; q++) _mm256_storeu_ps(c + r * ITEM_COLS + q * 8, acc[r][q]);
}

#define PANEL_CASE(R) \
    case R: \
        panel_tile(x, k, R, panel, panel_elems, 1, c); \
        return;

AVX2 static void panel_any(const float *x, int64_t k, int rows, const uint16_t *panel, int64_t panel_elems, int np,
                           float *c) {
    if (np == 2) {
        if (rows == 1) panel_tile(x, k, 1, panel, panel_elems, 2, c);
        else panel_tile(x, k, 2, panel, panel_elems, 2, c);
        return;
    }
    switch (rows) { PANEL_CASE(1) PANEL_CASE(2) PANEL_CASE(3) PANEL_CASE(4) PANEL_CASE(5) PANEL_CASE(6) }
}

/* ---- one work item: every row of expert e against blocks [b0, b0 + nblk) of phase 0 (gate_up) or 1 ------- */

static void run_item(const Ctx *ctx, int phase, int64_t e, int64_t b0, int nblk, float *c, int *amx_rows) {
    const int64_t k = phase == 0 ? ctx->h : ctx->inter;
    const int64_t n = phase == 0 ? 2 * ctx->inter : ctx->h;
    const int64_t blk_elems = BLOCK * k;
    const uint16_t *w = (phase == 0 ? ctx->gate_up : ctx->down) + e * n * k + b0 * blk_elems;
    const void *x = phase == 0 ? ctx->xs : ctx->act;
    const int64_t start = ctx->seg_start[e], rows = ctx->seg_rows[e];
    if (ctx->isa == ISA_AVX2) {
        const int pair = rows <= 2;  /* a row or two: two panels per tile */
        for (int p = 0; p < nblk; p += pair ? 2 : 1) {
            const int np = pair && p + 1 < nblk ? 2 : 1;
            for (int64_t r = 0; r < rows; r += AVX2_ROWS) {
                const int m = rows - r < AVX2_ROWS ? (int)(rows - r) : AVX2_ROWS;
                panel_any((const float *)x + (start + r) * k, k, m, w + p * blk_elems, blk_elems, np, c);
                if (phase == 0)
                    store_act(ctx, c, m, start + r, b0 + p, np, 1);
                else
                    store_down(ctx, c, m, start + r, b0 + p, np);
            }
        }
        return;
    }
    const int tiles = ctx->isa == ISA_AMX && rows >= ctx->amx_min_rows;
    const int step = tiles ? AMX_ROWS : DOT_ROWS;
    for (int64_t r = 0; r < rows; r += step) {
        const int m = rows - r < step ? (int)(rows - r) : step;
        const uint16_t *xr = (const uint16_t *)x + (start + r) * k;
        if (tiles) {
            if (*amx_rows != m) amx_configure(m), *amx_rows = m;
            amx_tile(xr, k, w, blk_elems, nblk, c);
        } else {
            dot_any(xr, k, m, w, blk_elems, nblk, c);
        }
        if (phase == 0)
            store_act(ctx, c, m, start + r, b0, nblk, 0);
        else
            store_down(ctx, c, m, start + r, b0, nblk);
    }
}

static int64_t item_groups(int64_t n) { return (n / BLOCK + GROUP - 1) / GROUP; }

static void run_phase(const Ctx *ctx, int phase, int64_t num_hit, float *c, int *amx_rows) {
    const int64_t blocks = (phase == 0 ? 2 * ctx->inter : ctx->h) / BLOCK, groups = item_groups(blocks * BLOCK);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < num_hit * groups; it++) {
        const int64_t e = ctx->hit[it / groups], b0 = it % groups * GROUP;
        run_item(ctx, phase, e, b0, blocks - b0 < GROUP ? (int)(blocks - b0) : GROUP, c, amx_rows);
    }
}

/* The scratch a call needs, carved in moe_carve's order: the counting sort's arrays (int64), then the sorted rows
 * of x, the activations and the down projections. */
typedef struct {
    int64_t *seg_start, *seg_rows, *hit, *pos, *row_token, *fill;
    void *xs, *act;
    float *ys;
} Scratch;

static int64_t moe_carve(int64_t t, int k, int64_t num_experts, int64_t h, int64_t inter, int isa, char *base,
                         Scratch *sc) {
    const int64_t n = t * k;
    const size_t act_elem = isa == ISA_AVX2 ? 4 : 2;
    int64_t off = 0;
#define MOE_SLICE(field, type, count)                          \
    if (base) sc->field = (type *)(base + off);                 \
    off += ((int64_t)sizeof(type) * (count) + 63) / 64 * 64;
    MOE_SLICE(seg_start, int64_t, num_experts)
    MOE_SLICE(seg_rows, int64_t, num_experts)
    MOE_SLICE(hit, int64_t, num_experts)
    MOE_SLICE(fill, int64_t, num_experts)
    MOE_SLICE(pos, int64_t, n)
    MOE_SLICE(row_token, int64_t, n)
    MOE_SLICE(xs, char, n * h * (int64_t)act_elem)
    MOE_SLICE(act, char, n * inter * (int64_t)act_elem)
    MOE_SLICE(ys, float, n * h)
#undef MOE_SLICE
    return off;
}

/* Bytes of scratch kvbaton_moe_experts_team needs for t tokens (64-byte aligned pieces). */
int64_t kvbaton_moe_experts_scratch(int64_t t, int k, int64_t num_experts, int64_t h, int64_t inter, int isa) {
    return moe_carve(t, k, num_experts, h, inter, isa, NULL, NULL);
}

/* The routed experts on the calling team (team.h): scratch is kvbaton_moe_experts_scratch bytes, 64-byte aligned,
 * shared by the team; counts: NULL, or [E] int64 to which each expert's assignments this call are added. */
int kvbaton_moe_experts_team(const uint16_t *x, const int64_t *ids, const float *route_w, const uint16_t *gate_up,
                             const uint16_t *down, uint16_t *out, int64_t t, int k, int64_t num_experts, int64_t h,
                             int64_t inter, int isa, int amx_min_rows, int num_threads, void *scratch,
                             int64_t *counts) {
    (void)num_threads;  /* the items go to whichever thread is free: the results do not depend on the split */
    if (t < 0 || k < 1 || num_experts < 1 || h < 1 || inter < 1) return -1;
    if (isa == ISA_AVX2) {
        if (inter % 8 || h % BLOCK) return -1;
    } else if (isa == ISA_AVX512_BF16 || isa == ISA_AMX) {
        if (h % TILE_K || inter % TILE_K) return -1;
    } else {
        return -1;
    }
    const int64_t n = t * k;
    for (int64_t i = 0; i < n; i++)  /* every thread reads the same ids: each returns the same code */
        if (ids[i] < 0 || ids[i] >= num_experts) return -2;
    if (t == 0) return 0;
    Scratch sc = {0};
    moe_carve(t, k, num_experts, h, inter, isa, (char *)scratch, &sc);
    /* counting sort of the assignments by expert, stable: row pos[i] of the sorted batch is assignment i; one
     * thread sorts (a few hundred ids), the single's closing barrier shows the result to the others */
#pragma omp single
    {
        memset(sc.seg_rows, 0, sizeof(int64_t) * (size_t)num_experts);
        memset(sc.fill, 0, sizeof(int64_t) * (size_t)num_experts);
        for (int64_t i = 0; i < n; i++) sc.seg_rows[ids[i]]++;
        int64_t next = 0, hits = 0;
        for (int64_t e = 0; e < num_experts; e++) {
            sc.seg_start[e] = next;
            next += sc.seg_rows[e];
            if (sc.seg_rows[e]) sc.hit[hits++] = e;
            if (counts) counts[e] += sc.seg_rows[e];
        }
        for (int64_t i = 0; i < n; i++) {
            const int64_t e = ids[i], r = sc.seg_start[e] + sc.fill[e]++;
            sc.pos[i] = r;
            sc.row_token[r] = i / k;
        }
    }
    int64_t num_hit = 0;
    for (int64_t e = 0; e < num_experts; e++) num_hit += sc.seg_rows[e] != 0;
    const Ctx ctx = {.isa = isa, .amx_min_rows = amx_min_rows < 1 ? 1 : amx_min_rows, .h = h, .inter = inter,
                     .gate_up = gate_up, .down = down, .seg_start = sc.seg_start, .seg_rows = sc.seg_rows,
                     .hit = sc.hit, .xs = sc.xs, .act = sc.act, .ys = sc.ys};
    float c[AMX_ROWS * ITEM_COLS] __attribute__((aligned(64)));
    int amx_rows = 0;  /* this thread's AMX configuration: rows of its A and C tiles (0: none) */
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n; r++) {  /* gather the rows in expert order */
        const uint16_t *src = x + sc.row_token[r] * h;
        if (isa == ISA_AVX2) {
            float *dst = (float *)sc.xs + r * h;
#pragma omp simd
            for (int64_t j = 0; j < h; j++) dst[j] = bf16_to_f32(src[j]);
        } else {
            memcpy((uint16_t *)sc.xs + r * h, src, (size_t)h * 2);
        }
    }
    run_phase(&ctx, 0, num_hit, c, &amx_rows);
    run_phase(&ctx, 1, num_hit, c, &amx_rows);
    if (amx_rows) amx_release();
#pragma omp for schedule(static)
    for (int64_t tok = 0; tok < t; tok++) {  /* the combine: k weighted rows per token, in choice order */
        float sum[BLOCK];
        for (int64_t j0 = 0; j0 < h; j0 += BLOCK) {
            for (int c2 = 0; c2 < BLOCK; c2++) sum[c2] = 0.0f;
            for (int j = 0; j < k; j++) {
                const float wj = route_w[tok * k + j];
                const float *y = sc.ys + sc.pos[tok * k + j] * h + j0;
#pragma omp simd
                for (int c2 = 0; c2 < BLOCK; c2++) sum[c2] += wj * y[c2];
            }
            for (int c2 = 0; c2 < BLOCK; c2++) out[tok * h + j0 + c2] = f32_to_bf16(sum[c2]);
        }
    }
    return 0;
}

int kvbaton_moe_experts(const uint16_t *x, const int64_t *ids, const float *route_w, const uint16_t *gate_up,
                        const uint16_t *down, uint16_t *out, int64_t t, int k, int64_t num_experts, int64_t h,
                        int64_t inter, int isa, int amx_min_rows, int num_threads) {
    if (t < 0 || k < 1 || num_experts < 1 || num_threads < 1) return -1;
    void *scratch = aligned_alloc(64, (size_t)kvbaton_moe_experts_scratch(t, k, num_experts, h, inter, isa) + 64);
    if (!scratch) return -3;
    const int rc = ON_TEAM(num_threads, kvbaton_moe_experts_team(x, ids, route_w, gate_up, down, out, t, k,
                                                                 num_experts, h, inter, isa, amx_min_rows,
                                                                 num_threads, scratch, NULL));
    free(scratch);
    return rc;
}

/* ---- the gate: logits, softmax, top-k -------------------------------------------------------------------
 *
 * What TopKRouter's softmax scoring computes, for bf16 models, in one call instead of six PyTorch ops (~90 us
 * at one token, most of it per-op overhead): logits = x W^T (fp32 sums, rounded to bf16 as F.linear's bf16
 * output is), softmax over the experts in fp32, the k largest (ties: the lower expert id first), optionally
 * renormalized to sum to 1. Each token is computed alone (batch-invariant); threads split the tokens.
 *
 * x: [T, H] bf16; w: [E, H] bf16; ids: [T, k] int64 out, weights: [T, k] fp32 out, in descending weight.
 * isa: ISA_AVX2 (bf16 widened to fp32, H % 8 == 0) or ISA_AVX512_BF16 / ISA_AMX (vdpbf16ps, H % 32 == 0).
 */

#define MAX_ROUTE_EXPERTS 1024

AVX512_BF16 static void logits_bf16(const uint16_t *x, const uint16_t *w, int64_t h, int64_t e, float *out) {
    int64_t j = 0;
    for (; j + 4 <= e; j += 4) {
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
        const uint16_t *w0 = w + j * h;
        for (int64_t i = 0; i < h; i += 32) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i);
            a0 = _mm512_dpbf16_ps(a0, xv, (__m512bh)_mm512_loadu_si512(w0 + i));
            a1 = _mm512_dpbf16_ps(a1, xv, (__m512bh)_mm512_loadu_si512(w0 + h + i));
            a2 = _mm512_dpbf16_ps(a2, xv, (__m512bh)_mm512_loadu_si512(w0 + 2 * h + i));
            a3 = _mm512_dpbf16_ps(a3, xv, (__m512bh)_mm512_loadu_si512(w0 + 3 * h + i));
        }
        out[j] = _mm512_reduce_add_ps(a0), out[j + 1] = _mm512_reduce_add_ps(a1);
        out[j + 2] = _mm512_reduce_add_ps(a2), out[j + 3] = _mm512_reduce_add_ps(a3);
    }
    for (; j < e; j++) {
        __m512 a = _mm512_setzero_ps();
        for (int64_t i = 0; i < h; i += 32)
            a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(x + i), (__m512bh)_mm512_loadu_si512(w + j * h + i));
        out[j] = _mm512_reduce_add_ps(a);
    }
}

AVX2 static inline __m256 widen8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

AVX2 static float hsum256(__m256 v) {
    float lanes[8];
    _mm256_storeu_ps(lanes, v);
    return ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
}

AVX2 static void logits_avx2(const uint16_t *x, const uint16_t *w, int64_t h, int64_t e, float *out) {
    for (int64_t j = 0; j < e; j++) {
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        const uint16_t *wj = w + j * h;
        int64_t i = 0;
        for (; i + 16 <= h; i += 16) {
            a0 = _mm256_fmadd_ps(widen8(x + i), widen8(wj + i), a0);
            a1 = _mm256_fmadd_ps(widen8(x + i + 8), widen8(wj + i + 8), a1);
        }
        for (; i < h; i += 8) a0 = _mm256_fmadd_ps(widen8(x + i), widen8(wj + i), a0);
        out[j] = hsum256(_mm256_add_ps(a0, a1));
    }
}

static void route_one(const uint16_t *x, const uint16_t *w, int64_t h, int64_t e, int k, int norm_topk, int isa,
                      int64_t *ids, float *weights) {
    float p[MAX_ROUTE_EXPERTS];
    if (isa == ISA_AVX2)
        logits_avx2(x, w, h, e, p);
    else
        logits_bf16(x, w, h, e, p);
    for (int64_t j = 0; j < e; j++) p[j] = round_bf16(p[j]);
    float top = p[0];  /* NOTE: not -INFINITY: -ffast-math assumes there are none */
    for (int64_t j = 1; j < e; j++) top = p[j] > top ? p[j] : top;
    float sum = 0.0f;
    for (int64_t j = 0; j < e; j++) {
        p[j] = expf(p[j] - top);
        sum += p[j];
    }
    float picked = 0.0f;
    for (int c = 0; c < k; c++) {
        int64_t best = -1;
        for (int64_t j = 0; j < e; j++)
            if (p[j] >= 0.0f && (best < 0 || p[j] > p[best])) best = j;
        ids[c] = best;
        weights[c] = p[best] / sum;
        picked += weights[c];
        p[best] = -1.0f;  /* taken */
    }
    if (norm_topk)
        for (int c = 0; c < k; c++) weights[c] /= picked;
}

static int route_ok(int64_t t, int64_t h, int64_t e, int k, int isa) {
    if (t < 0 || h < 1 || e < 1 || e > MAX_ROUTE_EXPERTS || k < 1 || k > e) return 0;
    if (isa == ISA_AVX2 ? h % 8 : h % 32) return 0;
    return isa == ISA_AVX2 || isa == ISA_AVX512_BF16 || isa == ISA_AMX;
}

/* The gate on the calling team (team.h): the team's threads split the tokens (each token alone: the same bits). */
int kvbaton_moe_route_team(const uint16_t *x, const uint16_t *w, int64_t t, int64_t h, int64_t e, int k,
                           int norm_topk, int isa, int64_t *ids, float *weights) {
    if (!route_ok(t, h, e, k, isa)) return -1;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < t; i++) route_one(x + i * h, w, h, e, k, norm_topk, isa, ids + i * k, weights + i * k);
    return 0;
}

int kvbaton_moe_route(const uint16_t *x, const uint16_t *w, int64_t t, int64_t h, int64_t e, int k, int norm_topk,
                      int isa, int num_threads, int64_t *ids, float *weights) {
    if (!route_ok(t, h, e, k, isa) || num_threads < 1) return -1;
    /* NOTE: one token's gate is ~E x H multiply-adds (~5 us at 64 x 768): threads only pay off for a batch */
    const int threads = t * e * h >= (int64_t)1 << 22 ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t i = 0; i < t; i++) route_one(x + i * h, w, h, e, k, norm_topk, isa, ids + i * k, weights + i * k);
    return 0;
}
