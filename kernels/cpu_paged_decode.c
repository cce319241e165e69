/*
 * Paged decode attention for CPU, fp32: one query token per sequence reads
 * its K/V straight out of the block pool, so nothing is gathered into a
 * padded copy first (the torch path copies every context token once per
 * layer and SDPA then reads the copy again).
 *
 * Layout (pagedserve.kernels): caches [num_blocks, B, Hkv, D]; q and out
 * [S, Hq, D] with query head h*G + g served by KV head h (G = Hq / Hkv);
 * block tables [S, table_stride] int32; lens [S] int32.
 *
 * Work is split over (sequence, KV head) pairs with OpenMP; the library links
 * the libgomp torch has already loaded, so it shares torch's thread pool.
 * Per pair: scores for all G query heads in one pass over K, a max-subtracted
 * softmax, one pass over V. No value is ever -inf, so fast-math is safe.
 * The "cpu" backend also runs short prefills here, one row per query whose
 * keys stop at its own position (kernels/cpu_backend.py).
 *
 * Blocks sit anywhere in the pool, so the hardware prefetcher loses the
 * stream at every block boundary: each token's row asks for the same row of
 * the sequence's next block in advance (1.3-1.5x on batches whose K/V do not
 * fit in cache). The body is compiled for head sizes 64 and 128 as constants.
 *
 * Caches are fp32, bf16, fp16 or fp8 (E4M3FN, E5M2): every element is
 * widened to fp32 exactly as it is loaded, so the math is the fp32 kernel's
 * and a narrow pool is read at half or a quarter of the bytes (the decode is
 * memory-bound). q and out stay fp32.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"

/* Head sizes the kernel takes (the Python side checks): Llama-family heads are 64-256. */
#define MAX_HEAD_DIM 256

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

/* Tile [t0, t0 + n) of KV head h's rows in cache c as fp32 row pointers: into
 * the pool itself for fp32 caches, else widened into buf (TILE rows of D). */
static inline __attribute__((always_inline)) void
tile_rows(const float **rows, const char *c, const int32_t *table, int64_t t0, int64_t n,
          int64_t h, int64_t B, int64_t blk_stride, int64_t tok_stride, int64_t D,
          int kind, float *buf)
{
    const int64_t es = kv_elem_size(kind);
    for (int64_t j = 0; j < n; j++) {
        const char *src = token_row(c, table, t0 + j, B, blk_stride, tok_stride, h, D, es);
        rows[j] = row_f32(src, D, kind, buf + j * D);
    }
}

/* KV heads [h0, h1) of one query row (a decode row, or a prefill row alone),
 * D a multiple of 16: attend_rows_impl for R = 1, with the same arithmetic in
 * the same order, but laid out for one row's memory-bound pass (1.5-2x
 * attend_rows_impl's speed there). Tokens are visited in
 * memory order (a token's rows for all its heads are contiguous), TILE at a
 * time, each row widened once for the G query heads that share it. Scores:
 * each query head's dot products with the tile's keys are left as partial
 * vectors and reduced sixteen at a time; values: one pass over each token's
 * rows, accumulated into the output rows (in L1). */
static inline __attribute__((always_inline)) int
attend_row_impl(const float *q, const char *kc, const char *vc, const int32_t *table, int64_t L,
            int64_t h0, int64_t h1, int64_t G, int64_t D, int64_t B, int64_t num_blocks,
            int64_t tok_stride, int64_t blk_stride, float scale, float *sc, float *out,
            int kind, v16f *part, float *lse)
{
    const int64_t es = kv_elem_size(kind);
    const int64_t nh = h1 - h0, nq = nh * G, nv = D / 16;
    float wide[MAX_HEAD_DIM];
    const int64_t Lp = (L + TILE - 1) / TILE * TILE; /* as in attend_rows_impl */
    const int64_t nb = (L + B - 1) / B;
    for (int64_t j = 0; j < nb; j++)
        if (table[j] < 0 || table[j] >= num_blocks)
            return -2;
    for (int64_t t0 = 0; t0 < L; t0 += TILE) {
        const int64_t n = L - t0 < TILE ? L - t0 : TILE;
        for (int64_t j = 0; j < n; j++) {
            const int64_t t = t0 + j;
            prefetch_next(kc, table, t, L, B, blk_stride, tok_stride, h0, D, nh * D, es);
            const char *k = token_row(kc, table, t, B, blk_stride, tok_stride, h0, D, es);
            for (int64_t h = 0; h < nh; h++) {
                const float *kh = row_f32(k + h * D * es, D, kind, wide);
                for (int64_t g = 0; g < G; g++) {
                    const float *qi = q + ((h0 + h) * G + g) * D;
                    v16f acc = {0};
                    for (int64_t c = 0; c < nv; c++)
                        acc += *(const v16f *)(qi + 16 * c) * *(const v16f *)(kh + 16 * c);
                    part[(h * G + g) * TILE + j] = acc;
                }
            }
        }
        for (int64_t i = 0; i < nq; i++) {
            v16f *p = part + i * TILE;
            for (int64_t j = n; j < TILE; j++)
                p[j] = (v16f){0};
            const v16f s = reduce16(p) * scale;
            float *dst = sc + i * Lp + t0;
            if (n == TILE)
                *(v16f *)dst = s;
            else
                for (int64_t j = 0; j < n; j++)
                    dst[j] = s[j];
        }
    }
    for (int64_t i = 0; i < nq; i++) {
        float *row = sc + i * Lp;
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
        if (lse != NULL) {
            lse[2 * (h0 * G + i)] = mx;
            lse[2 * (h0 * G + i) + 1] = sum;
        }
    }
    float *o = out + h0 * G * D;
    memset(o, 0, (size_t)(nq * D) * sizeof(float));
    for (int64_t t = 0; t < L; t++) {
        prefetch_next(vc, table, t, L, B, blk_stride, tok_stride, h0, D, nh * D, es);
        const char *v = token_row(vc, table, t, B, blk_stride, tok_stride, h0, D, es);
        for (int64_t h = 0; h < nh; h++) {
            const float *vh = row_f32(v + h * D * es, D, kind, wide);
            for (int64_t g = 0; g < G; g++) {
                const float w = sc[(h * G + g) * Lp + t];
                float *oi = o + (h * G + g) * D;
                for (int64_t c = 0; c < nv; c++)
                    *(v16f *)(oi + 16 * c) += w * *(const v16f *)(vh + 16 * c);
            }
        }
    }
    return 0;
}

/* Query head g of KV head h of the m / G-th row (m = r * G + g). */
static inline const float *q_head(const float *q, int64_t row_stride, int64_t m, int64_t G,
                                  int64_t h, int64_t D)
{
    return q + (m / G) * row_stride + (h * G + m % G) * D;
}

/* KV heads [h0, h1) of R query rows that share one block table (one sequence's
 * consecutive prefill rows, or a decode row alone); row r attends to keys
 * [0, lens[r]) and reads q / writes out at r * row_stride floats. D a multiple of
 * 16. Keys are taken TILE at a time, per KV head: the tile's rows are widened
 * once and then stay in L1 while every query head of every row that shares them
 * passes over them, so a prefill's K/V cross the cache hierarchy once per R rows
 * instead of once per row, and each query (scores) or output accumulator
 * (values) stays in registers for the whole tile. Scores: a query head's dot
 * products with the tile's keys are left as partial vectors and reduced sixteen
 * at a time; values: accumulated key by key.
 *
 * A row's arithmetic is the same sequence of operations whatever R is and
 * whichever rows share its call (the loops over rows only skip keys past a row's
 * length): batch-invariant mode relies on a row's bits not depending on how the
 * scheduler cut its prefill. */
static inline __attribute__((always_inline)) int
attend_rows_impl(const float *q, int64_t row_stride, const int32_t *lens, int64_t R,
            const char *kc, const char *vc, const int32_t *table, int64_t h0, int64_t h1,
            int64_t G, int64_t D, int64_t B, int64_t num_blocks, int64_t tok_stride,
            int64_t blk_stride, float scale, float *sc, float *out, int kind, float *lse)
{
    const int64_t es = kv_elem_size(kind);
    const int64_t nh = h1 - h0, nq = nh * G, nv = D / 16;
    float buf[TILE * MAX_HEAD_DIM];
    const float *rows[TILE];
    v16f part[2][TILE];
    int64_t L = 0;
    for (int64_t r = 0; r < R; r++)
        L = lens[r] > L ? lens[r] : L;
    /* Score rows start 64-byte aligned (sc is), so a vectorised loop over a row
     * splits it the same way wherever the row sits. */
    const int64_t Lp = (L + TILE - 1) / TILE * TILE;
    const int64_t nb = (L + B - 1) / B;
    for (int64_t j = 0; j < nb; j++)
        if (table[j] < 0 || table[j] >= num_blocks)
            return -2;
    for (int64_t t0 = 0; t0 < L; t0 += TILE) {
        const int64_t n = L - t0 < TILE ? L - t0 : TILE;
        for (int64_t j = 0; j < n; j++)
            prefetch_next(kc, table, t0 + j, L, B, blk_stride, tok_stride, h0, D, nh * D, es);
        for (int64_t h = 0; h < nh; h++) {
            tile_rows(rows, kc, table, t0, n, h0 + h, B, blk_stride, tok_stride, D, kind, buf);
            /* Query heads (r, g) two at a time, m = r * G + g: each key chunk loaded
             * once for both. All n keys are scored; those past a row's length
             * are zeroed before the reduction, as attend_row_impl pads its last tile. */
            for (int64_t m = 0; m < R * G; m += 2) {
                const int64_t two = m + 1 < R * G;
                const float *qa = q_head(q, row_stride, m, G, h0 + h, D);
                const float *qb = q_head(q, row_stride, m + two, G, h0 + h, D);
                v16f va[MAX_HEAD_DIM / 16], vb[MAX_HEAD_DIM / 16];
                for (int64_t c = 0; c < nv; c++) {
                    va[c] = *(const v16f *)(qa + 16 * c);
                    vb[c] = *(const v16f *)(qb + 16 * c);
                }
                for (int64_t j = 0; j < n; j++) {
                    v16f a = {0}, b = {0};
                    for (int64_t c = 0; c < nv; c++) {
                        const v16f k = *(const v16f *)(rows[j] + 16 * c);
                        a += va[c] * k;
                        b += vb[c] * k;
                    }
                    part[0][j] = a;
                    part[1][j] = b;
                }
                for (int64_t u = 0; u <= two; u++) {
                    const int64_t r = (m + u) / G;
                    const int64_t nr = lens[r] - t0 < n ? lens[r] - t0 : n;
                    if (nr <= 0)
                        continue;
                    for (int64_t j = nr; j < TILE; j++)
                        part[u][j] = (v16f){0};
                    const v16f sv = reduce16(part[u]) * scale;
                    float *dst = sc + (r * nq + h * G + (m + u) % G) * Lp + t0;
                    if (nr == TILE)
                        *(v16f *)dst = sv;
                    else
                        for (int64_t j = 0; j < nr; j++)
                            dst[j] = sv[j];
                }
            }
        }
    }
    for (int64_t r = 0; r < R; r++) {
        const int64_t Lr = lens[r];
        for (int64_t i = 0; i < nq && Lr > 0; i++) {
            float *row = sc + (r * nq + i) * Lp;
            float mx = row[0];
            for (int64_t t = 1; t < Lr; t++)
                mx = row[t] > mx ? row[t] : mx;
            float sum = 0.f;
            for (int64_t t = 0; t < Lr; t++) {
                row[t] = exp_nonpos(row[t] - mx);
                sum += row[t];
            }
            const float inv = 1.f / sum;
            for (int64_t t = 0; t < Lr; t++)
                row[t] *= inv;
            if (lse != NULL) {
                lse[2 * (r * (row_stride / D) + h0 * G + i)] = mx;
                lse[2 * (r * (row_stride / D) + h0 * G + i) + 1] = sum;
            }
        }
        memset(out + r * row_stride + h0 * G * D, 0, (size_t)(nq * D) * sizeof(float));
    }
    for (int64_t t0 = 0; t0 < L; t0 += TILE) {
        const int64_t n = L - t0 < TILE ? L - t0 : TILE;
        for (int64_t j = 0; j < n; j++)
            prefetch_next(vc, table, t0 + j, L, B, blk_stride, tok_stride, h0, D, nh * D, es);
        for (int64_t h = 0; h < nh; h++) {
            tile_rows(rows, vc, table, t0, n, h0 + h, B, blk_stride, tok_stride, D, kind, buf);
            /* Two query heads at a time again: each value chunk loaded once for
             * both accumulators, over the keys both rows reach, then each alone. */
            for (int64_t m = 0; m < R * G; m += 2) {
                const int64_t two = m + 1 < R * G;
                const int64_t ra = m / G, rb = (m + two) / G;
                const int64_t n_a = lens[ra] - t0 < n ? lens[ra] - t0 : n;
                const int64_t n_b = two ? (lens[rb] - t0 < n ? lens[rb] - t0 : n) : 0;
                const float *wa = sc + (ra * nq + h * G + m % G) * Lp + t0;
                const float *wb = sc + (rb * nq + h * G + (m + two) % G) * Lp + t0;
                float *oa = out + ra * row_stride + ((h0 + h) * G + m % G) * D;
                float *ob = out + rb * row_stride + ((h0 + h) * G + (m + two) % G) * D;
                v16f a[MAX_HEAD_DIM / 16], b[MAX_HEAD_DIM / 16];
                for (int64_t c = 0; c < nv; c++) {
                    a[c] = *(const v16f *)(oa + 16 * c);
                    b[c] = *(const v16f *)(ob + 16 * c);
                }
                const int64_t both = n_a < n_b ? n_a : n_b;
                int64_t j = 0;
                for (; j < both; j++)
                    for (int64_t c = 0; c < nv; c++) {
                        const v16f v = *(const v16f *)(rows[j] + 16 * c);
                        a[c] += wa[j] * v;
                        b[c] += wb[j] * v;
                    }
                for (int64_t k = j; k < n_a; k++)
                    for (int64_t c = 0; c < nv; c++)
                        a[c] += wa[k] * *(const v16f *)(rows[k] + 16 * c);
                for (int64_t k = j; k < n_b; k++)
                    for (int64_t c = 0; c < nv; c++)
                        b[c] += wb[k] * *(const v16f *)(rows[k] + 16 * c);
                for (int64_t c = 0; c < nv; c++) {
                    if (n_a > 0)
                        *(v16f *)(oa + 16 * c) = a[c];
                    if (n_b > 0)
                        *(v16f *)(ob + 16 * c) = b[c];
                }
            }
        }
    }
    return 0;
}

/* attend_*_impl with the common head sizes and each cache kind as constants. */
#define ATTEND_ARGS q, row_stride, lens, R, kc, vc, table, h0, h1, G
#define ATTEND_TAIL B, num_blocks, tok_stride, blk_stride, scale, sc, out
#define ATTEND_D(K, DD)                                                                      \
    do {                                                                                     \
        if (R == 1)                                                                          \
            return attend_row_impl(q, kc, vc, table, lens[0], h0, h1, G, DD, ATTEND_TAIL,    \
                                   K, part, lse);                                            \
        return attend_rows_impl(ATTEND_ARGS, DD, ATTEND_TAIL, K, lse);                       \
    } while (0)
#define ATTEND_KIND(K)                                                                       \
    do {                                                                                     \
        if (D == 64)                                                                         \
            ATTEND_D(K, 64);                                                                 \
        if (D == 128)                                                                        \
            ATTEND_D(K, 128);                                                                \
        ATTEND_D(K, D);                                                                      \
    } while (0)
static int attend(const float *q, int64_t row_stride, const int32_t *lens, int64_t R,
                  const char *kc, const char *vc, const int32_t *table, int64_t h0,
                  int64_t h1, int64_t G, int64_t D, int64_t B, int64_t num_blocks,
                  int64_t tok_stride, int64_t blk_stride, float scale, float *sc, float *out,
                  int kind, v16f *part, float *lse)
{
    switch (kind) {
    case KV_BF16:
        ATTEND_KIND(KV_BF16);
    case KV_F16:
        ATTEND_KIND(KV_F16);
    case KV_E4M3:
        ATTEND_KIND(KV_E4M3);
    case KV_E5M2:
        ATTEND_KIND(KV_E5M2);
    default:
        ATTEND_KIND(KV_F32);
    }
}

/*
 * A task is a group of rows (chunks[c] to chunks[c + 1]; every row its own
 * group when chunks is NULL) that share the first row's block table, over all
 * KV heads or, when there are too few groups to keep every thread busy, over
 * one KV head. Returns 0; -1 when a scratch allocation failed; -2 when a block
 * id a row needs is outside [0, num_blocks). On error out is undefined.
 */
static int paged_decode(const float *q, const char *key_cache, const char *value_cache,
                        int64_t num_blocks, const int32_t *tables, int64_t table_stride,
                        const int32_t *lens, int64_t S, const int32_t *chunks,
                        int64_t num_chunks, int64_t Hq, int64_t Hkv, int64_t D, int64_t B,
                        float scale, float *out, int nthreads, int kind, float *lse)
{
    const int64_t G = Hq / Hkv;
    const int64_t tok_stride = Hkv * D;
    const int64_t blk_stride = B * tok_stride;
    const int64_t ntasks = chunks == NULL ? S : num_chunks;
    /* Groups of rows always split by KV head: their score rows (R x G x keys)
     * then stay in L2 for the softmax and value passes. */
    const int64_t split = chunks == NULL && ntasks >= 4 * (int64_t)nthreads ? 1 : Hkv;
    const int64_t per = Hkv / split;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(min : failed)
    {
        float *sc = NULL;
        int64_t cap = 0;
        /* Partial score vectors of one tile for attend_row_impl: TILE per query head. */
        v16f *part = (v16f *)malloc((size_t)(per * G * TILE) * sizeof(v16f));
        if (part == NULL)
            failed = -1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < ntasks * split; task++) {
            const int64_t c = task / split;
            const int64_t s = chunks == NULL ? c : chunks[c];
            const int64_t R = chunks == NULL ? 1 : chunks[c + 1] - s;
            const int64_t h0 = (task % split) * per;
            int64_t L = 0;
            for (int64_t r = 0; r < R; r++)
                L = lens[s + r] > L ? lens[s + r] : L;
            if (L <= 0 || failed < 0 || part == NULL) {
                for (int64_t r = 0; r < R; r++)
                    memset(out + ((s + r) * Hq + h0 * G) * D, 0,
                           (size_t)(per * G * D) * sizeof(float));
                continue;
            }
            const int64_t need = R * ((L + TILE - 1) / TILE * TILE) * per * G;
            if (need > cap) {
                free(sc);
                cap = need;
                sc = (float *)aligned_alloc(64, (size_t)cap * sizeof(float));
                if (sc == NULL) {
                    cap = 0;
                    failed = -1;
                    continue;
                }
            }
            const int rc = attend(q + s * Hq * D, Hq * D, lens + s, R, key_cache, value_cache,
                                  tables + s * table_stride, h0, h0 + per, G, D, B,
                                  num_blocks, tok_stride, blk_stride, scale, sc,
                                  out + s * Hq * D, kind, part,
                                  lse == NULL ? NULL : lse + 2 * s * Hq);
            if (rc < failed)
                failed = rc;
        }
        free(sc);
        free(part);
    }
    return failed;
}

/* Exported entry: caches of the given kind (KV_* above, raw elements); q and
 * out are fp32. lse (NULL or [S, Hq, 2] fp32) receives each row and query
 * head's softmax statistics, its largest scaled score m and sum of exp(score -
 * m), for merging attention over split key ranges (rows with no keys leave
 * theirs unwritten; no logf here: a libm call in the softmax loop cost decode
 * 15-45%). */
int paged_decode_kv(const float *q, const void *key_cache, const void *value_cache,
                    int64_t num_blocks, const int32_t *tables, int64_t table_stride,
                    const int32_t *lens, int64_t S, const int32_t *chunks,
                    int64_t num_chunks, int64_t Hq, int64_t Hkv, int64_t D, int64_t B,
                    float scale, float *out, int nthreads, int kind, float *lse)
{
    if (kind < KV_F32 || kind > KV_E5M2 || D > MAX_HEAD_DIM || D % 16 != 0)
        return -3;
    for (int64_t c = 0; chunks != NULL && c < num_chunks; c++)
        if (chunks[c] < 0 || chunks[c + 1] <= chunks[c] || chunks[c + 1] > S)
            return -4;
    return paged_decode(q, (const char *)key_cache, (const char *)value_cache, num_blocks,
                        tables, table_stride, lens, S, chunks, num_chunks, Hq, Hkv, D, B,
                        scale, out, nthreads, kind, lse);
}

/* Store T new tokens' K and V rows (row_bytes each, already in the cache's element
 * type; token t's rows at k + t * k_stride and v + t * v_stride bytes) into flat
 * slots[t] of caches of num_slots slots; slot -1 is skipped. One call per layer
 * where torch's path takes a dozen small ops. Returns 0, or -2 (nothing written)
 * when a slot is outside [-1, num_slots). */
int store_kv_rows(const char *k, int64_t k_stride, const char *v, int64_t v_stride,
                  const int64_t *slots, int64_t T, char *key_cache, char *value_cache,
                  int64_t num_slots, int64_t row_bytes)
{
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < -1 || slots[t] >= num_slots)
            return -2;
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0)
            continue;
        memcpy(key_cache + slots[t] * row_bytes, k + t * k_stride, (size_t)row_bytes);
        memcpy(value_cache + slots[t] * row_bytes, v + t * v_stride, (size_t)row_bytes);
    }
    return 0;
}
