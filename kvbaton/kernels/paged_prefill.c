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

/* The key tile at context position pos: its length (up to max_keys, within one block and before end) and, in
 * first_slot, the pool slot of its first key. */
static inline int key_tile(const Shape *s, const int64_t *blocks, int64_t pos, int64_t end, int max_keys,
                           int64_t *first_slot) {
    const int offset = (int)(pos % s->block_size);
    *first_slot = blocks[pos / s->block_size] * s->block_size + offset;
    const int64_t n = end - pos < s->block_size - offset ? end - pos : s->block_size - offset;
    return n > max_keys ? max_keys : (int)n;
}

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
        int64_t first_slot;
        const int n = key_tile(s, blocks, pos, end, KEY_TILE, &first_slot);
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

/* AVX512-BF16 CPUs, a bf16 pool and bf16-valued queries (a bf16 model's): the same tiles, computed with
 * `vdpbf16ps` on 16 lanes. Scores: the tile's queries are packed once as bf16 pairs [D/2][rows] (lanes: rows)
 * and each key's pair is broadcast straight from the pool, so K needs no conversion or transpose; products are
 * exact and summed in fp32, and the scale multiplies the sums (q stays exact). Values: the probabilities are
 * rounded to bf16 pairs over two keys [keys/2][rows], and each two V rows are interleaved into pairs [D]
 * (lanes: head dims), so one `vdpbf16ps` adds two keys' contributions; like PyTorch's bf16 flash attention,
 * the probabilities are bf16 here (relative error 2^-9 each, in an output that is rounded to bf16). */
#if defined(__AVX512BF16__)
#include "bf16x16.h"

#define B16_KEYS 16   /* keys per tile: one pool block of 16, or part of one */
#define B16_SCORE 8   /* keys scored together: 8 x 3 accumulators of 16 rows */
#define B16_VROWS 6   /* rows whose PV accumulators (x 4 vectors of head dims) stay in registers */

/* scores[t][v*16 ..] (t < B16_SCORE, fp32) = qp . key t's row, for nv 16-row vectors; qp: [D/2][ld] pairs. */
static inline __attribute__((always_inline)) void score_keys_bf16(const uint32_t *qp, int ld, int pairs,
                                                                   const uint16_t *const keys[B16_SCORE],
                                                                   const int nv, float *scores, int score_ld) {
    __m512 acc[B16_SCORE][3];
    for (int t = 0; t < B16_SCORE; t++)
        for (int v = 0; v < nv; v++) acc[t][v] = _mm512_setzero_ps();
    for (int i = 0; i < pairs; i++) {
        __m512bh q[3];
        for (int v = 0; v < nv; v++) q[v] = (__m512bh)_mm512_loadu_si512(qp + (int64_t)i * ld + 16 * v);
        for (int t = 0; t < B16_SCORE; t++) {
            uint32_t pair;
            memcpy(&pair, keys[t] + 2 * i, sizeof pair);
            const __m512bh k = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int v = 0; v < nv; v++) acc[t][v] = _mm512_dpbf16_ps(acc[t][v], q[v], k);
        }
    }
    for (int t = 0; t < B16_SCORE; t++)
        for (int v = 0; v < nv; v++) _mm512_storeu_ps(scores + t * score_ld + 16 * v, acc[t][v]);
}

/* acc[r0 + r][c0 .. c0 + 16 nc) = acc * correction + sum over key pairs of pp[pair][r] . vp[pair][c], for nr rows
 * (1-6) and nc vectors of 16 head dims (2 or 4). */
static inline __attribute__((always_inline)) void value_pairs_bf16(const uint32_t *pp, int ld, int r0, const int nr,
                                                                    const uint32_t *vp, int d, int c0, const int nc,
                                                                    const float *correction, float *acc) {
    __m512 a[B16_VROWS][4];
    for (int r = 0; r < nr; r++) {
        const __m512 c = _mm512_set1_ps(correction[r0 + r]);
        for (int v = 0; v < nc; v++)
            a[r][v] = _mm512_mul_ps(_mm512_loadu_ps(acc + (int64_t)(r0 + r) * d + c0 + 16 * v), c);
    }
    for (int t = 0; t < B16_KEYS / 2; t++) {
        __m512bh vv[4];
        for (int v = 0; v < nc; v++) vv[v] = (__m512bh)_mm512_loadu_si512(vp + (int64_t)t * d + c0 + 16 * v);
        for (int r = 0; r < nr; r++) {
            const __m512bh p = (__m512bh)_mm512_set1_epi32((int)pp[t * ld + r0 + r]);
            for (int v = 0; v < nc; v++) a[r][v] = _mm512_dpbf16_ps(a[r][v], p, vv[v]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < nc; v++) _mm512_storeu_ps(acc + (int64_t)(r0 + r) * d + c0 + 16 * v, a[r][v]);
}

#define VALUE_PAIRS_CASE(NR) \
    case NR: \
        if (nc == 4) value_pairs_bf16(pp, ld, r0, NR, vp, d, c0, 4, correction, acc); \
        else value_pairs_bf16(pp, ld, r0, NR, vp, d, c0, 2, correction, acc); \
        break;

/* Two V rows (bf16, d dims) -> d pairs (row a's dim i, row b's dim i), for the PV `vdpbf16ps`. */
static inline void interleave_rows(const uint16_t *a, const uint16_t *b, int d, uint32_t *out) {
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int c = 0; c < d; c += 32) {
        const __m512i va = _mm512_loadu_si512(a + c), vb = _mm512_loadu_si512(b + c);
        _mm512_storeu_si512(out + c, _mm512_permutex2var_epi16(va, lo, vb));
        _mm512_storeu_si512(out + c + 16, _mm512_permutex2var_epi16(va, hi, vb));
    }
}

/* As attend_tile, on 16 lanes (rows padded to a multiple of 16, head_dim a multiple of 32). */
static void attend_tile_bf16(const Shape *s, const float *q, float *out, const int64_t *blocks, int64_t pos0,
                             int first, int count, int g) {
    const int d = s->head_dim, group = s->group, rows = count * group, num_heads = s->num_kv_heads * group;
    const int ld = (rows + 15) & ~15, nvec = ld / 16, pairs = d / 2;
    const int64_t token_elems = 2 * (int64_t)s->num_kv_heads * d;  /* a slot's K and V, all KV heads */
    const uint16_t *pool = (const uint16_t *)s->kv;
    uint32_t qp[MAX_HEAD_DIM / 2 * MAX_ROWS], pp[B16_KEYS / 2 * MAX_ROWS], vp[B16_KEYS / 2 * MAX_HEAD_DIM];
    float acc[MAX_ROWS * MAX_HEAD_DIM], scores[B16_KEYS * MAX_ROWS];
    float running_max[MAX_ROWS], running_sum[MAX_ROWS], correction[MAX_ROWS], last_key[MAX_ROWS];
    uint16_t zeros[MAX_HEAD_DIM];
    memset(zeros, 0, sizeof(uint16_t) * (size_t)d);

    /* row r: token first + r / group, head g * group + r % group; padding rows are zero queries */
    memset(qp, 0, sizeof(uint32_t) * (size_t)pairs * ld);
    for (int r = 0; r < rows; r++) {
        const float *src = q + ((int64_t)(first + r / group) * num_heads + g * group + r % group) * d;
        for (int i = 0; i < pairs; i++) {
            uint32_t lo, hi;
            memcpy(&lo, src + 2 * i, sizeof lo);
            memcpy(&hi, src + 2 * i + 1, sizeof hi);
            qp[i * ld + r] = (lo >> 16) | (hi & 0xFFFF0000u);  /* exact: the caller checked q is bf16 */
        }
        last_key[r] = (float)(pos0 + first + r / group);
    }
    for (int r = rows; r < ld; r++) last_key[r] = FLT_MAX;
    memset(acc, 0, sizeof(float) * (size_t)ld * d);
    for (int r = 0; r < ld; r++) running_max[r] = -FLT_MAX, running_sum[r] = 0.0f;

    const __m512 scale = _mm512_set1_ps(s->scale);
    const int64_t end = pos0 + first + count;
    for (int64_t pos = 0; pos < end;) {
        int64_t first_slot;
        const int n = key_tile(s, blocks, pos, end, B16_KEYS, &first_slot);
        const uint16_t *k0 = pool + first_slot * token_elems + (int64_t)g * d;
        const uint16_t *keys[B16_KEYS], *values[B16_KEYS];
        for (int t = 0; t < B16_KEYS; t++) {
            keys[t] = t < n ? k0 + t * token_elems : zeros;
            values[t] = t < n ? k0 + t * token_elems + (int64_t)s->num_kv_heads * d : zeros;
        }
        for (int t = 0; t < n; t += B16_SCORE) {
            float *sc = scores + t * ld;
            if (nvec == 3) score_keys_bf16(qp, ld, pairs, keys + t, 3, sc, ld);
            else if (nvec == 2) score_keys_bf16(qp, ld, pairs, keys + t, 2, sc, ld);
            else score_keys_bf16(qp, ld, pairs, keys + t, 1, sc, ld);
        }
        for (int t = 0; t < B16_KEYS; t += 2) interleave_rows(values[t], values[t + 1], d, vp + (t / 2) * d);

        /* online softmax over 16 rows at a time: scale, mask the future (and keys past n), new max, rescale */
        for (int v = 0; v < nvec; v++) {
            const __m512 last = _mm512_loadu_ps(last_key + 16 * v);
            __m512 tile_max = _mm512_set1_ps(-FLT_MAX);
            __mmask16 visible[B16_KEYS];
            for (int t = 0; t < B16_KEYS; t++) {
                visible[t] = t < n ? _mm512_cmp_ps_mask(_mm512_set1_ps((float)(pos + t)), last, _CMP_LE_OQ) : 0;
                const __m512 sc = _mm512_mul_ps(_mm512_loadu_ps(scores + t * ld + 16 * v), scale);
                _mm512_storeu_ps(scores + t * ld + 16 * v, sc);
                tile_max = _mm512_mask_max_ps(tile_max, visible[t], tile_max, sc);
            }
            const __m512 old_max = _mm512_loadu_ps(running_max + 16 * v);
            const __m512 new_max = _mm512_max_ps(old_max, tile_max);
            const __m512 corr = exp16(_mm512_sub_ps(old_max, new_max));  /* 0 on the first tile */
            __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(running_sum + 16 * v), corr);
            _mm512_storeu_ps(running_max + 16 * v, new_max);
            _mm512_storeu_ps(correction + 16 * v, corr);
            for (int t = 0; t < B16_KEYS; t += 2) {
                __m512 p[2];
                for (int j = 0; j < 2; j++) {
                    const __m512 sc = _mm512_loadu_ps(scores + (t + j) * ld + 16 * v);
                    p[j] = _mm512_maskz_mov_ps(visible[t + j], exp16(_mm512_sub_ps(sc, new_max)));
                }
                /* the sum takes the probabilities as the values multiply them: rounded to bf16 */
                const __m256bh b0 = _mm512_cvtneps_pbh(p[0]), b1 = _mm512_cvtneps_pbh(p[1]);
                const __m512i w0 = _mm512_cvtepu16_epi32((__m256i)b0), w1 = _mm512_cvtepu16_epi32((__m256i)b1);
                sum = _mm512_add_ps(sum, _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(w0, 16)),
                                                       _mm512_castsi512_ps(_mm512_slli_epi32(w1, 16))));
                _mm512_storeu_si512(pp + (t / 2) * ld + 16 * v, _mm512_or_si512(w0, _mm512_slli_epi32(w1, 16)));
            }
            _mm512_storeu_ps(running_sum + 16 * v, sum);
        }
        for (int r0 = 0; r0 < rows; r0 += B16_VROWS) {
            const int nr = rows - r0 < B16_VROWS ? rows - r0 : B16_VROWS;
            for (int c0 = 0; c0 < d; c0 += 64) {
                const int nc = d - c0 >= 64 ? 4 : 2;
                switch (nr) {
                    VALUE_PAIRS_CASE(1) VALUE_PAIRS_CASE(2) VALUE_PAIRS_CASE(3)
                    VALUE_PAIRS_CASE(4) VALUE_PAIRS_CASE(5) VALUE_PAIRS_CASE(6)
                }
            }
        }
        pos += n;
    }
    for (int r = 0; r < rows; r++) {
        float *dst = out + ((int64_t)(first + r / group) * num_heads + g * group + r % group) * d;
        const __m512 inv = _mm512_set1_ps(1.0f / running_sum[r]);
        for (int i = 0; i < d; i += 16) _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_loadu_ps(acc + r * d + i), inv));
    }
}
#endif

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
    int bf16 = 0;
#if defined(__AVX512BF16__)
    bf16 = kv_format == KV_BF16 && head_dim % 32 == 0 && q_is_bf16(q, num_tokens * num_kv_heads * group * head_dim);
#endif
    /* the bf16 tiles fill 16-lane vectors: up to 48 rows (e.g. 16 tokens x 3 heads), the fp32 ones 8-lane: 24 */
    const int target = bf16 ? MAX_ROWS : TARGET_ROWS;
    const int tile_tokens = group >= target ? 1 : target / group;
    const int64_t tiles = (num_tokens + tile_tokens - 1) / tile_tokens;
    /* NOTE: later tiles see more keys: hand them out first so the last items to finish are short. */
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < tiles * num_kv_heads; item++) {
        const int64_t tile = tiles - 1 - item / num_kv_heads;
        const int g = (int)(item % num_kv_heads);
        const int first = (int)(tile * tile_tokens);
        const int count = num_tokens - first < tile_tokens ? (int)(num_tokens - first) : tile_tokens;
#if defined(__AVX512BF16__)
        if (bf16) {
            attend_tile_bf16(&shape, q, out, blocks, pos0, first, count, g);
            continue;
        }
#endif
        attend_tile(&shape, q, out, blocks, pos0, first, count, g);
    }
    return 0;
}
