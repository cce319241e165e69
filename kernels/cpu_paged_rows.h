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
 * to keys [0, lens[r]) and reads q / writes out at r * row_stride floats. D a
 * multiple of 16. Keys are taken TILE at a time, per KV head: the tile's rows are widened
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
                 const char *kc, const char *vc, const int32_t *table, int64_t h0,
                 int64_t h1, int64_t G, int64_t D, int64_t B, int64_t num_blocks,
                 int64_t tok_stride, int64_t blk_stride, float scale, float *sc, float *out,
                 int kind, float *stats)
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
    if (!table_ok(table, 0, L, B, num_blocks))
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
            softmax_row(sc + (r * nq + i) * Lp, Lr,
                        stats == NULL ? NULL : stats + 2 * (r * (row_stride / D) + h0 * G + i));
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

#endif
