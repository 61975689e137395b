/* Sixteen-lane fp32 helpers for the AVX512-BF16 attention paths (paged_attention.c, paged_prefill.c). */
#ifndef KVBATON_BF16X16_H
#define KVBATON_BF16X16_H

#if defined(__AVX512BF16__)
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* e^x for 16 lanes (x <= 0 here: a score minus the running max): 2^n * p(r) with x = n ln2 + r, |r| <= ln2 / 2,
 * p a degree-6 Taylor polynomial (relative error ~2e-7, as glibc's vector expf); below -87 it is 0. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  /* ln2 in two parts: r exact-ish */
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Whether q's values are all bf16 (so bf16 pairs multiply them exactly). */
static inline int q_is_bf16(const float *q, int64_t n) {
    uint32_t low = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, q + i, sizeof bits);
        low |= bits & 0xFFFFu;
    }
    return low == 0;
}

#endif
#endif
