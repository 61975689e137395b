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

#endif
