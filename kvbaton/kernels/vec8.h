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

/* ---- Code vectors for the quantized-KV decode path (paged_attention.c): `cvec`, CODE_LANES fp32 lanes made
 * from as many one-byte codes. 16 lanes (one zmm) with AVX-512, else 8 (one AVX2 register, or what the target
 * has): a 16-lane GCC vector on AVX2 is split into halves whose shuffles GCC lowers poorly (3x slower). */
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

/* Multiply an fp8 row's scale by this before using fp8_codes_scaled's values: they are 2^-8 times the codes. */
#define FP8_SCALED_UNIT 256.0f

/* Why fp8 goes through fp16: e4m3 is fp16 with the exponent 7 bits lower and 7 mantissa bits cut, so
 * shifting a code into fp16's bit positions gives its value times 2^-8 (2^(7-15)), subnormals included, and
 * the hardware's fp16 -> fp32 conversion (F16C, on every AVX2 CPU) does the rest, exactly: three integer ops
 * and one convert per vector instead of fp8_e4m3_to_f32's bit assembly and select. The bits: sign-extending
 * the byte to 16 bits and shifting left by 7 puts the sign in bit 15 and exponent + mantissa in bits 13..7;
 * bit 14 (a copy of the sign) is cleared. NOTE: int8 goes through intrinsics too, because GCC 12 lowers a
 * vector __builtin_convertvector from int8 element by element; the loops are the portable fallbacks. */
#if defined(__AVX512F__)
#define CODE_LANES 16
typedef float cvec __attribute__((vector_size(64)));
typedef int32_t cvec_index __attribute__((vector_size(64)));

static inline cvec int8_codes(const uint8_t *p) {
    const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    cvec f;
    memcpy(&f, &v, sizeof f);
    return f;
}

static inline cvec fp8_codes_scaled(const uint8_t *p) {
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)), 7),
                                       _mm256_set1_epi16((short)0xBFFF));
    const __m512 v = _mm512_cvtph_ps(h);
    cvec f;
    memcpy(&f, &v, sizeof f);
    return f;
}

/* The lane sums of 16 vectors as one vector (out[t] = sum of v[t]): pairs folded halves onto halves four
 * times, 45 shuffles and adds for the 16 sums instead of ~130 for 16 separate horizontal sums. */
static inline cvec fold_halves(cvec a, cvec b, cvec_index lo, cvec_index hi) {
    return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}

static inline cvec lane_sums(const cvec *v) {
    const cvec_index l1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const cvec_index h1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const cvec_index l2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const cvec_index h2 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const cvec_index l3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const cvec_index h3 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const cvec_index l4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const cvec_index h4 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    cvec a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) a[i] = fold_halves(v[2 * i], v[2 * i + 1], l1, h1);  /* [8 of v0 | 8 of v1] */
    for (int i = 0; i < 4; i++) b[i] = fold_halves(a[2 * i], a[2 * i + 1], l2, h2);  /* 4 each of v0..v3 */
    for (int i = 0; i < 2; i++) c[i] = fold_halves(b[2 * i], b[2 * i + 1], l3, h3);  /* 2 each of v0..v7 */
    return fold_halves(c[0], c[1], l4, h4);
}
#else
#define CODE_LANES 8
typedef f32x8 cvec;

static inline cvec int8_codes(const uint8_t *p) {
    cvec f;
#if defined(__AVX2__)
    const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    memcpy(&f, &v, sizeof f);
#else
    for (int i = 0; i < 8; i++) f[i] = (float)(int8_t)p[i];
#endif
    return f;
}

static inline cvec fp8_codes_scaled(const uint8_t *p) {
    cvec f;
#if defined(__F16C__) && defined(__SSE4_1__)
    const __m128i h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p)), 7),
                                    _mm_set1_epi16((short)0xBFFF));
    const __m256 v = _mm256_cvtph_ps(h);
    memcpy(&f, &v, sizeof f);
#else
    for (int i = 0; i < 8; i++) f[i] = fp8_e4m3_to_f32(p[i]) * (1.0f / FP8_SCALED_UNIT);
#endif
    return f;
}

/* The lane sums of 8 vectors as one vector, by dot8's tree. */
static inline cvec lane_sums(const cvec *v) {
    const f32x8 lo = hadd(hadd(v[0], v[1]), hadd(v[2], v[3])), hi = hadd(hadd(v[4], v[5]), hadd(v[6], v[7]));
    return __builtin_shuffle(lo, hi, (i32x8){0, 1, 2, 3, 8, 9, 10, 11})
           + __builtin_shuffle(lo, hi, (i32x8){4, 5, 6, 7, 12, 13, 14, 15});
}
#endif

static inline cvec load_cvec(const float *p) {
    cvec v;
    memcpy(&v, p, sizeof v);
    return v;
}

#endif
