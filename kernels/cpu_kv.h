/*
 * Shared pieces of the native paged attention kernels (cpu_paged_decode.c and
 * cpu_paged_rows.h): the KV cache element kinds and their exact widening to
 * fp32, addressing a token's row through a block table, prefetching the next
 * block, and the sixteen-lane score reduction.
 */
#ifndef PAGEDSERVE_CPU_KV_H
#define PAGEDSERVE_CPU_KV_H

#include <stdint.h>

#include "cpu_math.h"

/* Head sizes the kernel takes (the Python side checks): Llama-family heads are 64-256. */
#define MAX_HEAD_DIM 576

enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2, KV_E4M3 = 3, KV_E5M2 = 4 };

/* A small float format's magnitude bits (mantissa mbits wide, exponent bias
 * bias; sub_scale = 2^(1 - bias - mbits)) -> fp32, exact, then the sign bit
 * or-ed back. Normals are
 * rebiased in the integer domain; subnormals (exponent field 0) are
 * mantissa * sub_scale, computed from an integer. No fp32
 * denormal is ever formed: x86 cores take a slow microcode assist on those. */
static inline __attribute__((always_inline)) float
small_float_to_f32(uint32_t mag, uint32_t sign_bit, int mbits, int bias, float sub_scale)
{
    const uint32_t nbits = (mag << (23 - mbits)) + ((uint32_t)(127 - bias) << 23);
    float f;
    memcpy(&f, &nbits, sizeof f);
    if ((mag >> mbits) == 0)
        f = (float)(int32_t)mag * sub_scale;
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits |= sign_bit;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* fp16 bits -> fp32 (our stores saturate, so no element is inf or nan). */
static inline float f16_bits_to_f32(uint32_t h)
{
    return small_float_to_f32(h & 0x7fffu, (h & 0x8000u) << 16, 10, 15, 0x1p-24f);
}

/* E4M3FN byte -> fp32. */
static inline float e4m3_to_f32(uint32_t b)
{
    return small_float_to_f32(b & 0x7fu, (b & 0x80u) << 24, 3, 7, 0x1p-9f);
}

/* Element i of a cache of the given kind, as float. The kind is a
 * compile-time constant in always-inline callers, so the switch folds away. */
static inline __attribute__((always_inline)) float ld_kv(const void *p, int64_t i, int kind)
{
    switch (kind) {
    case KV_BF16:
        return bf16_to_f32(((const uint16_t *)p)[i]);
    case KV_F16:
        return f16_bits_to_f32(((const uint16_t *)p)[i]);
    case KV_E4M3:
        return e4m3_to_f32(((const uint8_t *)p)[i]);
    case KV_E5M2:
        return f16_bits_to_f32((uint32_t)((const uint8_t *)p)[i] << 8);
    default:
        return ((const float *)p)[i];
    }
}

static inline int64_t kv_elem_size(int kind)
{
    return kind == KV_F32 ? 4 : kind <= KV_F16 ? 2 : 1;
}

/* Head row src (D elements) as fp32: the row itself for fp32 caches, else
 * widened once into buf, so the G query heads sharing it do not each convert. */
static inline __attribute__((always_inline)) const float *
row_f32(const char *__restrict src, int64_t D, int kind, float *__restrict buf)
{
    if (kind == KV_F32)
        return (const float *)src;
    for (int64_t d = 0; d < D; d++)
        buf[d] = ld_kv(src, d, kind);
    return buf;
}

/* Token t's row (from KV head h0 on) in cache c. */
static inline const char *token_row(const char *c, const int32_t *table, int64_t t, int64_t B,
                                    int64_t blk_stride, int64_t tok_stride, int64_t h0,
                                    int64_t D, int64_t es)
{
    return c + ((int64_t)table[t / B] * blk_stride + (t % B) * tok_stride + h0 * D) * es;
}

/* Ask for the same row (n elements) of the sequence's next block, which the loop
 * reaches B tokens later (once per token, between the math). */
static inline void prefetch_next(const char *c, const int32_t *table, int64_t t, int64_t L,
                                 int64_t B, int64_t blk_stride, int64_t tok_stride,
                                 int64_t h0, int64_t D, int64_t n, int64_t es)
{
    if (t + B >= L)
        return;
    const char *next = token_row(c, table, t + B, B, blk_stride, tok_stride, h0, D, es);
    for (int64_t off = 0; off < n * es; off += 64)
        __builtin_prefetch(next + off);
}

/* Sixteen lanes of fp32; aligned(4) lets it load from any float address. On
 * CPUs without 512-bit vectors the compiler splits it into narrower ones. */
typedef float v16f __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64)));
#define TILE 16

/* Lane j of the result is the sum of p[j]'s lanes: sixteen dot products reduced
 * together by four rounds of pairwise shuffles (45 ops instead of 16 separate
 * horizontal sums of 8 dependent ops each). */
static inline __attribute__((always_inline)) v16f reduce16(const v16f *p)
{
    const v16i l1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const v16i h1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const v16i l2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const v16i h2 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const v16i l3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const v16i h3 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const v16i l4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const v16i h4 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    v16f a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = __builtin_shuffle(p[2 * i], p[2 * i + 1], l1)
               + __builtin_shuffle(p[2 * i], p[2 * i + 1], h1);
    for (int i = 0; i < 4; i++)
        b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], l2)
               + __builtin_shuffle(a[2 * i], a[2 * i + 1], h2);
    for (int i = 0; i < 2; i++)
        c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], l3)
               + __builtin_shuffle(b[2 * i], b[2 * i + 1], h3);
    return __builtin_shuffle(c[0], c[1], l4) + __builtin_shuffle(c[0], c[1], h4);
}


/* Whether every block tokens [first, L) of a table name lies in [0, num_blocks). */
static inline int table_ok(const int32_t *table, int64_t first, int64_t L, int64_t B,
                           int64_t num_blocks)
{
    for (int64_t j = first / B; j < (L + B - 1) / B; j++)
        if (table[j] < 0 || table[j] >= num_blocks)
            return 0;
    return 1;
}

/* Scores row[0, L) (L > 0, 64-byte aligned) -> their softmax, in place; stats
 * (NULL or 2 floats) <- the max score and the sum of exp(score - max). A cap > 0
 * first bounds each score s to cap * tanh(s / cap) (Gemma 2's attention softcap).
 * One function for the one-row and the runs kernels: a row's softmax is the same
 * arithmetic in both. */
static inline __attribute__((always_inline)) void softmax_row(float *row, int64_t L,
                                                              float *stats, float cap)
{
    if (cap > 0.f)
        for (int64_t t = 0; t < L; t++)
            row[t] = cap * tanh_f32(row[t] / cap);
    float mx = row[0];
    for (int64_t t = 1; t < L; t++)
        mx = row[t] > mx ? row[t] : mx;
    float sum = 0.f;
    for (int64_t t = 0; t < L; t++) {
        row[t] = exp_nonpos(row[t] - mx);
        sum += row[t];
    }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < L; t++)
        row[t] *= inv;
    if (stats != NULL) {
        stats[0] = mx;
        stats[1] = sum;
    }
}

#endif
