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

#define MAX_ROWS 64       /* query rows (tokens x group) per work item */
#define MAX_HEAD_DIM 256
#define KEY_TILE 16        /* keys converted and scored together (a multiple of 8) */
#define QUERY_TILE 8       /* query tokens per work item (fewer when the group is large) */

typedef struct {
    const void *kv;
    int elem_bytes, block_size, num_kv_heads, group, head_dim;
    float scale;
} Shape;

/* Query tokens [first, first + count) of the chunk, KV head g; token i sits at context position
 * pos0 + i and sees keys [0, pos0 + i]. q, out: [T, H, D] fp32. */
static void attend_tile(const Shape *s, const float *q, float *out, const int64_t *blocks, int64_t pos0, int first,
                        int count, int g) {
    const int d = s->head_dim, group = s->group, rows = count * group, num_heads = s->num_kv_heads * group;
    const int64_t token_stride = 2 * (int64_t)s->num_kv_heads * d;
    float qs[MAX_ROWS][MAX_HEAD_DIM], acc[MAX_ROWS][MAX_HEAD_DIM];
    float keys[KEY_TILE * MAX_HEAD_DIM], values[KEY_TILE * MAX_HEAD_DIM];
    float scores[KEY_TILE], running_max[MAX_ROWS], running_sum[MAX_ROWS];

    for (int r = 0; r < rows; r++) {  /* row r: token first + r / group, head g * group + r % group */
        const float *src = q + ((int64_t)(first + r / group) * num_heads + g * group + r % group) * d;
#pragma omp simd
        for (int i = 0; i < d; i++) qs[r][i] = src[i] * s->scale, acc[r][i] = 0.0f;
        running_max[r] = -FLT_MAX;
        running_sum[r] = 0.0f;
    }
    const int64_t end = pos0 + first + count;  /* keys the last token of the tile sees */
    for (int64_t pos = 0; pos < end;) {
        const int64_t block = blocks[pos / s->block_size];
        const int offset = (int)(pos % s->block_size);
        int n = (int)((end - pos) < (s->block_size - offset) ? end - pos : s->block_size - offset);
        if (n > KEY_TILE) n = KEY_TILE;
        const int padded = (n + 7) & ~7;
        const int64_t first_slot = block * s->block_size + offset;
        for (int t = 0; t < n; t++) {
            const int64_t row = (first_slot + t) * token_stride + (int64_t)g * d;
            load_row(s->kv, row, s->elem_bytes, d, keys + t * d);
            load_row(s->kv, row + (int64_t)s->num_kv_heads * d, s->elem_bytes, d, values + t * d);
        }
        if (n < KEY_TILE) {  /* zero rows past the tile: dot8 pads to 8 keys, the PV loop runs over all 16 */
            memset(keys + n * d, 0, sizeof(float) * (size_t)(KEY_TILE - n) * d);
            memset(values + n * d, 0, sizeof(float) * (size_t)(KEY_TILE - n) * d);
        }
        for (int r = 0; r < rows; r++) {
            const int64_t visible = pos0 + first + r / group + 1 - pos;  /* keys of this tile the row sees */
            if (visible <= 0) continue;  /* the whole tile is in this token's future */
            const int m = visible < n ? (int)visible : n;
            for (int t = 0; t < padded; t += 8) {
                const f32x8 sc = dot8(qs[r], keys + t * d, d, d);
                memcpy(&scores[t], &sc, sizeof sc);
            }
            float tile_max = -FLT_MAX;
            for (int t = 0; t < m; t++)
                if (scores[t] > tile_max) tile_max = scores[t];
            const float new_max = tile_max > running_max[r] ? tile_max : running_max[r];
            const float correction = expf(running_max[r] - new_max);  /* 0 on the first tile */
            float tile_sum = 0.0f;
#pragma omp simd reduction(+ : tile_sum)
            for (int t = 0; t < KEY_TILE; t++) {
                scores[t] = t < m ? expf(scores[t] - new_max) : 0.0f;
                tile_sum += scores[t];
            }
            running_sum[r] = running_sum[r] * correction + tile_sum;
            running_max[r] = new_max;
            for (int i = 0; i < d; i += 8) {  /* the partial sum of 8 dims stays in a register */
                f32x8 a = load8(acc[r] + i) * correction;
                for (int t = 0; t < KEY_TILE; t++) a += scores[t] * load8(values + t * d + i);  /* unrolled */
                memcpy(acc[r] + i, &a, sizeof a);
            }
        }
        pos += n;
    }
    for (int r = 0; r < rows; r++) {
        float *dst = out + ((int64_t)(first + r / group) * num_heads + g * group + r % group) * d;
        const float inv = 1.0f / running_sum[r];
#pragma omp simd
        for (int i = 0; i < d; i++) dst[i] = acc[r][i] * inv;
    }
}

/* q: [T, H, D] fp32, the chunk's queries (G query heads of a KV head adjacent); out: same shape;
 * blocks: the request's block table, covering positions [0, pos0 + T); pos0: context position of
 * the chunk's first token (tokens before it are already in the pool, like the chunk's own K/V).
 * Returns 0, or -1 for shapes it does not handle. */
int kvbaton_paged_prefill_attention(const void *kv_cache, int elem_bytes, const float *q, float *out,
                                    const int64_t *blocks, int64_t pos0, int64_t num_tokens, int block_size,
                                    int num_kv_heads, int group, int head_dim, float scale, int num_threads) {
    if (group > MAX_ROWS || head_dim > MAX_HEAD_DIM || head_dim % 8 || (elem_bytes != 2 && elem_bytes != 4)
        || num_tokens < 1 || pos0 < 0)
        return -1;
    const Shape shape = {kv_cache, elem_bytes, block_size, num_kv_heads, group, head_dim, scale};
    int tile_tokens = MAX_ROWS / group;
    if (tile_tokens > QUERY_TILE) tile_tokens = QUERY_TILE;
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
