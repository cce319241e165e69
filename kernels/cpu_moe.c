/* Routed SwiGLU experts of a mixture-of-experts layer in one call (fp32, or a
 * bf16 model's bf16 weights and activations widened on load).
 *
 * The step's (token, expert) pairs arrive sorted by expert: pairs
 * offsets[e] .. offsets[e + 1] run expert e, pair p on token row rows[p] with
 * routing weight scales[p]. For each pair
 *     h = silu(x @ W1_e^T) * (x @ W3_e^T)            [I]
 *     ypairs[p] = scales[p] * (h @ W2_e^T)           [H]
 * and then each token's K pairs are summed into out in ascending expert
 * order (Hugging Face's order): out[t] = sum_j ypairs[inv[t * K + j]], where
 * inv maps a token's j-th choice to its pair; pairs are sorted by expert, so
 * ascending pair order is ascending expert order. Pairs offsets[E] .. T * K
 * (expert parallelism: experts another rank holds) run nothing and add zero.
 *
 * Weights are packed once (cpu_moe.pack, in torch) so every product runs
 * along a contiguous stream: the gate/up matrix as column tiles of 32 (a
 * 16-column tail), each [H][2 * tile] with the tile's gate columns then its
 * up columns; the down matrix as output tiles of 64 (16-column tails), each
 * [I][tile]. Sums are fp32; a bf16 output is rounded once, at the end.
 * Each loaded weight vector feeds one FMA per row of a 4-row block and no
 * value is reduced across lanes. Tasks are (expert, 4-row block) pairs under
 * OpenMP, so a decode step's few rows per expert still spread over the cores.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"
#include "cpu_vec.h"

#define ROWS 4
#define GU_TILE 32
#define DOWN_TILE 64
#define MAX_K 64

/* 16 weights from p (fp32, or bf16 widened: exact). */
static inline __attribute__((always_inline)) v16f ldw(const void *p, int bf16)
{
    if (!bf16)
        return ld16((const float *)p);
    typedef uint16_t v16h __attribute__((vector_size(32)));
    typedef uint32_t v16u __attribute__((vector_size(64)));
    v16h h;
    memcpy(&h, p, sizeof h);
    const v16u u = __builtin_convertvector(h, v16u) << 16;
    v16f f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* h[j][c .. c + 16 * NV) = silu(gate) * up for NR rows, from one gate/up tile. */
static inline __attribute__((always_inline)) void
gate_up_tile(const int NR, const int NV, const int bf16, const void *const xr[ROWS],
             const void *tile, int64_t H, float *h, int64_t I, int64_t c)
{
    v16f g[ROWS][2], u[ROWS][2];
    for (int j = 0; j < NR; j++)
        for (int v = 0; v < NV; v++)
            g[j][v] = u[j][v] = splat(0.f);
    const int64_t step = 32 * NV;
    const int64_t es = bf16 ? 2 : 4;
    for (int64_t k = 0; k < H; k++) {
        const char *t = (const char *)tile + k * step * es;
        v16f wg[2], wu[2];
        for (int v = 0; v < NV; v++) {
            wg[v] = ldw(t + 16 * v * es, bf16);
            wu[v] = ldw(t + (16 * NV + 16 * v) * es, bf16);
        }
        for (int j = 0; j < NR; j++) {
            const v16f xv = splat(ld(xr[j], k, bf16));
            for (int v = 0; v < NV; v++) {
                g[j][v] += xv * wg[v];
                u[j][v] += xv * wu[v];
            }
        }
    }
    for (int j = 0; j < NR; j++)
        for (int v = 0; v < NV; v++) {
            float *o = h + j * I + c + 16 * v;
            for (int l = 0; l < 16; l++)
                o[l] = silu_f32(g[j][v][l]) * u[j][v][l];
        }
}

/* y[j][o .. o + 16 * NV) = scale[j] * h[j] @ (down tile), for NR rows. */
static inline __attribute__((always_inline)) void
down_tile(const int NR, const int NV, const int bf16, const float *h, int64_t I,
          const void *tile, const float *scale, float *const yr[ROWS], int64_t o)
{
    v16f acc[ROWS][4];
    for (int j = 0; j < NR; j++)
        for (int v = 0; v < NV; v++)
            acc[j][v] = splat(0.f);
    const int64_t es = bf16 ? 2 : 4;
    for (int64_t r = 0; r < I; r++) {
        const char *t = (const char *)tile + r * 16 * NV * es;
        v16f w[4];
        for (int v = 0; v < NV; v++)
            w[v] = ldw(t + 16 * v * es, bf16);
        for (int j = 0; j < NR; j++) {
            const v16f hv = splat(h[j * I + r]);
            for (int v = 0; v < NV; v++)
                acc[j][v] += hv * w[v];
        }
    }
    for (int j = 0; j < NR; j++)
        for (int v = 0; v < NV; v++)
            st16(yr[j] + o + 16 * v, acc[j][v] * splat(scale[j]));
}

static inline __attribute__((always_inline)) void
expert_block(const int NR, const int bf16, const void *const xr[ROWS], const void *p13,
             const void *p2, int64_t H, int64_t I, const float *scale, float *const yr[ROWS],
             float *h)
{
    const int64_t es = bf16 ? 2 : 4;
    for (int64_t c = 0; c < I; c += GU_TILE) {
        const void *tile = (const char *)p13 + c * 2 * H * es;
        if (I - c >= GU_TILE)
            gate_up_tile(NR, 2, bf16, xr, tile, H, h, I, c);
        else
            gate_up_tile(NR, 1, bf16, xr, tile, H, h, I, c);
    }
    for (int64_t o = 0; o < H;) {
        const void *tile = (const char *)p2 + o * I * es;
        if (H - o >= DOWN_TILE) {
            down_tile(NR, 4, bf16, h, I, tile, scale, yr, o);
            o += DOWN_TILE;
        } else {
            down_tile(NR, 1, bf16, h, I, tile, scale, yr, o);
            o += 16;
        }
    }
}

static void expert_rows(int nr, int bf16, const void *const xr[ROWS], const void *p13,
                        const void *p2, int64_t H, int64_t I, const float *scale,
                        float *const yr[ROWS], float *h)
{
#define BLOCK(n, b) expert_block(n, b, xr, p13, p2, H, I, scale, yr, h)
    if (bf16) {
        switch (nr) {
        case 4: BLOCK(4, 1); break;
        case 3: BLOCK(3, 1); break;
        case 2: BLOCK(2, 1); break;
        default: BLOCK(1, 1); break;
        }
    } else {
        switch (nr) {
        case 4: BLOCK(4, 0); break;
        case 3: BLOCK(3, 0); break;
        case 2: BLOCK(2, 0); break;
        default: BLOCK(1, 0); break;
        }
    }
#undef BLOCK
}

/* Returns 0, or -1 (out untouched) when a shape, offset or row is out of range.
 * x [T, H] (row stride xs) and out [T, H] (row stride os) in the weights' type
 * (bf16 != 0: bf16), ypairs [T * K, H] fp32 scratch. */
int moe_experts(const void *x, int64_t xs, void *out, int64_t os, int64_t T, int64_t H,
                int64_t I, int64_t E, int64_t K, const void *p13, const void *p2,
                const int64_t *offsets, const int64_t *rows, const float *scales,
                const int64_t *inv, float *ypairs, int bf16, int nthreads)
{
    if (H <= 0 || H % 16 || I <= 0 || I % 16 || K <= 0 || E <= 0 || K > MAX_K
        || offsets[0] != 0 || offsets[E] > T * K)
        return -1;
    int64_t ntasks = 0;
    for (int64_t e = 0; e < E; e++) {
        if (offsets[e + 1] < offsets[e])
            return -1;
        ntasks += (offsets[e + 1] - offsets[e] + ROWS - 1) / ROWS;
    }
    for (int64_t p = 0; p < T * K; p++)
        if (rows[p] < 0 || rows[p] >= T || inv[p] < 0 || inv[p] >= T * K)
            return -1;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *h = aligned_alloc(64, (size_t)(ROWS * I * sizeof(float) + 63) / 64 * 64);
        if (!h) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < ntasks; task++) {
            if (!h)
                continue;
            int64_t e = 0, before = 0;
            for (;; e++) {
                const int64_t n = (offsets[e + 1] - offsets[e] + ROWS - 1) / ROWS;
                if (task < before + n)
                    break;
                before += n;
            }
            const int64_t p0 = offsets[e] + (task - before) * ROWS;
            const int64_t left = offsets[e + 1] - p0;
            const int nr = left >= ROWS ? ROWS : (int)left;
            const int64_t es = bf16 ? 2 : 4;
            const void *xr[ROWS];
            float *yr[ROWS];
            for (int j = 0; j < nr; j++) {
                xr[j] = (const char *)x + rows[p0 + j] * xs * es;
                yr[j] = ypairs + (p0 + j) * H;
            }
            expert_rows(nr, bf16, xr, (const char *)p13 + e * 2 * I * H * es,
                        (const char *)p2 + e * H * I * es, H, I, scales + p0, yr, h);
        }
        free(h);
    }
    if (failed)
        return -1;
    /* Pairs past offsets[E] chose another rank's expert (expert parallelism): they sort
     * last in their token's sum and add zero. */
    memset(ypairs + offsets[E] * H, 0, sizeof(float) * (size_t)((T * K - offsets[E]) * H));
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        /* This token's pairs in ascending order (K is small: insertion sort). */
        int64_t pos[MAX_K];
        pos[0] = inv[t * K];
        for (int64_t j = 1; j < K; j++) {
            int64_t i = j;
            const int64_t pj = inv[t * K + j];
            while (i > 0 && pos[i - 1] > pj) {
                pos[i] = pos[i - 1];
                i--;
            }
            pos[i] = pj;
        }
        /* The first pair's row is the sum's start (HF adds it to zeros: the same). */
        float *acc = ypairs + pos[0] * H;
        for (int64_t j = 1; j < K; j++) {
            const float *y = ypairs + pos[j] * H;
            for (int64_t i = 0; i < H; i++)
                acc[i] += y[i];
        }
        for (int64_t i = 0; i < H; i++)
            st(out, t * os + i, acc[i], bf16);
    }
    return 0;
}
