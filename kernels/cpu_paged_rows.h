/*
 * Runs of query rows that share one block table (a prefill's rows, or decode
 * rows over a shared prefix): attend_rows_impl, included by
 * cpu_paged_decode.c, which dispatches a one-row task to attend_row_impl and a
 * run to this. Both do a row's arithmetic in the same order (batch-invariant
 * mode checks it at load).
 */
#ifndef PAGEDSERVE_CPU_PAGED_ROWS_H
#define PAGEDSERVE_CPU_PAGED_ROWS_H

#include <string.h>

#include "cpu_kv.h"

/* Row r's first key: 0 without starts. */
static inline int64_t row_start(const int32_t *starts, int64_t r)
{
    return starts == NULL ? 0 : starts[r];
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

/* Query head g of KV head h of the m / G-th row (m = r * G + g). */
static inline const float *q_head(const float *q, int64_t row_stride, int64_t m, int64_t G,
                                  int64_t h, int64_t D)
{
    return q + (m / G) * row_stride + (h * G + m % G) * D;
}

/* KV heads [h0, h1) of R query rows that share one block table (one sequence's
 * consecutive prefill rows, or decode rows over one shared prefix); row r attends
 * to keys [starts[r], lens[r]) (starts NULL: from 0; a sliding window gives each
 * row its own first key) and reads q / writes out at r * row_stride floats. D a
 * multiple of 16. Keys are taken TILE at a time, per KV head: the tile's rows are widened
 * once and then stay in L1 while every query head of every row that shares them
 * passes over them, so a prefill's K/V cross the cache hierarchy once per R rows
 * instead of once per row, and each query (scores) or output accumulator
 * (values) stays in registers for the whole tile. Scores: a query head's dot
 * products with the tile's keys are left as partial vectors and reduced sixteen
 * at a time; values: accumulated key by key.
 *
 * A row's arithmetic is the same sequence of operations whatever R is and
 * whichever rows share its call (the loops over rows only skip keys outside a
 * row's range, and a row's scores start at an aligned offset of its own, as a row
 * alone's do): batch-invariant mode relies on a row's bits not depending on how
 * the scheduler cut its prefill. */
static inline __attribute__((always_inline)) int
attend_rows_impl(const float *q, int64_t row_stride, const int32_t *lens,
                 const int32_t *starts, int64_t R, const char *kc, const char *vc,
                 const int32_t *table, int64_t h0, int64_t h1, int64_t G, int64_t D, int64_t B,
                 int64_t num_blocks, int64_t tok_stride, int64_t blk_stride, float scale,
                 float softcap, float *sc, float *out, int kind, float *stats)
{
    const int64_t es = kv_elem_size(kind);
    const int64_t nh = h1 - h0, nq = nh * G, nv = D / 16;
    float buf[TILE * MAX_HEAD_DIM];
    const float *rows[TILE];
    v16f part[2][TILE];
    int64_t L = 0, lo = -1, Lw = 0;
    for (int64_t r = 0; r < R; r++) {
        if (lens[r] <= 0)
            continue;
        const int64_t s0 = row_start(starts, r);
        L = lens[r] > L ? lens[r] : L;
        lo = lo < 0 || s0 < lo ? s0 : lo;
        Lw = lens[r] - s0 > Lw ? lens[r] - s0 : Lw;
    }
    if (lo < 0)
        lo = 0;
    /* Row r's score for key t sits at t - starts[r] of its score row, and score
     * rows start 64-byte aligned (sc is), so a vectorised loop over a row splits
     * it the same way wherever the row sits and whichever rows share the call. */
    const int64_t Lp = (Lw + TILE - 1) / TILE * TILE;
    if (!table_ok(table, lo, L, B, num_blocks))
        return -2;
    for (int64_t t0 = lo; t0 < L; t0 += TILE) {
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
                    const int64_t r = (m + u) / G, s0 = row_start(starts, r);
                    const int64_t nr = lens[r] - t0 < n ? lens[r] - t0 : n;
                    const int64_t j0 = s0 > t0 ? s0 - t0 : 0;
                    if (nr <= j0)
                        continue;
                    for (int64_t j = nr; j < TILE; j++)
                        part[u][j] = (v16f){0};
                    const v16f sv = reduce16(part[u]) * scale;
                    float *dst = sc + (r * nq + h * G + (m + u) % G) * Lp + t0 - s0;
                    if (nr == TILE && j0 == 0 && (t0 - s0) % TILE == 0)
                        *(v16f *)dst = sv;
                    else
                        for (int64_t j = j0; j < nr; j++)
                            dst[j] = sv[j];
                }
            }
        }
    }
    for (int64_t r = 0; r < R; r++) {
        const int64_t Lr = lens[r] - row_start(starts, r);
        for (int64_t i = 0; i < nq && Lr > 0; i++) {
            softmax_row(sc + (r * nq + i) * Lp, Lr,
                        stats == NULL ? NULL : stats + 2 * (r * (row_stride / D) + h0 * G + i),
                        softcap);
        }
        memset(out + r * row_stride + h0 * G * D, 0, (size_t)(nq * D) * sizeof(float));
    }
    for (int64_t t0 = lo; t0 < L; t0 += TILE) {
        const int64_t n = L - t0 < TILE ? L - t0 : TILE;
        for (int64_t j = 0; j < n; j++)
            prefetch_next(vc, table, t0 + j, L, B, blk_stride, tok_stride, h0, D, nh * D, es);
        for (int64_t h = 0; h < nh; h++) {
            tile_rows(rows, vc, table, t0, n, h0 + h, B, blk_stride, tok_stride, D, kind, buf);
            /* Two query heads at a time again: each value chunk loaded once for
             * both accumulators over the keys both rows reach, each alone over the
             * rest; every accumulator still takes its keys in ascending order. */
            for (int64_t m = 0; m < R * G; m += 2) {
                const int64_t two = m + 1 < R * G;
                const int64_t ra = m / G, rb = (m + two) / G;
                const int64_t sa = row_start(starts, ra), sb = row_start(starts, rb);
                const int64_t a0 = sa > t0 ? sa - t0 : 0;
                const int64_t a1 = lens[ra] - t0 < n ? lens[ra] - t0 : n;
                const int64_t b0 = sb > t0 ? sb - t0 : 0;
                const int64_t b1 = two ? (lens[rb] - t0 < n ? lens[rb] - t0 : n) : 0;
                const float *wa = sc + (ra * nq + h * G + m % G) * Lp + t0 - sa;
                const float *wb = sc + (rb * nq + h * G + (m + two) % G) * Lp + t0 - sb;
                float *oa = out + ra * row_stride + ((h0 + h) * G + m % G) * D;
                float *ob = out + rb * row_stride + ((h0 + h) * G + (m + two) % G) * D;
                v16f a[MAX_HEAD_DIM / 16], b[MAX_HEAD_DIM / 16];
                for (int64_t c = 0; c < nv; c++) {
                    a[c] = *(const v16f *)(oa + 16 * c);
                    b[c] = *(const v16f *)(ob + 16 * c);
                }
                /* [lo2, hi2): the keys both reach (empty when the ranges miss). */
                const int64_t lo2 = a0 > b0 ? a0 : b0, hi2 = a1 < b1 ? a1 : b1;
                const int64_t a_mid = lo2 < hi2 ? lo2 : a1, b_mid = lo2 < hi2 ? lo2 : b1;
                for (int64_t k = a0; k < a_mid; k++)
                    for (int64_t c = 0; c < nv; c++)
                        a[c] += wa[k] * *(const v16f *)(rows[k] + 16 * c);
                for (int64_t k = b0; k < b_mid; k++)
                    for (int64_t c = 0; c < nv; c++)
                        b[c] += wb[k] * *(const v16f *)(rows[k] + 16 * c);
                for (int64_t j = lo2; j < hi2; j++)
                    for (int64_t c = 0; c < nv; c++) {
                        const v16f v = *(const v16f *)(rows[j] + 16 * c);
                        a[c] += wa[j] * v;
                        b[c] += wb[j] * v;
                    }
                for (int64_t k = hi2 > a_mid ? hi2 : a_mid; k < a1; k++)
                    for (int64_t c = 0; c < nv; c++)
                        a[c] += wa[k] * *(const v16f *)(rows[k] + 16 * c);
                for (int64_t k = hi2 > b_mid ? hi2 : b_mid; k < b1; k++)
                    for (int64_t c = 0; c < nv; c++)
                        b[c] += wb[k] * *(const v16f *)(rows[k] + 16 * c);
                for (int64_t c = 0; c < nv; c++) {
                    if (a1 > a0)
                        *(v16f *)(oa + 16 * c) = a[c];
                    if (b1 > b0)
                        *(v16f *)(ob + 16 * c) = b[c];
                }
            }
        }
    }
    return 0;
}

#endif
