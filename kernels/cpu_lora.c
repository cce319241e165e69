/* Multi-LoRA deltas for a batch whose rows run different adapters, in one call
 * per projection (the CPU form of Punica's segmented SGMV).
 *
 * Rows come in segments (start, end, slot): every row of a segment runs the
 * adapter in `slot` of this projection's table. An adapter has up to `npieces`
 * pieces (q/k/v of a fused qkv projection, gate/up, or one); piece p of slot s
 * is the row table[(s * npieces + p) * 5 ..] = {A^T pointer [in, rank], B^T
 * pointer [rank, width], rank, first output column, width}, a null A^T pointer
 * when the adapter does not target that piece (a slot past the table: none of
 * them). For each row x of a segment and
 * each piece: t = x @ A^T (rank values), y[col .. col + width] += t @ B^T.
 *
 * Both products run along the contiguous dimension of the transposed weights,
 * so each loaded weight vector feeds one FMA per row of a 4-row block and
 * nothing is reduced across lanes. rank and width are multiples of 16 (the
 * loader pads rank with zeros). The weights and the arithmetic are fp32; x and
 * y are fp32 or (bf16 != 0) bf16, widened on load and y rounded once on store.
 */
#include <stdint.h>
#include <string.h>

#include "cpu_math.h"
#include "cpu_vec.h"

#define BLOCK_ROWS 4
#define MAX_RANK 1024

/* 16 elements from i of an fp32 or bf16 array, as fp32 lanes. */
static inline __attribute__((always_inline)) v16f ld16x(const void *p, int64_t i, int bf16)
{
    if (!bf16)
        return ld16((const float *)p + i);
    v16f v;
    for (int l = 0; l < 16; l++)
        v[l] = bf16_to_f32(((const uint16_t *)p)[i + l]);
    return v;
}

static inline __attribute__((always_inline)) void st16x(void *p, int64_t i, v16f v, int bf16)
{
    if (!bf16) {
        st16((float *)p + i, v);
        return;
    }
    for (int l = 0; l < 16; l++)
        ((uint16_t *)p)[i + l] = f32_to_bf16(v[l]);
}

/* t[j][0 .. rank) = x row j @ at, for NR rows (two rank vectors at a time). */
static inline __attribute__((always_inline)) void
shrink(const int NR, const int bf16, const void *x, int64_t xs, int64_t in, const float *at,
       int64_t rank, float t[BLOCK_ROWS][MAX_RANK])
{
    int64_t r = 0;
    for (; r + 32 <= rank; r += 32) {
        v16f acc[BLOCK_ROWS][2];
        for (int j = 0; j < NR; j++)
            acc[j][0] = acc[j][1] = splat(0.f);
        for (int64_t k = 0; k < in; k++) {
            const v16f a0 = ld16(at + k * rank + r), a1 = ld16(at + k * rank + r + 16);
            for (int j = 0; j < NR; j++) {
                const v16f xv = splat(ld(x, j * xs + k, bf16));
                acc[j][0] += xv * a0;
                acc[j][1] += xv * a1;
            }
        }
        for (int j = 0; j < NR; j++) {
            st16(&t[j][r], acc[j][0]);
            st16(&t[j][r + 16], acc[j][1]);
        }
    }
    if (r < rank) { /* one vector left */
        v16f acc[BLOCK_ROWS];
        for (int j = 0; j < NR; j++)
            acc[j] = splat(0.f);
        for (int64_t k = 0; k < in; k++) {
            const v16f a0 = ld16(at + k * rank + r);
            for (int j = 0; j < NR; j++)
                acc[j] += splat(ld(x, j * xs + k, bf16)) * a0;
        }
        for (int j = 0; j < NR; j++)
            st16(&t[j][r], acc[j]);
    }
}

/* y row j [0 .. width) += t[j] @ bt, for NR rows (two output vectors at a time). */
static inline __attribute__((always_inline)) void
expand(const int NR, const int bf16, void *y, int64_t ys, int64_t width, const float *bt,
       int64_t rank, float t[BLOCK_ROWS][MAX_RANK])
{
    int64_t o = 0;
    for (; o + 32 <= width; o += 32) {
        v16f acc[BLOCK_ROWS][2];
        for (int j = 0; j < NR; j++) {
            acc[j][0] = ld16x(y, j * ys + o, bf16);
            acc[j][1] = ld16x(y, j * ys + o + 16, bf16);
        }
        for (int64_t r = 0; r < rank; r++) {
            const v16f b0 = ld16(bt + r * width + o), b1 = ld16(bt + r * width + o + 16);
            for (int j = 0; j < NR; j++) {
                const v16f tv = splat(t[j][r]);
                acc[j][0] += tv * b0;
                acc[j][1] += tv * b1;
            }
        }
        for (int j = 0; j < NR; j++) {
            st16x(y, j * ys + o, acc[j][0], bf16);
            st16x(y, j * ys + o + 16, acc[j][1], bf16);
        }
    }
    if (o < width) {
        v16f acc[BLOCK_ROWS];
        for (int j = 0; j < NR; j++)
            acc[j] = ld16x(y, j * ys + o, bf16);
        for (int64_t r = 0; r < rank; r++) {
            const v16f b0 = ld16(bt + r * width + o);
            for (int j = 0; j < NR; j++)
                acc[j] += splat(t[j][r]) * b0;
        }
        for (int j = 0; j < NR; j++)
            st16x(y, j * ys + o, acc[j], bf16);
    }
}

static inline __attribute__((always_inline)) void
rows_block(const int NR, const int bf16, const void *x, int64_t xs, void *y, int64_t ys,
           int64_t in, const int64_t *pieces, int64_t npieces)
{
    float t[BLOCK_ROWS][MAX_RANK] __attribute__((aligned(64)));
    for (int64_t p = 0; p < npieces; p++) {
        const int64_t *e = pieces + p * 5;
        if (!e[0])
            continue;
        const float *at = (const float *)(intptr_t)e[0], *bt = (const float *)(intptr_t)e[1];
        shrink(NR, bf16, x, xs, in, at, e[2], t);
        expand(NR, bf16, (char *)y + e[3] * (bf16 ? 2 : 4), ys, e[4], bt, e[2], t);
    }
}

/* Row blocks of segment s (none when its slot is past the table: the adapter
 * has no piece in this projection). */
static inline int64_t seg_blocks(const int64_t *segs, int64_t s, int64_t nslots)
{
    if (segs[s * 3 + 2] >= nslots)
        return 0;
    return (segs[s * 3 + 1] - segs[s * 3] + BLOCK_ROWS - 1) / BLOCK_ROWS;
}

/* x [nrows, in] and y [nrows, out] (row strides xs, ys, in elements), fp32 or
 * (bf16 != 0) bf16; table has nslots slots. Returns 0, or -1 (nothing written)
 * when a segment or table entry is out of range. */
int lora_sgmv(const void *x, int64_t xs, void *y, int64_t ys, int64_t nrows, int64_t in,
              int64_t out, const int64_t *segs, int64_t nseg, const int64_t *table,
              int64_t nslots, int64_t npieces, int bf16, int nthreads)
{
    int64_t ntasks = 0;
    for (int64_t s = 0; s < nseg; s++) {
        const int64_t start = segs[s * 3], end = segs[s * 3 + 1], slot = segs[s * 3 + 2];
        if (start < 0 || end > nrows || start > end || slot < 0)
            return -1;
        if (slot >= nslots)
            continue;
        const int64_t *pieces = table + slot * npieces * 5;
        for (int64_t p = 0; p < npieces; p++) {
            const int64_t *e = pieces + p * 5;
            if (e[0] && (e[2] <= 0 || e[2] % 16 || e[2] > MAX_RANK || e[4] <= 0 || e[4] % 16
                         || e[3] < 0 || e[3] + e[4] > out))
                return -1;
        }
        ntasks += seg_blocks(segs, s, nslots);
    }
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
    for (int64_t task = 0; task < ntasks; task++) {
        /* Find this task's segment and block (segments are few; a scan is cheap). */
        int64_t s = 0, before = 0;
        for (;; s++) {
            const int64_t n = seg_blocks(segs, s, nslots);
            if (task < before + n)
                break;
            before += n;
        }
        const int64_t row = segs[s * 3] + (task - before) * BLOCK_ROWS;
        const int64_t left = segs[s * 3 + 1] - row;
        const int64_t *pieces = table + segs[s * 3 + 2] * npieces * 5;
        const int64_t es = bf16 ? 2 : 4;
        const void *xr = (const char *)x + row * xs * es;
        void *yr = (char *)y + row * ys * es;
        const int64_t nr = left >= BLOCK_ROWS ? BLOCK_ROWS : left;
        if (bf16) {
            switch (nr) {
            case 4: rows_block(4, 1, xr, xs, yr, ys, in, pieces, npieces); break;
            case 3: rows_block(3, 1, xr, xs, yr, ys, in, pieces, npieces); break;
            case 2: rows_block(2, 1, xr, xs, yr, ys, in, pieces, npieces); break;
            default: rows_block(1, 1, xr, xs, yr, ys, in, pieces, npieces); break;
            }
        } else {
            switch (nr) {
            case 4: rows_block(4, 0, xr, xs, yr, ys, in, pieces, npieces); break;
            case 3: rows_block(3, 0, xr, xs, yr, ys, in, pieces, npieces); break;
            case 2: rows_block(2, 0, xr, xs, yr, ys, in, pieces, npieces); break;
            default: rows_block(1, 0, xr, xs, yr, ys, in, pieces, npieces); break;
            }
        }
    }
    return 0;
}
