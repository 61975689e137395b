/* Decode attention over a paged KV pool: one query token per request.
 *
 * Why by hand: in PyTorch the same step needs a gather of every context block into a dense
 * tensor and two batched matmuls whose operands are strided views; on CPUs without native
 * bf16 arithmetic those matmuls are emulated and fall back to per-matrix loops. Here each
 * request reads its blocks straight from the pool, once and in address order (all KV heads of
 * a token together, so the hardware prefetcher streams them), converting bf16 to fp32 in
 * registers; the G query heads of a group share every K/V row they read (GQA).
 *
 * Pool layout per layer: [num_slots, 2, Hkv, D]; slot = block * block_size + offset.
 * Softmax is computed online, one block at a time (scores of a block, then one rescale of the
 * running output), so no buffer grows with the context length. When there are fewer requests
 * than threads can share, a request's context is split into partitions whose partial results
 * (output, max, sum) are merged at the end, as in flash-decoding.
 *
 * Built with -ffast-math so that dot-product reductions and expf vectorize (glibc's libmvec);
 * hence no infinities here: -FLT_MAX stands for "no score yet".
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "team.h"
#include "vec8.h"

#define MAX_HEADS 64
#define MAX_HEAD_DIM 256
#define MAX_KV_ROW 1024 /* num_kv_heads * head_dim */
#define TILE 16          /* tokens converted and scored together (a multiple of 8) */
#define MIN_PARTITION_BLOCKS 8
#define PF 32



typedef struct {
    const void *kv;
    int kv_format, block_size, num_kv_heads, group, head_dim; /* kv_format: vec8.h's KV_* */
    float scale;
} Shape;

/* The tile at context position pos: its token count (up to TILE, within one block and the range) and, in
 * first_slot, the pool slot of its first token. */
static inline int next_tile(const Shape *s, const int64_t *blocks, int64_t pos, int64_t end, int64_t *first_slot) {
    const int offset = (int)(pos % s->block_size);
    *first_slot = blocks[pos / s->block_size] * s->block_size + offset;
    const int64_t n = end - pos < s->block_size - offset ? end - pos : s->block_size - offset;
    return n > TILE ? TILE : (int)n;
}

/* Ask for the K/V of the next tile while this one is computed: blocks sit at random places in
 * the pool, so the hardware prefetcher only catches up halfway through each block. */
static inline void prefetch_tokens(const Shape *s, const int64_t *blocks, int64_t pos, int64_t end) {
    int64_t slot;
    const int n = next_tile(s, blocks, pos, end, &slot);
    const size_t token_bytes = 2 * (size_t)s->num_kv_heads * kv_row_bytes(s->kv_format, s->head_dim);
    const char *first = (const char *)s->kv + slot * token_bytes;
    for (size_t off = 0; off < n * token_bytes; off += 64) __builtin_prefetch(first + off);
}

/* Slice `part` of `parts` of what prefetch_tokens asks for: spread over a tile's heads, so the requests trickle
 * out (a whole tile at once is ~200 lines, far more than a core's miss buffers hold: most were dropped). */
static inline void prefetch_tokens_part(const Shape *s, const int64_t *blocks, int64_t pos, int64_t end, int part,
                                        int parts) {
    int64_t slot;
    const int n = next_tile(s, blocks, pos, end, &slot);
    const size_t token_bytes = 2 * (size_t)s->num_kv_heads * kv_row_bytes(s->kv_format, s->head_dim);
    const size_t lines = (n * token_bytes + 63) / 64, first_line = lines * part / parts,
                 last_line = lines * (part + 1) / parts;
    const char *first = (const char *)s->kv + slot * token_bytes;
    for (size_t line = first_line; line < last_line; line++) __builtin_prefetch(first + line * 64);
}

/* Attend all H query heads of one request over tokens [start, end) of its context.
 * Writes the unnormalized output [H, D] plus each head's running max and sum.
 * NOTE: the fp32 tiles are packed (row stride = one token's K or V, not a compile-time
 * maximum): rows 4 KiB apart all map to the same L1 sets and evict each other. */
static void attend_range(const Shape *s, const float *q, const int64_t *blocks, int64_t start, int64_t end,
                         float *acc_out, float *max_out, float *sum_out) {
    const int num_heads = s->num_kv_heads * s->group, d = s->head_dim;
    const int kv_row = s->num_kv_heads * d;  /* K (or V) of all heads of one token, in fp32 */
    float qs[MAX_HEADS * MAX_HEAD_DIM];
    float scores[MAX_HEADS][TILE];
    float keys[TILE * MAX_KV_ROW], values[TILE * MAX_KV_ROW];
    float running_max[MAX_HEADS], running_sum[MAX_HEADS], correction[MAX_HEADS];

    for (int h = 0; h < num_heads; h++) {
#pragma omp simd
        for (int i = 0; i < d; i++) {
            qs[h * d + i] = q[h * d + i] * s->scale;
            acc_out[h * d + i] = 0.0f;
        }
        running_max[h] = -FLT_MAX;
        running_sum[h] = 0.0f;
    }
    for (int64_t pos = start; pos < end;) {
        int64_t first_slot;
        const int n = next_tile(s, blocks, pos, end, &first_slot);
        const int padded = (n + 7) & ~7;
        if (pos + n + PF < end) prefetch_tokens(s, blocks, pos + n + PF, end);
        for (int t = 0; t < n; t++) {
            load_kv_rows(s->kv, s->kv_format, first_slot + t, 0, 0, s->num_kv_heads, s->num_kv_heads, d,
                         keys + t * kv_row);
            load_kv_rows(s->kv, s->kv_format, first_slot + t, 1, 0, s->num_kv_heads, s->num_kv_heads, d,
                         values + t * kv_row);
        }
        if (n < TILE) {  /* zero rows past the tile: dot8 pads to 8 keys, the PV loop runs over all TILE */
            memset(keys + n * kv_row, 0, sizeof(float) * (size_t)(TILE - n) * kv_row);
            memset(values + n * kv_row, 0, sizeof(float) * (size_t)(TILE - n) * kv_row);
        }
        for (int h = 0; h < num_heads; h++) {
            const float *k = keys + (h / s->group) * d;
            for (int t = 0; t < padded; t += 8) {
                const f32x8 sc = dot8(qs + h * d, k + t * kv_row, kv_row, d);
                memcpy(&scores[h][t], &sc, sizeof sc);
            }
            float block_max = -FLT_MAX;
            for (int t = 0; t < n; t++)
                if (scores[h][t] > block_max) block_max = scores[h][t];
            const float new_max = block_max > running_max[h] ? block_max : running_max[h];
            correction[h] = expf(running_max[h] - new_max);  /* 0 on the first block */
            float block_sum = 0.0f;
#pragma omp simd reduction(+ : block_sum)
            for (int t = 0; t < TILE; t++) {
                scores[h][t] = t < n ? expf(scores[h][t] - new_max) : 0.0f;
                block_sum += scores[h][t];
            }
            running_sum[h] = running_sum[h] * correction[h] + block_sum;
            running_max[h] = new_max;
        }
        /* acc = acc * correction + sum_t p_t v_t, one 8-float chunk at a time so the partial
         * sum stays in a register across the tile's tokens. */
        for (int h = 0; h < num_heads; h++) {
            const float *v = values + (h / s->group) * d;
            float *acc = acc_out + h * d;
            for (int i = 0; i < d; i += 8) {
                f32x8 a = load8(acc + i) * correction[h];
                for (int t = 0; t < TILE; t++) a += scores[h][t] * load8(v + t * kv_row + i);  /* unrolled */
                memcpy(acc + i, &a, sizeof a);
            }
        }
        pos += n;
    }
    for (int h = 0; h < num_heads; h++) {
        max_out[h] = running_max[h];
        sum_out[h] = running_sum[h];
    }
}

/* ---- Quantized K/V (KV_INT8, KV_FP8): computed over the codes, never dequantized.
 * A row is codes c and a scale s (value = c * s), so q . k = s * (q . c) and p * v = (p * s) * c: the
 * scales multiply a score and a probability once per token and head, and the codes become fp32 in
 * registers (exact: int8 by conversion, fp8 through fp16, see vec8.h's fp8_codes_scaled) right before the
 * FMAs, CODE_LANES at a time, shared by the G query heads of the KV head. That removes the fp32 tiles (a
 * store and a reload of every element) and the per-element scale multiplies of load_kv_rows.
 * NOTE: q stays fp32. Integer dot products (VNNI over int8 q codes) would be ~3x fewer instructions for
 * q . c, but int8 q costs 6e-4..8e-3 in the output (random data), and the kernel must match fp32 attention
 * over the dequantized pool to 1e-5 (tests/kv/test_kv_quantization.py); a three-level int8 split of q that
 * would keep that precision needs three dot instructions per 64 codes, as many as the FMAs they save. */
#define QHEADS 4 /* query heads scored per pass over a tile's codes: their accumulators stay in registers */
_Static_assert(TILE % CODE_LANES == 0, "a tile is whole code vectors");

static inline cvec codes_to_f32(int f, const uint8_t *p) {
    return f == KV_INT8 ? int8_codes(p) : fp8_codes_scaled(p);
}

/* The scales of the tile's n tokens' K and V rows of every KV head, times `unit`, into scales[which][g][t]
 * (zero past n: padded tokens get a zero score and a zero weight). Gathered once per tile into an array,
 * and read long after: a vector read right after 16 scalar writes would stall on store forwarding. */
static void tile_scales(const uint8_t *tile, int64_t token_bytes, int64_t row, int num_kv_heads, int d, int n,
                        float unit, float (*scales)[TILE]) {
    for (int r = 0; r < 2 * num_kv_heads; r++) {  /* K rows of every head, then V rows: the slot's order */
        for (int t = 0; t < n; t++) {
            memcpy(&scales[r][t], tile + t * token_bytes + r * row + d, sizeof(float));
            scales[r][t] *= unit;
        }
        for (int t = n; t < TILE; t++) scales[r][t] = 0.0f;
    }
}

/* acc[h][t0 + j] = qs[h] . c_{t0 + j} for nt consecutive tokens (1 or 4 after inlining) and nh heads: each
 * chunk of CODE_LANES codes is converted once for all nh heads, each q chunk loaded once for all nt tokens. */
static inline __attribute__((always_inline)) void dot_codes(int f, const uint8_t *k, int64_t stride, int t0,
                                                             const int nt, int d, const float *qs, const int nh,
                                                             cvec (*acc)[TILE]) {
    cvec a[QHEADS][4];
    for (int h = 0; h < nh; h++)
        for (int j = 0; j < nt; j++) a[h][j] = (cvec){0};
    for (int i = 0; i < d; i += CODE_LANES) {
        cvec c[4];
        for (int j = 0; j < nt; j++) c[j] = codes_to_f32(f, k + (t0 + j) * stride + i);
        for (int h = 0; h < nh; h++) {
            const cvec qv = load_cvec(qs + h * d + i);
            for (int j = 0; j < nt; j++) a[h][j] += qv * c[j];
        }
    }
    for (int h = 0; h < nh; h++)
        for (int j = 0; j < nt; j++) acc[h][t0 + j] = a[h][j];
}

/* dots[h][t] = qs[h] . c_t over the tile's n key rows (codes, `stride` bytes apart), for nh heads (a
 * constant 1..QHEADS after inlining); the per-token lane sums are done CODE_LANES tokens at a time. */
static inline __attribute__((always_inline)) void score_codes(int f, const uint8_t *k, int64_t stride, int n,
                                                               int d, const float *qs, const int nh,
                                                               float (*dots)[TILE]) {
    cvec acc[QHEADS][TILE];
    int t = 0;
    for (; t + 4 <= n; t += 4) dot_codes(f, k, stride, t, 4, d, qs, nh, acc);
    for (; t < n; t++) dot_codes(f, k, stride, t, 1, d, qs, nh, acc);
    for (; t < TILE; t++)
        for (int h = 0; h < nh; h++) acc[h][t] = (cvec){0};
    for (int h = 0; h < nh; h++)
        for (int t0 = 0; t0 < TILE; t0 += CODE_LANES) {
            const cvec sums = lane_sums(acc[h] + t0);
            memcpy(dots[h] + t0, &sums, sizeof sums);
        }
}

/* acc[h][:] = acc[h][:] * correction[h] + sum_t w[h][t] * c_t over the tile's n value rows, for nh heads:
 * CODE_LANES dimensions at a time, the nh partial sums in registers across the tokens. */
static inline __attribute__((always_inline)) void accumulate_codes(int f, const uint8_t *v, int64_t stride, int n,
                                                                    int d, const float (*w)[TILE], const int nh,
                                                                    const float *correction, float *acc) {
    for (int i = 0; i < d; i += CODE_LANES) {
        cvec a[QHEADS];
        for (int h = 0; h < nh; h++) a[h] = load_cvec(acc + h * d + i) * correction[h];
        for (int t = 0; t < n; t++) {
            const cvec c = codes_to_f32(f, v + t * stride + i);
            for (int h = 0; h < nh; h++) a[h] += w[h][t] * c;
        }
        for (int h = 0; h < nh; h++) memcpy(acc + h * d + i, &a[h], sizeof a[h]);
    }
}

/* One tile's online-softmax step for one head, from its n scores: updates the running max and sum, returns
 * the correction of the running output and writes the probabilities times the V scales (w, zero past n). */
static inline float softmax_tile(const float *scores, int n, const float *v_scales, float *running_max,
                                 float *running_sum, float *w) {
    float block_max = -FLT_MAX;
#pragma omp simd reduction(max : block_max)
    for (int t = 0; t < TILE; t++)
        if (t < n && scores[t] > block_max) block_max = scores[t];
    float correction = 1.0f;  /* exactly expf(0): skip the call when the max stays, as it mostly does */
    if (block_max > *running_max) {
        correction = expf(*running_max - block_max);  /* 0 on the first tile */
        *running_max = block_max;
    }
    const float m = *running_max;
    float block_sum = 0.0f;
#pragma omp simd reduction(+ : block_sum)
    for (int t = 0; t < TILE; t++) {
        const float p = t < n ? expf(scores[t] - m) : 0.0f;
        block_sum += p;
        w[t] = p * v_scales[t];
    }
    *running_sum = *running_sum * correction + block_sum;
    return correction;
}

/* Scores, softmax step and output update of query heads [h0, h0 + nh) of KV head g over one tile. */
static inline __attribute__((always_inline)) void attend_tile_quant(const Shape *s, const uint8_t *k,
                                                                     const uint8_t *v, int64_t stride, int n,
                                                                     const float *k_scales, const float *v_scales,
                                                                     const float *qs, int h0, const int nh,
                                                                     float *acc_out, float *running_max,
                                                                     float *running_sum) {
    const int d = s->head_dim;
    float dots[QHEADS][TILE], w[QHEADS][TILE], correction[QHEADS];
    score_codes(s->kv_format, k, stride, n, d, qs + h0 * d, nh, dots);
    for (int h = 0; h < nh; h++) {
        float scores[TILE];
#pragma omp simd
        for (int t = 0; t < TILE; t++) scores[t] = dots[h][t] * k_scales[t];
        correction[h] = softmax_tile(scores, n, v_scales, running_max + h0 + h, running_sum + h0 + h, w[h]);
    }
    accumulate_codes(s->kv_format, v, stride, n, d, (const float (*)[TILE])w, nh, correction, acc_out + h0 * d);
}

/* attend_range for KV_INT8 / KV_FP8 pools with head_dim a multiple of 16 (same outputs, up to fp32
 * rounding). Loops over KV heads inside the tile: a tile's rows of all heads are a few KiB, still in L1. */
static void attend_range_quant(const Shape *s, const float *q, const int64_t *blocks, int64_t start, int64_t end,
                               float *acc_out, float *max_out, float *sum_out) {
    const int num_heads = s->num_kv_heads * s->group, d = s->head_dim;
    const int64_t row = kv_row_bytes(s->kv_format, d), token_bytes = 2 * s->num_kv_heads * row;
    const float unit = s->kv_format == KV_FP8 ? FP8_SCALED_UNIT : 1.0f;
    float qs[MAX_HEADS * MAX_HEAD_DIM], scales[2 * MAX_HEADS][TILE];
    for (int h = 0; h < num_heads; h++) {
        for (int i = 0; i < d; i++) {
            qs[h * d + i] = q[h * d + i] * s->scale;
            acc_out[h * d + i] = 0.0f;
        }
        max_out[h] = -FLT_MAX;
        sum_out[h] = 0.0f;
    }
    for (int64_t pos = start; pos < end;) {
        int64_t first_slot;
        const int n = next_tile(s, blocks, pos, end, &first_slot);
        if (pos + n + PF < end) prefetch_tokens(s, blocks, pos + n + PF, end);
        const uint8_t *tile = (const uint8_t *)s->kv + first_slot * token_bytes;
        tile_scales(tile, token_bytes, row, s->num_kv_heads, d, n, unit, scales);
        for (int g = 0; g < s->num_kv_heads; g++) {
            const uint8_t *k = tile + g * row, *v = tile + (s->num_kv_heads + g) * row;
            const float *ks = scales[g], *vs = scales[s->num_kv_heads + g];
            for (int h = g * s->group; h < (g + 1) * s->group; h += QHEADS) {
                const int nh = (g + 1) * s->group - h;
                /* constant head counts, so each call inlines with its accumulators in registers */
                float *acc = acc_out, *m = max_out, *sum = sum_out;
                if (nh >= 4) attend_tile_quant(s, k, v, token_bytes, n, ks, vs, qs, h, 4, acc, m, sum);
                else if (nh == 3) attend_tile_quant(s, k, v, token_bytes, n, ks, vs, qs, h, 3, acc, m, sum);
                else if (nh == 2) attend_tile_quant(s, k, v, token_bytes, n, ks, vs, qs, h, 2, acc, m, sum);
                else attend_tile_quant(s, k, v, token_bytes, n, ks, vs, qs, h, 1, acc, m, sum);
            }
        }
        pos += n;
    }
}

static inline int quant_path(const Shape *s) {
    return (s->kv_format == KV_INT8 || s->kv_format == KV_FP8) && s->head_dim % 16 == 0;
}

/* ---- bf16 pools on CPUs with AVX512-BF16: q . k by `vdpbf16ps` straight from the pool, 16-lane PV ----
 * The fp32 path above converts every K and V row into an fp32 tile first and scores with 8-lane vectors; on a
 * batch-1 decode of the default model that reached ~20 GB/s of a ~50 GB/s machine (Zen 4). Here a KV head's
 * K row is multiplied by its G query heads as bf16 pairs with fp32 sums (exact products: q is a bf16 model's
 * activation, checked by the caller), 16 tokens' partial dot products are summed across lanes together (a
 * four-level add tree, no per-token horizontal sum), and each V row is widened once in registers and
 * FMA'd into the G heads' 16-lane accumulators. The scale multiplies the scores (not q), so q stays exact. */
#if defined(__AVX512BF16__)
#include "bf16x16.h"

#define PF_BF16 16
#define BH_HEADS 4    /* query heads whose PV accumulators stay in registers together */
#define BH_CHUNK 64   /* head dims per pass of PV: 4 vectors of 16 floats */

/* Lane j of the add tree's result holds the sum of accumulator j's token TREE_ORDER[j] (a 4x4 transpose, its
 * own inverse): so accumulator j is fed the token TREE_ORDER[j] and lane t ends up with token t. */
static const int TREE_ORDER[TILE] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

/* Sixteen 16-lane vectors -> one: lane j = the sum of a[TREE_ORDER[j]]'s lanes. */
static inline __m512 sum_lanes16(__m512 a[TILE]) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        d[i] = _mm512_add_ps(_mm512_unpacklo_ps(c[2 * i], c[2 * i + 1]), _mm512_unpackhi_ps(c[2 * i], c[2 * i + 1]));
    return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x44), _mm512_shuffle_ps(d[0], d[1], 0xEE));
}

/* The tile's 16 scores of one query head (lane t: q . k_t; rows `stride` elements apart, zero past n): every
 * token's D/32 `vdpbf16ps` into its own accumulator, then one add tree across them. */
static inline __attribute__((always_inline)) __m512 score_tile_bf16(const uint16_t *q, const uint16_t *k,
                                                                     int64_t stride, int n, const int d) {
    __m512 acc[TILE];
    if (n == TILE) {  /* the common case, branch-free */
        for (int j = 0; j < TILE; j++) {
            __m512 a = _mm512_setzero_ps();
            for (int i = 0; i < d; i += 32)
                a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(q + i),
                                     (__m512bh)_mm512_loadu_si512(k + TREE_ORDER[j] * stride + i));
            acc[j] = a;
        }
    } else {
        for (int j = 0; j < TILE; j++) {
            __m512 a = _mm512_setzero_ps();
            if (TREE_ORDER[j] < n)
                for (int i = 0; i < d; i += 32)
                    a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(q + i),
                                         (__m512bh)_mm512_loadu_si512(k + TREE_ORDER[j] * stride + i));
            acc[j] = a;
        }
    }
    return sum_lanes16(acc);
}

static inline __m512 widen16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* acc[h][:] = acc[h][:] * correction[h] + sum_t w[h][t] v_t for nh (1..BH_HEADS) heads over dims [c0, c0 + vecs * 16). */
static inline __attribute__((always_inline)) void accumulate_bf16(const uint16_t *v, int64_t stride, int n,
                                                                   const float (*w)[TILE], const int nh,
                                                                   const float *correction, float *acc, const int d,
                                                                   int c0, const int vecs) {
    __m512 a[BH_HEADS][BH_CHUNK / 16];
    for (int h = 0; h < nh; h++)
        for (int c = 0; c < vecs; c++)
            a[h][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + h * d + c0 + 16 * c), _mm512_set1_ps(correction[h]));
    for (int t = 0; t < n; t++) {
        for (int c = 0; c < vecs; c++) {
            const __m512 vv = widen16(v + t * stride + c0 + 16 * c);
            for (int h = 0; h < nh; h++) a[h][c] = _mm512_fmadd_ps(_mm512_set1_ps(w[h][t]), vv, a[h][c]);
        }
    }
    for (int h = 0; h < nh; h++)
        for (int c = 0; c < vecs; c++) _mm512_storeu_ps(acc + h * d + c0 + 16 * c, a[h][c]);
}

/* PV of query heads [h, h + nh) of one KV head over the tile, BH_CHUNK dims at a time (constants inlined). */
static inline __attribute__((always_inline)) void accumulate_heads(const uint16_t *v, int64_t stride, int n,
                                                                    const float (*w)[TILE], const int nh,
                                                                    const float *correction, float *acc,
                                                                    const int d) {
    int c0 = 0;
    for (; c0 + BH_CHUNK <= d; c0 += BH_CHUNK)
        accumulate_bf16(v, stride, n, w, nh, correction, acc, d, c0, BH_CHUNK / 16);
    if (c0 < d)  /* d % 32 == 0: one 32-dim rest at most */
        accumulate_bf16(v, stride, n, w, nh, correction, acc, d, c0, 2);
}

static inline __attribute__((always_inline)) void attend_range_bf16_d(const Shape *s, const float *q,
                                                                       const int64_t *blocks, int64_t start,
                                                                       int64_t end, float *acc_out, float *max_out,
                                                                       float *sum_out, const int d) {
    const int num_heads = s->num_kv_heads * s->group, g_size = s->group;
    const int64_t token = 2 * (int64_t)s->num_kv_heads * d;  /* elements per slot */
    uint16_t qb[MAX_HEADS * MAX_HEAD_DIM];
    float w[MAX_HEADS][TILE], correction[MAX_HEADS];
    const __m512 scale = _mm512_set1_ps(s->scale);
    if (start < end) prefetch_tokens(s, blocks, start, end);  /* the first tile, while q is converted */
    for (int h = 0; h < num_heads; h++) {
        for (int i = 0; i < d; i++) {
            qb[h * d + i] = f32_to_bf16(q[h * d + i]);  /* exact: the caller checked */
            acc_out[h * d + i] = 0.0f;
        }
        max_out[h] = -FLT_MAX;
        sum_out[h] = 0.0f;
    }
    for (int64_t pos = start; pos < end;) {
        int64_t first_slot;
        const int n = next_tile(s, blocks, pos, end, &first_slot);
        const int64_t ahead = pos + n + PF_BF16;
        const uint16_t *tile = (const uint16_t *)s->kv + first_slot * token;
        const __mmask16 valid = (__mmask16)((1u << n) - 1u);
        for (int g = 0; g < s->num_kv_heads; g++) {
            for (int h = g * g_size; h < (g + 1) * g_size; h++) {
                if (ahead < end) prefetch_tokens_part(s, blocks, ahead, end, h, num_heads);
                __m512 sc = _mm512_mul_ps(score_tile_bf16(qb + h * d, tile + g * d, token, n, d), scale);
                sc = _mm512_mask_mov_ps(_mm512_set1_ps(-FLT_MAX), valid, sc);
                const float block_max = _mm512_reduce_max_ps(sc);
                correction[h] = 1.0f;  /* exactly: the max mostly stays */
                if (block_max > max_out[h]) {
                    correction[h] = expf(max_out[h] - block_max);  /* 0 on the first tile */
                    max_out[h] = block_max;
                }
                const __m512 p = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(sc, _mm512_set1_ps(max_out[h]))));
                sum_out[h] = sum_out[h] * correction[h] + _mm512_reduce_add_ps(p);
                _mm512_storeu_ps(w[h], p);
            }
            const uint16_t *v = tile + (s->num_kv_heads + g) * d;
            for (int h = g * g_size; h < (g + 1) * g_size; h += BH_HEADS) {
                const int nh = (g + 1) * g_size - h < BH_HEADS ? (g + 1) * g_size - h : BH_HEADS;
                const float (*wh)[TILE] = (const float (*)[TILE])w[h];
                float *acc = acc_out + h * d;
                /* constant head counts, so each call inlines with its accumulators in registers */
                if (nh == 4) accumulate_heads(v, token, n, wh, 4, correction + h, acc, d);
                else if (nh == 3) accumulate_heads(v, token, n, wh, 3, correction + h, acc, d);
                else if (nh == 2) accumulate_heads(v, token, n, wh, 2, correction + h, acc, d);
                else accumulate_heads(v, token, n, wh, 1, correction + h, acc, d);
            }
        }
        pos += n;
    }
}

/* attend_range for bf16 pools and bf16-valued q (head_dim a multiple of 32): the common head dims compiled
 * with the dimension as a constant (loops unrolled, accumulators in registers). */
static void attend_range_bf16(const Shape *s, const float *q, const int64_t *blocks, int64_t start, int64_t end,
                              float *acc_out, float *max_out, float *sum_out) {
    if (s->head_dim == 64) attend_range_bf16_d(s, q, blocks, start, end, acc_out, max_out, sum_out, 64);
    else if (s->head_dim == 128) attend_range_bf16_d(s, q, blocks, start, end, acc_out, max_out, sum_out, 128);
    else attend_range_bf16_d(s, q, blocks, start, end, acc_out, max_out, sum_out, s->head_dim);
}

#endif

static void attend(const Shape *s, const float *q, const int64_t *blocks, int64_t start, int64_t end,
                   float *acc_out, float *max_out, float *sum_out) {
#if defined(__AVX512BF16__)
    if (s->kv_format == KV_BF16 && s->head_dim % 32 == 0
        && q_is_bf16(q, (int64_t)s->num_kv_heads * s->group * s->head_dim)) {
        attend_range_bf16(s, q, blocks, start, end, acc_out, max_out, sum_out);
        return;
    }
#endif
    if (quant_path(s)) attend_range_quant(s, q, blocks, start, end, acc_out, max_out, sum_out);
    else attend_range(s, q, blocks, start, end, acc_out, max_out, sum_out);
}

/* Without allow_split (batch-invariant serving) a context is still split, but at boundaries that depend on that
 * query's own context length only (not on the batch, its widest context or the thread count): into parts of a
 * multiple of INVARIANT_PARTITION_TOKENS tokens, at most INVARIANT_MAX_PARTS of them, merged in their order. So
 * each query's sums still happen in one order of its own, and a batch-1 decode is not left to one thread (it
 * was: 576 tokens of attention on one of 2 cores cost ~18% of a decode step). The cap bounds the partial sums'
 * scratch (a 2048-token per-token prefill chunk: ~40 MB, whatever the context). */
#define INVARIANT_PARTITION_TOKENS 128
#define INVARIANT_MAX_PARTS 8

/* Without allow_split: tokens per part of a context of `context` tokens (the smallest multiple of
 * INVARIANT_PARTITION_TOKENS that splits it into at most INVARIANT_MAX_PARTS parts). */
static int64_t invariant_part_tokens(int64_t context) {
    const int64_t per_part = (context + INVARIANT_MAX_PARTS - 1) / INVARIANT_MAX_PARTS;
    const int64_t units = (per_part + INVARIANT_PARTITION_TOKENS - 1) / INVARIANT_PARTITION_TOKENS;
    return (units > 1 ? units : 1) * INVARIANT_PARTITION_TOKENS;
}

/* Partitions per request: enough to give every thread ~4 work items, none shorter than MIN_PARTITION_BLOCKS
 * blocks (below that the merge costs more than it spreads), and a whole number of items per thread where that
 * leaves more than one (5 partitions on 2 threads took as long as 6); without allow_split, as many as the widest
 * context the block table holds could have (a query with fewer leaves the rest empty: they are skipped). */
static int64_t partitions(int64_t batch, int64_t max_blocks, int block_size, int num_threads, int allow_split) {
    if (!allow_split) {  /* a context of c tokens has at most min(cap, ceil(c / 128)) parts */
        const int64_t parts = (max_blocks * block_size + INVARIANT_PARTITION_TOKENS - 1) / INVARIANT_PARTITION_TOKENS;
        return parts < 1 ? 1 : parts > INVARIANT_MAX_PARTS ? INVARIANT_MAX_PARTS : parts;
    }
    int64_t parts = (4 * (int64_t)num_threads + batch - 1) / batch;
    if (parts > max_blocks / MIN_PARTITION_BLOCKS) parts = max_blocks / MIN_PARTITION_BLOCKS;
    if (parts < 1) return 1;
    for (int64_t fewer = parts; fewer > 1; fewer--)
        if (batch * fewer % num_threads == 0) return fewer;
    return parts;
}

/* Tokens per partition of a context of `context` tokens: whole blocks, the same for every query, with
 * allow_split; the query's own invariant_part_tokens without. */
static int64_t partition_tokens(int64_t parts, int64_t max_blocks, int block_size, int allow_split, int64_t context) {
    if (!allow_split) return invariant_part_tokens(context);
    return ((max_blocks * block_size + parts - 1) / parts + block_size - 1) / block_size * block_size;
}

/* Floats of scratch kvbaton_paged_decode_attention_team needs for these arguments (0: none). */
int64_t kvbaton_paged_decode_attention_scratch(int64_t batch, int64_t max_blocks, int block_size, int num_heads,
                                               int head_dim, int num_threads, int allow_split) {
    const int64_t parts = partitions(batch, max_blocks, block_size, num_threads, allow_split);
    return parts > 1 ? batch * parts * ((int64_t)num_heads * head_dim + 2 * num_heads) : 0;
}

/* The attention on the calling team (team.h),
 * partial results in `scratch` (kvbaton_paged_decode_attention_scratch floats, shared by the team). */
int kvbaton_paged_decode_attention_team(const void *kv_cache, int kv_format, const float *q, float *out,
                                        const int64_t *block_tables, const int64_t *context_lens, int64_t batch,
                                        int64_t max_blocks, int block_size, int num_kv_heads, int group,
                                        int head_dim, float scale, int num_threads, int allow_split,
                                        float *scratch) {
    const int num_heads = num_kv_heads * group;
    if (num_heads > MAX_HEADS || head_dim > MAX_HEAD_DIM || head_dim % 8 || num_kv_heads * head_dim > MAX_KV_ROW
        || !kv_format_ok(kv_format))
        return -1;
    const Shape shape = {kv_cache, kv_format, block_size, num_kv_heads, group, head_dim, scale};
    const int64_t parts = partitions(batch, max_blocks, block_size, num_threads, allow_split);
    const int64_t hd = (int64_t)num_heads * head_dim;
    float *acc = scratch, *maxes = scratch + batch * parts * hd, *sums = maxes + batch * parts * num_heads;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < batch * parts; item++) {
        const int64_t b = item / parts, p = item % parts;
        const int64_t part_tokens = partition_tokens(parts, max_blocks, block_size, allow_split, context_lens[b]);
        const int64_t start = p * part_tokens;
        int64_t end = start + part_tokens;
        if (end > context_lens[b]) end = context_lens[b];
        const int64_t *blocks = block_tables + b * max_blocks;
        if (parts == 1) {
            float maxes1[MAX_HEADS], sums1[MAX_HEADS];
            float *o = out + b * hd;
            attend(&shape, q + b * hd, blocks, start, end, o, maxes1, sums1);
            for (int h = 0; h < num_heads; h++) {
                const float inv = 1.0f / sums1[h];
                for (int i = 0; i < head_dim; i++) o[h * head_dim + i] *= inv;
            }
        } else if (start < end) {
            attend(&shape, q + b * hd, blocks, start, end, acc + item * hd, maxes + item * num_heads,
                         sums + item * num_heads);
        } else {
            for (int h = 0; h < num_heads; h++) maxes[item * num_heads + h] = -FLT_MAX, sums[item * num_heads + h] = 0;
        }
    }
    if (parts > 1) {
#pragma omp for
        for (int64_t bh = 0; bh < batch * num_heads; bh++) {
            const int64_t b = bh / num_heads;
            const int h = (int)(bh % num_heads);
            float m = -FLT_MAX, total = 0.0f;
            for (int64_t p = 0; p < parts; p++) {
                const float mp = maxes[(b * parts + p) * num_heads + h];
                if (mp > m) m = mp;
            }
            float *o = out + b * hd + (int64_t)h * head_dim;
            for (int i = 0; i < head_dim; i++) o[i] = 0.0f;
            for (int64_t p = 0; p < parts; p++) {
                const int64_t item = b * parts + p;
                const float sp = sums[item * num_heads + h];
                if (sp == 0.0f) continue;  /* an empty partition past the context end */
                const float w = expf(maxes[item * num_heads + h] - m);
                total += sp * w;
                const float *a = acc + item * hd + (int64_t)h * head_dim;
                for (int i = 0; i < head_dim; i++) o[i] += w * a[i];
            }
            const float inv = 1.0f / total;
            for (int i = 0; i < head_dim; i++) o[i] *= inv;
        }
    }
    return 0;
}

/* q: [B, H, D] fp32 (the G query heads of a KV head adjacent); out: [B, H, D] fp32;
 * block_tables: [B, max_blocks] int64; context_lens: [B] int64 (each >= 1); allow_split: 0 keeps every
 * request's context in one partition (batch-invariant sums, for deterministic serving).
 * Returns 0; -1 for shapes this kernel does not handle (the caller then uses PyTorch);
 * -2 when out of memory. */
int kvbaton_paged_decode_attention(const void *kv_cache, int kv_format, const float *q, float *out,
                                   const int64_t *block_tables, const int64_t *context_lens, int64_t batch,
                                   int64_t max_blocks, int block_size, int num_kv_heads, int group,
                                   int head_dim, float scale, int num_threads, int allow_split) {
    const int64_t floats = kvbaton_paged_decode_attention_scratch(batch, max_blocks, block_size, num_kv_heads * group,
                                                                  head_dim, num_threads, allow_split);
    float *scratch = floats ? malloc(sizeof(float) * floats) : NULL;
    if (floats && !scratch) return -2;
    const int rc = ON_TEAM(num_threads, kvbaton_paged_decode_attention_team(
                                            kv_cache, kv_format, q, out, block_tables, context_lens, batch,
                                            max_blocks, block_size, num_kv_heads, group, head_dim, scale,
                                            num_threads, allow_split, scratch));
    free(scratch);
    return rc;
}
