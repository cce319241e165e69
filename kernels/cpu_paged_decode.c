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
 * The "cpu" backend also runs prefills here, one row per query whose keys
 * stop at its own position (kernels/cpu_backend.py), a sequence's rows in
 * runs that read its K/V once per run (cpu_paged_rows.h), and decode rows
 * over a shared prefix the same way (kernels/cpu_cascade.py).
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

#include "cpu_kv.h"
#include "cpu_paged_rows.h"

/* KV heads [h0, h1) of one query row (a decode row, or a prefill row alone) over
 * keys [start, L) (start > 0 under a sliding window), D a multiple of 16:
 * attend_rows_impl for R = 1 (start 0), with the same arithmetic in
 * the same order, but laid out for one row's memory-bound pass (1.5-2x
 * attend_rows_impl's speed there). Tokens are visited in
 * memory order (a token's rows for all its heads are contiguous), TILE at a
 * time, each row widened once for the G query heads that share it. Scores:
 * each query head's dot products with the tile's keys are left as partial
 * vectors and reduced sixteen at a time; values: one pass over each token's
 * rows, accumulated into the output rows (in L1). */
static inline __attribute__((always_inline)) int
attend_row_impl(const float *q, const char *kc, const char *vc, const int32_t *table, int64_t L,
            int64_t start, int64_t h0, int64_t h1, int64_t G, int64_t D, int64_t B,
            int64_t num_blocks, int64_t tok_stride, int64_t blk_stride, float scale, float softcap,
            float *sc, float *out, int kind, v16f *part, float *stats)
{
    const int64_t es = kv_elem_size(kind);
    const int64_t nh = h1 - h0, nq = nh * G, nv = D / 16;
    float wide[MAX_HEAD_DIM];
    const int64_t Lw = L - start; /* keys seen; score u is key start + u */
    const int64_t Lp = (Lw + TILE - 1) / TILE * TILE; /* as in attend_rows_impl */
    if (!table_ok(table, start, L, B, num_blocks))
        return -2;
    for (int64_t t0 = 0; t0 < Lw; t0 += TILE) {
        const int64_t n = Lw - t0 < TILE ? Lw - t0 : TILE;
        for (int64_t j = 0; j < n; j++) {
            const int64_t t = start + t0 + j;
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
        softmax_row(sc + i * Lp, Lw, stats == NULL ? NULL : stats + 2 * (h0 * G + i), softcap);
    }
    float *o = out + h0 * G * D;
    memset(o, 0, (size_t)(nq * D) * sizeof(float));
    for (int64_t t = start; t < L; t++) {
        prefetch_next(vc, table, t, L, B, blk_stride, tok_stride, h0, D, nh * D, es);
        const char *v = token_row(vc, table, t, B, blk_stride, tok_stride, h0, D, es);
        for (int64_t h = 0; h < nh; h++) {
            const float *vh = row_f32(v + h * D * es, D, kind, wide);
            for (int64_t g = 0; g < G; g++) {
                const float w = sc[(h * G + g) * Lp + t - start];
                float *oi = o + (h * G + g) * D;
                for (int64_t c = 0; c < nv; c++)
                    *(v16f *)(oi + 16 * c) += w * *(const v16f *)(vh + 16 * c);
            }
        }
    }
    return 0;
}

/* attend_*_impl with the common head sizes and each cache kind as constants. */
#define ATTEND_ARGS q, row_stride, lens, starts, R, kc, vc, table, h0, h1, G
#define ATTEND_TAIL B, num_blocks, tok_stride, blk_stride, scale, softcap, sc, out
#define ATTEND_D(K, DD)                                                                      \
    do {                                                                                     \
        if (R == 1)                                                                          \
            return attend_row_impl(q, kc, vc, table, lens[0], row_start(starts, 0), h0, h1, \
                                   G, DD, ATTEND_TAIL, K, part, stats);                      \
        return attend_rows_impl(ATTEND_ARGS, DD, ATTEND_TAIL, K, stats);                     \
    } while (0)
#define ATTEND_KIND(K)                                                                       \
    do {                                                                                     \
        if (D == 64)                                                                         \
            ATTEND_D(K, 64);                                                                 \
        if (D == 128)                                                                        \
            ATTEND_D(K, 128);                                                                \
        ATTEND_D(K, D);                                                                      \
    } while (0)
static int attend(const float *q, int64_t row_stride, const int32_t *lens,
                  const int32_t *starts, int64_t R, const char *kc, const char *vc, const int32_t *table, int64_t h0,
                  int64_t h1, int64_t G, int64_t D, int64_t B, int64_t num_blocks,
                  int64_t tok_stride, int64_t blk_stride, float scale, float softcap, float *sc,
                  float *out, int kind, v16f *part, float *stats)
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
 * group when chunks is NULL) that share the first row's block table (starts,
 * NULL or each row's first key under a sliding window), over all
 * KV heads or, when there are too few groups to keep every thread busy, over
 * one KV head. Returns 0; -1 when a scratch allocation failed; -2 when a block
 * id a row needs is outside [0, num_blocks). On error out is undefined.
 */
static int paged_decode(const float *q, const char *key_cache, const char *value_cache,
                        int64_t num_blocks, const int32_t *tables, int64_t table_stride,
                        const int32_t *lens, const int32_t *starts, int64_t S,
                        const int32_t *chunks, int64_t num_chunks, int64_t Hq, int64_t Hkv,
                        int64_t D, int64_t B, float scale, float softcap, float *out, int nthreads,
                        int kind, float *stats)
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
            const int rc = attend(q + s * Hq * D, Hq * D, lens + s,
                                  starts == NULL ? NULL : starts + s, R, key_cache, value_cache,
                                  tables + s * table_stride, h0, h0 + per, G, D, B,
                                  num_blocks, tok_stride, blk_stride, scale, softcap, sc,
                                  out + s * Hq * D, kind, part,
                                  stats == NULL ? NULL : stats + 2 * s * Hq);
            if (rc < failed)
                failed = rc;
        }
        free(sc);
        free(part);
    }
    return failed;
}

/* Exported entry: caches of the given kind (KV_* above, raw elements); q and
 * out are fp32. starts (NULL, or [S] int32) is each row's first key under a
 * sliding window, 0 <= starts[s] < lens[s] where lens[s] > 0 (else -5). softcap
 * > 0 caps each scaled score s to softcap * tanh(s / softcap) (0: none; the stats
 * are then of the capped scores). stats (NULL or [S, Hq, 2] fp32) receives each
 * row and query head's softmax statistics, its largest scaled score m and sum of
 * exp(score - m), for merging attention over split key ranges (rows with no keys
 * leave theirs unwritten; no logf here: a libm call in the softmax loop cost
 * decode 15-45%). */
int paged_decode_kv(const float *q, const void *key_cache, const void *value_cache,
                    int64_t num_blocks, const int32_t *tables, int64_t table_stride,
                    const int32_t *lens, const int32_t *starts, int64_t S,
                    const int32_t *chunks, int64_t num_chunks, int64_t Hq, int64_t Hkv,
                    int64_t D, int64_t B, float scale, float *out, int nthreads, int kind,
                    float *stats, float softcap)
{
    if (kind < KV_F32 || kind > KV_E5M2 || D > MAX_HEAD_DIM || D % 16 != 0)
        return -3;
    for (int64_t s = 0; starts != NULL && s < S; s++)
        if (starts[s] < 0 || (lens[s] > 0 && starts[s] >= lens[s]))
            return -5;
    for (int64_t c = 0; chunks != NULL && c < num_chunks; c++)
        if (chunks[c] < 0 || chunks[c + 1] <= chunks[c] || chunks[c + 1] > S)
            return -4;
    return paged_decode(q, (const char *)key_cache, (const char *)value_cache, num_blocks,
                        tables, table_stride, lens, starts, S, chunks, num_chunks, Hq, Hkv, D,
                        B, scale, softcap, out, nthreads, kind, stats);
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
