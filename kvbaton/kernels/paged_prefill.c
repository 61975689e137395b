/* Causal attention of a prefill chunk over a paged KV pool: many query tokens of one request.
 *
 * Why by hand: PyTorch's CPU flash attention splits keys into blocks of 512, so a causal
 * 512-token prompt computes (and masks) the full square, at ~40 GFLOP/s on AVX2. Here a work
 * item is one KV head and a tile of query tokens: the G query heads of those tokens (GQA) form
 * up to 64 rows that share every K/V row read, keys stop at the tile's last position (causal:
 * half the square), and K/V come straight from the pool through the block table, so a chunk
 * with earlier context (chunked prefill, prefix-cache hits) needs no gather and no mask tensor.
 * Softmax is online per key tile, as in the decode kernel (paged_attention.c).
 *
 * Pool layout per layer: [num_slots, 2, Hkv, D]; slot = block * block_size + offset.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec8.h"

#define MAX_ROWS 48        /* query rows (tokens x group) per work item */
#define TARGET_ROWS 24     /* rows per work item when the group allows: 3 vectors of 8 */
#define MAX_HEAD_DIM 256
#define KEY_TILE 16        /* keys converted and scored together (a multiple of 4) */

typedef struct {
    const void *kv;
    int kv_format, block_size, num_kv_heads, group, head_dim; /* kv_format: vec8.h's KV_* */
    float scale;
} Shape;

/* Scores of 4 keys against nv * 8 query rows (qt: [d][ld], the queries transposed), written as
 * scores[key][row] (row stride ld): the queries' 8-row vectors are loaded once per dimension and
 * each key element is broadcast, so no horizontal sums are needed. nv is 1-3 after inlining. */
static inline __attribute__((always_inline)) void score_block(const float *keys, int d, const float *qt, int ld,
                                                               const int nv, float *scores) {
    f32x8 acc[4][3];
    for (int kk = 0; kk < 4; kk++)
        for (int v = 0; v < nv; v++) acc[kk][v] = (f32x8){0};
    for (int i = 0; i < d; i++) {
        f32x8 q[3];
        for (int v = 0; v < nv; v++) q[v] = load8(qt + (int64_t)i * ld + 8 * v);
        for (int kk = 0; kk < 4; kk++) {
            const float kb = keys[kk * d + i];
            for (int v = 0; v < nv; v++) acc[kk][v] += q[v] * kb;
        }
    }
    for (int kk = 0; kk < 4; kk++)
        for (int v = 0; v < nv; v++) memcpy(scores + kk * ld + 8 * v, &acc[kk][v], sizeof(f32x8));
}

/* acc[r][c0 .. c0 + 8 nv) = acc * correction[r] + sum over the tile's keys of p[key][r] * v[key][..]
 * for nr rows starting at r0: a 6 x 16 register tile like the GEMM's (nr 1-6, nv 1-2 after inlining). */
static inline __attribute__((always_inline)) void value_block(const float *p, int ld, int r0, const int nr,
                                                               const float *values, int d, int c0, const int nv,
                                                               const float *correction, float *acc) {
    f32x8 a[6][2];
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < nv; v++) a[r][v] = load8(acc + (int64_t)(r0 + r) * d + c0 + 8 * v) * correction[r0 + r];
    for (int t = 0; t < KEY_TILE; t++) {
        f32x8 vv[2];
        for (int v = 0; v < nv; v++) vv[v] = load8(values + t * d + c0 + 8 * v);
        for (int r = 0; r < nr; r++) {
            const float pr = p[t * ld + r0 + r];
            for (int v = 0; v < nv; v++) a[r][v] += vv[v] * pr;
        }
    }
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < nv; v++) memcpy(acc + (int64_t)(r0 + r) * d + c0 + 8 * v, &a[r][v], sizeof(f32x8));
}

#define VALUE_CASE(NR) \
    case NR: \
        if (nv == 2) value_block(p, ld, r0, NR, values, d, c0, 2, correction, acc); \
        else value_block(p, ld, r0, NR, values, d, c0, 1, correction, acc); \
        break;

/* Query tokens [first, first + count) of the chunk, KV head g; token i sits at context position
 * pos0 + i and sees keys [0, pos0 + i]. q, out: [T, H, D] fp32. */
static void attend_tile(const Shape *s, const float *q, float *out, const int64_t *blocks, int64_t pos0, int first,
                        int count, int g) {
    const int d = s->head_dim, group = s->group, rows = count * group, num_heads = s->num_kv_heads * group;
    const int ld = (rows + 7) & ~7;  /* row stride of the transposed queries and of the scores */
    float qt[MAX_HEAD_DIM * MAX_ROWS], acc[MAX_ROWS * MAX_HEAD_DIM];
    float keys[KEY_TILE * MAX_HEAD_DIM], values[KEY_TILE * MAX_HEAD_DIM];
    float scores[KEY_TILE * MAX_ROWS];
    float running_max[MAX_ROWS], running_sum[MAX_ROWS], correction[MAX_ROWS];
    int64_t last_key[MAX_ROWS];  /* the last position each row sees */

    /* row r: token first + r / group, head g * group + r % group; rows past `rows` are zero padding */
    memset(qt, 0, sizeof(float) * (size_t)d * ld);
    for (int r = 0; r < rows; r++) {
        const float *src = q + ((int64_t)(first + r / group) * num_heads + g * group + r % group) * d;
        for (int i = 0; i < d; i++) qt[i * ld + r] = src[i] * s->scale;
        last_key[r] = pos0 + first + r / group;
    }
    for (int r = rows; r < ld; r++) last_key[r] = INT64_MAX;  /* padding rows: every key, never read */
    memset(acc, 0, sizeof(float) * (size_t)ld * d);
    for (int r = 0; r < ld; r++) running_max[r] = -FLT_MAX, running_sum[r] = 0.0f;

    const int64_t end = pos0 + first + count;  /* keys the last token of the tile sees */
    for (int64_t pos = 0; pos < end;) {
        const int64_t block = blocks[pos / s->block_size];
        const int offset = (int)(pos % s->block_size);
        int n = (int)((end - pos) < (s->block_size - offset) ? end - pos : s->block_size - offset);
        if (n > KEY_TILE) n = KEY_TILE;
        const int64_t first_slot = block * s->block_size + offset;
        for (int t = 0; t < n; t++) {
            load_kv_rows(s->kv, s->kv_format, first_slot + t, 0, g, 1, s->num_kv_heads, d, keys + t * d);
            load_kv_rows(s->kv, s->kv_format, first_slot + t, 1, g, 1, s->num_kv_heads, d, values + t * d);
        }
        if (n < KEY_TILE) {  /* zero keys and values past the tile: the loops below run over all 16 */
            memset(keys + n * d, 0, sizeof(float) * (size_t)(KEY_TILE - n) * d);
            memset(values + n * d, 0, sizeof(float) * (size_t)(KEY_TILE - n) * d);
        }
        const int scored = (n + 3) & ~3;
        for (int t = 0; t < scored; t += 4)
            for (int c = 0; c < ld; c += 24) {
                const int nv = (ld - c) / 8 < 3 ? (ld - c) / 8 : 3;
                if (nv == 3) score_block(keys + t * d, d, qt + c, ld, 3, scores + t * ld + c);
                else if (nv == 2) score_block(keys + t * d, d, qt + c, ld, 2, scores + t * ld + c);
                else score_block(keys + t * d, d, qt + c, ld, 1, scores + t * ld + c);
            }
        /* online softmax, vectorized across rows: mask the future, new max, rescale, exponentiate */
        float tile_max[MAX_ROWS];
        for (int r = 0; r < ld; r++) tile_max[r] = -FLT_MAX;
        for (int t = 0; t < KEY_TILE; t++) {
            float *sc = scores + t * ld;
#pragma omp simd
            for (int r = 0; r < ld; r++) {
                const int visible = t < n && pos + t <= last_key[r];
                sc[r] = visible ? sc[r] : -FLT_MAX;
                tile_max[r] = sc[r] > tile_max[r] ? sc[r] : tile_max[r];
            }
        }
#pragma omp simd
        for (int r = 0; r < ld; r++) {
            const float new_max = tile_max[r] > running_max[r] ? tile_max[r] : running_max[r];
            correction[r] = expf(running_max[r] - new_max);  /* 0 on the first tile */
            running_sum[r] *= correction[r];
            running_max[r] = new_max;
        }
        for (int t = 0; t < KEY_TILE; t++) {
            float *sc = scores + t * ld;
#pragma omp simd
            for (int r = 0; r < ld; r++) {
                sc[r] = sc[r] == -FLT_MAX ? 0.0f : expf(sc[r] - running_max[r]);
                running_sum[r] += sc[r];
            }
        }
        const float *p = scores;
        for (int r0 = 0; r0 < ld; r0 += 6) {
            const int nr = ld - r0 < 6 ? ld - r0 : 6;
            for (int c0 = 0; c0 < d; c0 += 16) {
                const int nv = d - c0 >= 16 ? 2 : 1;
                switch (nr) { VALUE_CASE(1) VALUE_CASE(2) VALUE_CASE(3) VALUE_CASE(4) VALUE_CASE(5) VALUE_CASE(6) }
            }
        }
        pos += n;
    }
    for (int r = 0; r < rows; r++) {
        float *dst = out + ((int64_t)(first + r / group) * num_heads + g * group + r % group) * d;
        const float inv = 1.0f / running_sum[r];
#pragma omp simd
        for (int i = 0; i < d; i++) dst[i] = acc[r * d + i] * inv;
    }
}

/* q: [T, H, D] fp32, the chunk's queries (G query heads of a KV head adjacent); out: same shape;
 * blocks: the request's block table, covering positions [0, pos0 + T); pos0: context position of
 * the chunk's first token (tokens before it are already in the pool, like the chunk's own K/V).
 * Returns 0, or -1 for shapes it does not handle. */
int kvbaton_paged_prefill_attention(const void *kv_cache, int kv_format, const float *q, float *out,
                                    const int64_t *blocks, int64_t pos0, int64_t num_tokens, int block_size,
                                    int num_kv_heads, int group, int head_dim, float scale, int num_threads) {
    if (group > MAX_ROWS || head_dim > MAX_HEAD_DIM || head_dim % 8 || !kv_format_ok(kv_format)
        || num_tokens < 1 || pos0 < 0)
        return -1;
    const Shape shape = {kv_cache, kv_format, block_size, num_kv_heads, group, head_dim, scale};
    const int tile_tokens = group >= TARGET_ROWS ? 1 : TARGET_ROWS / group;
    const int64_t tiles = (num_tokens + tile_tokens - 1) / tile_tokens;
    /* NOTE: later tiles see more keys: hand them out first so the last items to finish are short. */
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < tiles * num_kv_heads; item++) {
        const int64_t tile = tiles - 1 - item / num_kv_heads;
        const int g = (int)(item % num_kv_heads);
        const int first = (int)(tile * tile_tokens);
        const int count = num_tokens - first < tile_tokens ? (int)(num_tokens - first) : tile_tokens;
        attend_tile(&shape, q, out, blocks, pos0, first, count, g);
    }
    return 0;
}
