/* Vectorisable float math shared by the CPU kernels (libm's expf is a
 * scalar call, so loops that use it do not vectorise). */
#ifndef PAGEDSERVE_CPU_MATH_H
#define PAGEDSERVE_CPU_MATH_H

#include <stdint.h>
#include <string.h>

/* exp(x) for x <= 0 (max-subtracted scores, sigmoid): Cephes' expf
 * polynomial, written so the compiler vectorises it. */
static inline float exp_nonpos(float x)
{
    x = x < -87.f ? -87.f : x;
    const float n = __builtin_floorf(x * 1.44269504f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* tanh(x), vectorisable: an odd Taylor polynomial below |x| = 1/4 (where
 * (1 - e) / (1 + e) would lose digits to cancellation; the first term left out
 * is under 1e-8 there), the exp of the non-positive -2|x| above. */
static inline float tanh_f32(float x)
{
    const float a = __builtin_fabsf(x), a2 = a * a;
    const float small =
        a * (1.f + a2 * (-1.f / 3.f + a2 * (2.f / 15.f + a2 * (-17.f / 315.f
                                                               + a2 * (62.f / 2835.f)))));
    const float e = exp_nonpos(-2.f * a);
    const float t = a < 0.25f ? small : (1.f - e) / (1.f + e);
    return x < 0.f ? -t : t;
}

/* x * sigmoid(x), through exp of the non-positive -|x| only. */
static inline float silu_f32(float x)
{
    const float e = exp_nonpos(x < 0.f ? x : -x);
    const float s = x >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
    return x * s;
}

/* bf16 <-> fp32: widening is exact; narrowing rounds to nearest even, as
 * torch does (no value here is nan). */
static inline float bf16_to_f32(uint16_t h)
{
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f)
{
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* Element i of an fp32 or (bf16 != 0) bf16 array, as float. With bf16 a
 * compile-time constant in an always-inline caller, the branch folds away. */
static inline __attribute__((always_inline)) float ld(const void *p, int64_t i, int bf16)
{
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Store v as element i of an fp32 or bf16 array (rounded for bf16). */
static inline __attribute__((always_inline)) void st(void *p, int64_t i, float v, int bf16)
{
    if (bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* v as the array type holds it: rounded to bf16 and back, or as is. */
static inline __attribute__((always_inline)) float rnd(float v, int bf16)
{
    return bf16 ? bf16_to_f32(f32_to_bf16(v)) : v;
}

#endif
