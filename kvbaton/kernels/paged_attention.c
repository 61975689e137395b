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

#include "vec8.h"

#define MAX_HEADS 64
#define MAX_HEAD_DIM 256
#define MAX_KV_ROW 1024 /* num_kv_heads * head_dim */
#define TILE 16          /* tokens converted and scored together */
#define MIN_PARTITION_BLOCKS 8

/* q . k for four keys at once: four independent FMA chains hide the FMA latency that a single
 * dot product of 64-128 elements would wait on. d is a multiple of 8. */
static inline void dot4(const float *q, const float *k0, const float *k1, const float *k2, const float *k3, int d,
                        float *out) {
    f32x8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int i = 0; i < d; i += 8) {
        const f32x8 qv = load8(q + i);
        a0 += qv * load8(k0 + i);
        a1 += qv * load8(k1 + i);
        a2 += qv * load8(k2 + i);
        a3 += qv * load8(k3 + i);
    }
    out[0] = hsum8(a0), out[1] = hsum8(a1), out[2] = hsum8(a2), out[3] = hsum8(a3);
}

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Load n elements as fp32: `elem_bytes` is 2 (bf16) or 4 (fp32). */
static inline void load_row(const void *base, int64_t index, int elem_bytes, int n, float *out) {
    if (elem_bytes == 2) {
        const uint16_t *src = (const uint16_t *)base + index;
#pragma omp simd
        for (int i = 0; i < n; i++) out[i] = bf16_to_f32(src[i]);
    } else {
        memcpy(out, (const float *)base + index, (size_t)n * sizeof(float));
    }
}

typedef struct {
    const void *kv;
    int elem_bytes, block_size, num_kv_heads, group, head_dim;
    float scale;
} Shape;

/* Attend all H query heads of one request over tokens [start, end) of its context.
 * Writes the unnormalized output [H, D] plus each head's running max and sum. */
static void attend_range(const Shape *s, const float *q, const int64_t *blocks, int64_t start, int64_t end,
                         float *acc_out, float *max_out, float *sum_out) {
    const int num_heads = s->num_kv_heads * s->group, d = s->head_dim;
    const int kv_row = s->num_kv_heads * d;  /* K (or V) of all heads of one token */
    const int64_t token_stride = 2 * (int64_t)kv_row;
    float qs[MAX_HEADS][MAX_HEAD_DIM];
    float scores[MAX_HEADS][TILE + 3];
    float tile[TILE + 3][MAX_KV_ROW];  /* K, then V, of up to TILE tokens, all KV heads, as fp32 */
    float running_max[MAX_HEADS], running_sum[MAX_HEADS];

    for (int h = 0; h < num_heads; h++) {
#pragma omp simd
        for (int i = 0; i < d; i++) {
            qs[h][i] = q[h * d + i] * s->scale;
            acc_out[h * d + i] = 0.0f;
        }
        running_max[h] = -FLT_MAX;
        running_sum[h] = 0.0f;
    }
    for (int64_t pos = start; pos < end;) {
        const int64_t block = blocks[pos / s->block_size];
        const int offset = (int)(pos % s->block_size);
        int n = (int)((end - pos) < (s->block_size - offset) ? end - pos : s->block_size - offset);
        if (n > TILE) n = TILE;
        const int64_t first_slot = block * s->block_size + offset;
        float block_max[MAX_HEADS];
        for (int h = 0; h < num_heads; h++) block_max[h] = -FLT_MAX;
        for (int t = 0; t < n; t++) load_row(s->kv, (first_slot + t) * token_stride, s->elem_bytes, kv_row, tile[t]);
        for (int t = n; t < ((n + 3) & ~3); t++) memset(tile[t], 0, sizeof(float) * kv_row);  /* dot4 padding */
        for (int h = 0; h < num_heads; h++) {
            const int k_off = (h / s->group) * d;
            for (int t = 0; t < n; t += 4)
                dot4(qs[h], tile[t] + k_off, tile[t + 1] + k_off, tile[t + 2] + k_off, tile[t + 3] + k_off, d,
                     &scores[h][t]);
            for (int t = 0; t < n; t++)
                if (scores[h][t] > block_max[h]) block_max[h] = scores[h][t];
        }
        for (int h = 0; h < num_heads; h++) {
            const float new_max = block_max[h] > running_max[h] ? block_max[h] : running_max[h];
            const float correction = expf(running_max[h] - new_max);  /* 0 on the first block */
            float *acc = acc_out + h * d;
#pragma omp simd
            for (int i = 0; i < d; i++) acc[i] *= correction;
            float block_sum = 0.0f;
#pragma omp simd reduction(+ : block_sum)
            for (int t = 0; t < n; t++) {
                scores[h][t] = expf(scores[h][t] - new_max);
                block_sum += scores[h][t];
            }
            running_sum[h] = running_sum[h] * correction + block_sum;
            running_max[h] = new_max;
        }
        for (int t = 0; t < n; t++) load_row(s->kv, (first_slot + t) * token_stride + kv_row, s->elem_bytes, kv_row, tile[t]);
        for (int t = 0; t < n; t++) {
            for (int h = 0; h < num_heads; h++) {
                const float *v = tile[t] + (h / s->group) * d;
                const float p = scores[h][t];
                float *acc = acc_out + h * d;
#pragma omp simd
                for (int i = 0; i < d; i++) acc[i] += p * v[i];
            }
        }
        pos += n;
    }
    for (int h = 0; h < num_heads; h++) {
        max_out[h] = running_max[h];
        sum_out[h] = running_sum[h];
    }
}

/* q: [B, H, D] fp32 (the G query heads of a KV head adjacent); out: [B, H, D] fp32;
 * block_tables: [B, max_blocks] int64; context_lens: [B] int64 (each >= 1).
 * Returns 0; -1 for shapes this kernel does not handle (the caller then uses PyTorch);
 * -2 when out of memory. */
int kvbaton_paged_decode_attention(const void *kv_cache, int elem_bytes, const float *q, float *out,
                                   const int64_t *block_tables, const int64_t *context_lens, int64_t batch,
                                   int64_t max_blocks, int block_size, int num_kv_heads, int group,
                                   int head_dim, float scale, int num_threads) {
    const int num_heads = num_kv_heads * group;
    if (num_heads > MAX_HEADS || head_dim > MAX_HEAD_DIM || head_dim % 8 || num_kv_heads * head_dim > MAX_KV_ROW
        || (elem_bytes != 2 && elem_bytes != 4))
        return -1;
    const Shape shape = {kv_cache, elem_bytes, block_size, num_kv_heads, group, head_dim, scale};
    /* Enough partitions per request to give every thread ~4 work items, none shorter than
     * MIN_PARTITION_BLOCKS blocks (below that the merge costs more than it spreads). */
    int64_t parts = (4 * (int64_t)num_threads + batch - 1) / batch;
    if (parts > max_blocks / MIN_PARTITION_BLOCKS) parts = max_blocks / MIN_PARTITION_BLOCKS;
    if (parts < 1) parts = 1;
    const int64_t part_tokens = ((max_blocks * block_size + parts - 1) / parts + block_size - 1)
                                / block_size * block_size;  /* whole blocks */
    const int64_t hd = (int64_t)num_heads * head_dim;
    float *acc = NULL, *maxes = NULL, *sums = NULL;
    if (parts > 1) {
        acc = malloc(sizeof(float) * batch * parts * hd);
        maxes = malloc(sizeof(float) * batch * parts * num_heads);
        sums = malloc(sizeof(float) * batch * parts * num_heads);
        if (!acc || !maxes || !sums) {
            free(acc), free(maxes), free(sums);
            return -2;
        }
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < batch * parts; item++) {
        const int64_t b = item / parts, p = item % parts;
        const int64_t start = p * part_tokens;
        int64_t end = start + part_tokens;
        if (end > context_lens[b]) end = context_lens[b];
        const int64_t *blocks = block_tables + b * max_blocks;
        if (parts == 1) {
            float maxes1[MAX_HEADS], sums1[MAX_HEADS];
            float *o = out + b * hd;
            attend_range(&shape, q + b * hd, blocks, start, end, o, maxes1, sums1);
            for (int h = 0; h < num_heads; h++) {
                const float inv = 1.0f / sums1[h];
                for (int i = 0; i < head_dim; i++) o[h * head_dim + i] *= inv;
            }
        } else if (start < end) {
            attend_range(&shape, q + b * hd, blocks, start, end, acc + item * hd, maxes + item * num_heads,
                         sums + item * num_heads);
        } else {
            for (int h = 0; h < num_heads; h++) maxes[item * num_heads + h] = -FLT_MAX, sums[item * num_heads + h] = 0;
        }
    }
    if (parts > 1) {
#pragma omp parallel for num_threads(num_threads)
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
        free(acc), free(maxes), free(sums);
    }
    return 0;
}
