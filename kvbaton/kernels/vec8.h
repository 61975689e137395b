/* Eight-float vectors with GCC vector extensions (AVX2 registers with -march=native on x86,
 * lowered to whatever the target has elsewhere), shared by kvbaton's kernels. */
#ifndef KVBATON_VEC8_H
#define KVBATON_VEC8_H

#include <stdint.h>
#include <string.h>

typedef float f32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

static inline f32x8 load8(const float *p) {
    f32x8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Eight bf16 values widened to fp32: bf16 is the top half of an fp32. */
static inline f32x8 load_bf16x8(const uint16_t *p) {
    u16x8 h;
    memcpy(&h, p, sizeof h);
    const u32x8 wide = __builtin_convertvector(h, u32x8) << 16;
    f32x8 f;
    memcpy(&f, &wide, sizeof f);
    return f;
}

static inline float hsum8(f32x8 v) {
    return (v[0] + v[4]) + (v[1] + v[5]) + ((v[2] + v[6]) + (v[3] + v[7]));
}

typedef int32_t i32x8 __attribute__((vector_size(32)));

/* Pairwise sums within 128-bit lanes (x86's haddps): [a0+a1, a2+a3, b0+b1, b2+b3 | same for the high lane]. */
static inline f32x8 hadd(f32x8 a, f32x8 b) {
    return __builtin_shuffle(a, b, (i32x8){0, 2, 8, 10, 4, 6, 12, 14})
           + __builtin_shuffle(a, b, (i32x8){1, 3, 9, 11, 5, 7, 13, 15});
}

/* q . k for eight keys at once (rows `stride` floats apart), returned as one vector. Eight
 * independent FMA chains hide the FMA latency, and the eight horizontal sums are done together
 * in a transpose-like tree (21 shuffles and adds instead of ~56 for eight separate sums). */
static inline f32x8 dot8(const float *q, const float *k, int stride, int d) {
    f32x8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
    for (int i = 0; i < d; i += 8) {
        const f32x8 qv = load8(q + i);
        a0 += qv * load8(k + i);
        a1 += qv * load8(k + stride + i);
        a2 += qv * load8(k + 2 * stride + i);
        a3 += qv * load8(k + 3 * stride + i);
        a4 += qv * load8(k + 4 * stride + i);
        a5 += qv * load8(k + 5 * stride + i);
        a6 += qv * load8(k + 6 * stride + i);
        a7 += qv * load8(k + 7 * stride + i);
    }
    const f32x8 lo = hadd(hadd(a0, a1), hadd(a2, a3)), hi = hadd(hadd(a4, a5), hadd(a6, a7));
    return __builtin_shuffle(lo, hi, (i32x8){0, 1, 2, 3, 8, 9, 10, 11})
           + __builtin_shuffle(lo, hi, (i32x8){4, 5, 6, 7, 12, 13, 14, 15});
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

/* How a KV pool stores a head's row of K or V (the kernels' `kv_format` argument):
 *   KV_F32, KV_BF16: head_dim values of 4 or 2 bytes;
 *   KV_INT8, KV_FP8: head_dim one-byte codes (int8, or fp8 e4m3), then the row's fp32 scale (4 bytes).
 * One token's slot holds K of every KV head, then V of every KV head. */
#define KV_INT8 1
#define KV_BF16 2
#define KV_FP8 3
#define KV_F32 4
#define KV_SCALE_BYTES 4

static inline int kv_format_ok(int f) { return f == KV_INT8 || f == KV_BF16 || f == KV_FP8 || f == KV_F32; }

/* Bytes of one head's row. */
static inline int64_t kv_row_bytes(int f, int head_dim) {
    return f == KV_INT8 || f == KV_FP8 ? head_dim + KV_SCALE_BYTES : (int64_t)head_dim * f;
}

/* fp8 e4m3 -> fp32 without a table: normal numbers by moving the bits into place (re-biasing the
 * exponent 7 -> 127), subnormals (exponent 0) as mantissa * 2^-9. Branch-free, so loops vectorize;
 * no fp32 subnormal is formed (-ffast-math may flush them). */
static inline float fp8_e4m3_to_f32(uint8_t b) {
    const uint32_t e = (b >> 3) & 0xF, m = b & 7;
    const uint32_t bits = ((uint32_t)(b & 0x80) << 24) | ((e + 120) << 23) | (m << 20);
    float normal;
    memcpy(&normal, &bits, sizeof normal);
    const float sub = (b & 0x80 ? -1.0f : 1.0f) * (float)m * 0.001953125f;
    return e ? normal : sub;
}

/* Rows of heads [head0, head0 + nheads) of K (which = 0) or V (which = 1) of token slot `slot`, as fp32
 * into out[nheads * head_dim]: quantized codes are dequantized here, in registers. */
static inline void load_kv_rows(const void *kv, int f, int64_t slot, int which, int head0, int nheads,
                                int num_kv_heads, int head_dim, float *out) {
    const int64_t row_bytes = kv_row_bytes(f, head_dim);
    const uint8_t *base = (const uint8_t *)kv + (slot * 2 + which) * num_kv_heads * row_bytes + head0 * row_bytes;
    if (f == KV_BF16 || f == KV_F32) {
        load_row(base, 0, f, nheads * head_dim, out);
        return;
    }
    for (int h = 0; h < nheads; h++) {
        const uint8_t *codes = base + h * row_bytes;
        float scale;
        memcpy(&scale, codes + head_dim, sizeof scale);
        float *o = out + h * head_dim;
        if (f == KV_INT8) {
            const int8_t *c = (const int8_t *)codes;
#pragma omp simd
            for (int i = 0; i < head_dim; i++) o[i] = (float)c[i] * scale;
        } else {
#pragma omp simd
            for (int i = 0; i < head_dim; i++) o[i] = fp8_e4m3_to_f32(codes[i]) * scale;
        }
    }
}

/* fp32 -> bf16, round to nearest even (what `tensor.to(torch.bfloat16)` does for finite values). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

static inline float round_bf16(float f) {
    const uint32_t bits = (uint32_t)f32_to_bf16(f) << 16;
    float r;
    memcpy(&r, &bits, sizeof r);
    return r;
}

#endif
