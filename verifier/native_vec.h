/* What both native kernels share (native_linear.c, native_attention.c): the vector type of this
 * build and the loads that widen float32, bfloat16 or float16 values to float32.
 *
 * The vector width follows the CPU the library is built for (-march=native): 16 float32 lanes with
 * AVX-512, 8 elsewhere. Half-width values are widened exactly as they are loaded (a bfloat16 is the
 * high half of a float32; a float16 converts exactly), so every product and sum after a load is the
 * same float32 operation whatever width the data is stored at.
 */
#ifndef RACER_NATIVE_VEC_H
#define RACER_NATIVE_VEC_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif

typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vfu __attribute__((vector_size(VL * 4), aligned(4)));
typedef uint16_t vh __attribute__((vector_size(VL * 2), aligned(2)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));
typedef _Float16 vhf __attribute__((vector_size(VL * 2), aligned(2)));

enum { F32 = 0, BF16 = 1, F16 = 2 };

/* VL values from p on, as float32. The half-width loads are one widening load each where the CPU has
 * one (the compiler's generic conversion takes a dozen instructions on AVX2, one value at a time
 * for float16); the same values either way. */
static inline vf load_f32(const float *p) { return *(const vfu *)p; }
#if defined(__AVX512F__)
#include <immintrin.h>
static inline vf load_bf16(const uint16_t *p)
{
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
}
static inline vf load_f16(const _Float16 *p) { return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
#elif defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
static inline vf load_bf16(const uint16_t *p)
{
    return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
}
static inline vf load_f16(const _Float16 *p) { return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
#else
static inline vf load_bf16(const uint16_t *p)
{
    vu u = __builtin_convertvector(*(const vh *)p, vu) << 16;
    vf f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline vf load_f16(const _Float16 *p) { return __builtin_convertvector(*(const vhf *)p, vf); }
#endif

/* One value, as float32. */
static inline float one_f32(const float *p) { return *p; }
static inline float one_bf16(const uint16_t *p)
{
    uint32_t u = (uint32_t)*p << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline float one_f16(const _Float16 *p) { return (float)*p; }

/* VL values of element type ``type`` from p[d] on, as float32. */
static inline vf load_as_f32(const void *p, long d, int type)
{
    if (type == F32) return load_f32((const float *)p + d);
    if (type == BF16) return load_bf16((const uint16_t *)p + d);
    return load_f16((const _Float16 *)p + d);
}

/* The lanes summed in lane order: the same additions whatever the data. */
static inline float reduce(vf v)
{
    float s = 0.f;
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
}

/* exp(x) for x <= 0 (softmax terms, sigmoids): 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], degree-6
 * polynomial (relative error ~2e-7); below -87 it is 0. The same operations for every lane. */
static inline vf vexp(vf x)
{
    const vf lo = (vf){0} - 87.0f;
    vi under = x < lo, xb, lb;
    memcpy(&xb, &x, sizeof xb);
    memcpy(&lb, &lo, sizeof lb);
    xb = (xb & ~under) | (lb & under);
    memcpy(&x, &xb, sizeof x);
    const vf magic = (vf){0} + 12582912.0f; /* 1.5 * 2^23: adding and subtracting it rounds to nearest */
    vf n = (x * 1.44269504088896341f + magic) - magic;
    vf r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vf p = (vf){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    vf sc;
    memcpy(&sc, &e, sizeof sc);
    vf out = p * sc;
    vi bits;
    memcpy(&bits, &out, sizeof bits);
    bits &= ~under;
    memcpy(&out, &bits, sizeof out);
    return out;
}

/* tanh(x) = sign(x) (1 - e) / (1 + e), e = exp(-2|x|) (within vexp's domain for every x): Gemma 2's
 * soft-capped attention scores. The same operations for every lane. */
static inline vf vtanh(vf x)
{
    vi bits, mag;
    memcpy(&bits, &x, sizeof bits);
    mag = bits & 0x7fffffff;
    vf a, t;
    memcpy(&a, &mag, sizeof a);
    const vf e = vexp(a * -2.0f);
    t = (1.0f - e) / (1.0f + e);
    vi tb;
    memcpy(&tb, &t, sizeof tb);
    tb |= bits & (int)0x80000000u;
    memcpy(&t, &tb, sizeof t);
    return t;
}

#endif
