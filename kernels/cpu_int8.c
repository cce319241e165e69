/* Int8 linear layer: out[M][N] = x[M][K] @ W^T with W kept as 8-bit codes.
 *
 * Weights: each output row n is cut into groups of 32 inputs; group g holds
 * unsigned codes u (0..255), a scale d[n][g], an integer zero point z shared
 * by the tensor and an optional float offset b[n][g]:
 *     W[n][g*32 + i] = d[n][g] * (u[n][g*32 + i] - z) + b[n][g]
 * which is exactly GGUF's Q8_0 (z = 128), Q4_0 (z = 8) and Q4_1 (z = 0, b =
 * its min) blocks, and the online symmetric int8 quantisation (z = 128).
 *
 * Activations are quantised per row and group of 32 on the fly, as llama.cpp
 * does for its integer dot products: sx = max|x| / 127, q = round(x * 127 /
 * max|x|) (half to even, as torch.round).
 * Each group's dot product is then exact integer arithmetic,
 *     sum_i (u_i - z) q_i = sum_i u_i q_i - z sum_i q_i,
 * run 64 multiply-adds per instruction by AVX512-VNNI (vpdpbusd: unsigned
 * bytes times signed bytes), and scaled into an fp32 sum once per group:
 *     out += (d * sx) * dot + b * (sx * sum_i q_i).
 *
 * Packed layout (cpu_int8.pack): output rows in blocks of 16 lanes, padded;
 * for block nb and group g, 8 vectors of 64 bytes, vector j holding lane l's
 * codes for inputs g*32 + 4j .. +4 at bytes 4l .. 4l+4 (vpdpbusd's shape);
 * scales and offsets as [NB][G][16] floats. Tasks are (pair of blocks,
 * 4-row block) under OpenMP, rows innermost so a thread's consecutive tasks
 * reuse the same weights from cache.
 *
 * Without AVX512-VNNI (or AVX512BW) the tile runs on AVX2 instead (same
 * integers, a quarter of the multiply-adds an instruction); without AVX2 and
 * FMA either, both entries return -1 and the caller uses the torch path
 * (cpu_int8.reference, the expert loop), which computes the same integers.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"

#define GROUP 32
#define ROWS 4

/* The grid step of each group of 32 weights that already sit on an evenly spaced grid
 * of at most 16 levels (a 4-bit checkpoint's, dequantised), else 0: the torch path's
 * test (cpu_int8._grid_step, _on_grid) with the group sorted in registers and cache,
 * for cpu_int8.quantize_asymmetric4 (torch's segmented sort took 0.34 s a 4096 x 4096
 * matrix on the 2-core box). */
void grid_steps4(const float *g, int64_t groups, float *step)
{
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < groups; i++) {
        float v[GROUP];
        memcpy(v, g + i * GROUP, sizeof v);
        for (int a = 1; a < GROUP; a++) { /* insertion sort */
            const float x = v[a];
            int b = a - 1;
            while (b >= 0 && v[b] > x) {
                v[b + 1] = v[b];
                b--;
            }
            v[b + 1] = x;
        }
        const float lo = v[0], span = v[GROUP - 1] - v[0];
        float gap = INFINITY, out = 0.0f;
        for (int a = 1; a < GROUP; a++) {
            const float d = v[a] - v[a - 1];
            if (d > 0.0f && d < gap)
                gap = d;
        }
        if (gap < INFINITY) {
            float levels = nearbyintf(span / gap);
            const float s = span / (levels < 1.0f ? 1.0f : levels);
            if (s > 0.0f && span / s < 15.5f) {
                float off = 0.0f;
                for (int a = 0; a < GROUP; a++) {
                    const float p = (v[a] - lo) / s;
                    const float e = fabsf(p - nearbyintf(p));
                    off = e > off ? e : off;
                }
                if (off < 0.05f)
                    out = s;
            }
        }
        step[i] = out;
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#include <immintrin.h>

/* NR rows x NB2 blocks of 16 outputs, all groups; FOUR: 4-bit codes, two to a byte
 * (byte i of a group's packed vector v holds vector v's code i in its low nibble
 * and vector v + 4's in its high nibble). */
static inline __attribute__((always_inline)) void
tile(const int NR, const int NB2, const int FOUR, const int8_t *q, const float *sx,
     const float *xsum, const int32_t *qsum, int64_t K, const uint8_t *codes,
     const float *scale, const float *offs, int32_t zero, int64_t nb, float *out,
     int64_t out_stride, int64_t N, int64_t m0)
{
    const int64_t G = K / GROUP;
    __m512 acc[ROWS][2];
    for (int r = 0; r < NR; r++)
        for (int b = 0; b < NB2; b++)
            acc[r][b] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m512i dot[ROWS][2];
        for (int r = 0; r < NR; r++) {
            const __m512i init = _mm512_set1_epi32(-zero * qsum[(m0 + r) * G + g]);
            for (int b = 0; b < NB2; b++)
                dot[r][b] = init;
        }
        const int64_t per_group = FOUR ? 256 : 512;
        const uint8_t *w0 = codes + ((nb * G) + g) * per_group;
        const uint8_t *w1 = codes + (((nb + 1) * G) + g) * per_group;
        const __m512i low = _mm512_set1_epi8(0x0F);
        for (int v = 0; v < (FOUR ? 4 : 8); v++) {
            __m512i wa[2], wb[2];
            wa[0] = _mm512_loadu_si512((const void *)(w0 + 64 * v));
            wb[0] = NB2 > 1 ? _mm512_loadu_si512((const void *)(w1 + 64 * v)) : wa[0];
            if (FOUR) {
                wa[1] = _mm512_and_si512(_mm512_srli_epi16(wa[0], 4), low);
                wa[0] = _mm512_and_si512(wa[0], low);
                wb[1] = _mm512_and_si512(_mm512_srli_epi16(wb[0], 4), low);
                wb[0] = _mm512_and_si512(wb[0], low);
            }
            for (int h = 0; h < (FOUR ? 2 : 1); h++) {
                const int j = v + 4 * h;
                for (int r = 0; r < NR; r++) {
                    int32_t four;
                    memcpy(&four, q + (m0 + r) * K + g * GROUP + 4 * j, 4);
                    const __m512i xb = _mm512_set1_epi32(four);
                    dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], wa[h], xb);
                    if (NB2 > 1)
                        dot[r][1] = _mm512_dpbusd_epi32(dot[r][1], wb[h], xb);
                }
            }
        }
        for (int b = 0; b < NB2; b++) {
            const __m512 d = _mm512_loadu_ps(scale + ((nb + b) * G + g) * 16);
            const __m512 o = offs ? _mm512_loadu_ps(offs + ((nb + b) * G + g) * 16)
                                  : _mm512_setzero_ps();
            for (int r = 0; r < NR; r++) {
                const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(sx[(m0 + r) * G + g]));
                acc[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][b]), ds, acc[r][b]);
                if (offs)
                    acc[r][b] = _mm512_fmadd_ps(o, _mm512_set1_ps(xsum[(m0 + r) * G + g]),
                                                acc[r][b]);
            }
        }
    }
    for (int b = 0; b < NB2; b++) {
        const int64_t n0 = (nb + b) * 16;
        const int64_t left = N - n0;
        const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        for (int r = 0; r < NR; r++)
            _mm512_mask_storeu_ps(out + (m0 + r) * out_stride + n0, mask, acc[r][b]);
    }
}

#define INT8_NATIVE 1
#elif defined(__AVX2__) && defined(__FMA__)
#include "cpu_int8_avx2.h"
#define INT8_NATIVE 2
#endif

#ifdef INT8_NATIVE
/* Quantise rows of x: q[m][k] int8, sx[m][g] and xs[m][g] = sx * sum(q). */
static void quantize_rows(const float *x, int64_t xs_stride, int64_t M, int64_t K,
                          int8_t *q, float *sx, float *xsum, int32_t *qsum)
{
    const int64_t G = K / GROUP;
#pragma omp parallel for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * xs_stride;
        for (int64_t g = 0; g < G; g++) {
            const float *v = xr + g * GROUP;
            float amax = 0.f;
            for (int i = 0; i < GROUP; i++)
                amax = fmaxf(amax, fabsf(v[i]));
            const float inv = amax > 0.f ? 127.f / amax : 0.f;
            int32_t s = 0;
            int8_t *qo = q + m * K + g * GROUP;
            for (int i = 0; i < GROUP; i++) {
                const int32_t r = (int32_t)nearbyintf(v[i] * inv);
                qo[i] = (int8_t)r;
                s += r;
            }
            const float scale = amax / 127.f;
            sx[m * G + g] = scale;
            qsum[m * G + g] = s;
            xsum[m * G + g] = scale * (float)s;
        }
    }
}

static void run(const int8_t *q, const float *sx, const float *xsum, const int32_t *qsum,
                int64_t M, int64_t K, const uint8_t *codes, const float *scale,
                const float *offs, int32_t zero, int64_t N, float *out, int64_t out_stride,
                int four)
{
    const int64_t NB = (N + 15) / 16;
    const int64_t pairs = (NB + 1) / 2;
    const int64_t rblocks = (M + ROWS - 1) / ROWS;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < pairs * rblocks; t++) {
        const int64_t p = t / rblocks, rb = t % rblocks;
        const int64_t nb = 2 * p, m0 = rb * ROWS;
        const int nr = (int)(M - m0 < ROWS ? M - m0 : ROWS);
        const int two = nb + 1 < NB;
#define TILE4(R, B, F) tile(R, B, F, q, sx, xsum, qsum, K, codes, scale, offs, zero, nb, \
                            out, out_stride, N, m0)
#define TILE(R, B) do { if (four) TILE4(R, B, 1); else TILE4(R, B, 0); } while (0)
        if (two) {
            switch (nr) {
            case 4: TILE(4, 2); break;
            case 3: TILE(3, 2); break;
            case 2: TILE(2, 2); break;
            default: TILE(1, 2); break;
            }
        } else {
            switch (nr) {
            case 4: TILE(4, 1); break;
            case 3: TILE(3, 1); break;
            case 2: TILE(2, 1); break;
            default: TILE(1, 1); break;
            }
        }
#undef TILE
#undef TILE4
    }
}

/* A routed layer's int8 experts (moe_int8): NT tasks of (expert's first pair
 * m0, rows, block pair) over one product, all experts in one parallel loop. */
typedef struct {
    int64_t e, m0, pair;
    int nr;
} task_t;

static void run_experts(const task_t *tasks, int64_t nt, const int8_t *q, const float *sx,
                        const float *xsum, const int32_t *qsum, int64_t K,
                        const uint8_t *codes, int64_t codes_per_expert, const float *scale,
                        int64_t scales_per_expert, int64_t N, float *out)
{
#pragma omp parallel for schedule(dynamic, 4)
    for (int64_t t = 0; t < nt; t++) {
        const task_t k = tasks[t];
        const uint8_t *c = codes + k.e * codes_per_expert;
        const float *sc = scale + k.e * scales_per_expert;
#define TILE(R) tile(R, 2, 0, q, sx, xsum, qsum, K, c, sc, NULL, 128, 2 * k.pair, out, N, N, \
                         k.m0)
        switch (k.nr) {
        case 4: TILE(4); break;
        case 3: TILE(3); break;
        case 2: TILE(2); break;
        default: TILE(1); break;
        }
#undef TILE
    }
}

static int64_t plan_tasks(task_t *tasks, const int64_t *offsets, int64_t E, int64_t pairs)
{
    int64_t n = 0;
    for (int64_t e = 0; e < E; e++)
        for (int64_t m0 = offsets[e]; m0 < offsets[e + 1]; m0 += ROWS)
            for (int64_t p = 0; p < pairs; p++) {
                const int64_t left = offsets[e + 1] - m0;
                tasks[n++] = (task_t){e, m0, p, (int)(left < ROWS ? left : ROWS)};
            }
    return n;
}

/* 1: the AVX512-VNNI kernel, 2: the AVX2 one. */
int int8_linear_supported(void) { return INT8_NATIVE; }

/* x [M][K] fp32 (row stride x_stride), out [M][N] fp32 (row stride out_stride);
 * codes of `bits` 8 or 4 (two to a byte). Returns 0, or -1 when this build
 * cannot run it (no VNNI), K is not a multiple of 32 or bits is neither,
 * leaving out untouched. */
int int8_linear(const float *x, int64_t x_stride, int64_t M, int64_t K,
                const uint8_t *codes, const float *scale, const float *offs, int32_t zero,
                int64_t N, float *out, int64_t out_stride, int bits)
{
    if (K % GROUP || M < 1 || N < 1 || (bits != 8 && bits != 4))
        return -1;
    const int64_t G = K / GROUP;
    int8_t *q = malloc((size_t)(M * K));
    float *sx = malloc(sizeof(float) * (size_t)(M * G) * 2);
    int32_t *qsum = malloc(sizeof(int32_t) * (size_t)(M * G));
    if (!q || !sx || !qsum) {
        free(q);
        free(sx);
        free(qsum);
        return -1;
    }
    float *xsum = sx + M * G;
    quantize_rows(x, x_stride, M, K, q, sx, xsum, qsum);
    run(q, sx, xsum, qsum, M, K, codes, scale, offs, zero, N, out, out_stride, bits == 4);
    free(q);
    free(sx);
    free(qsum);
    return 0;
}

/* Routed SwiGLU experts of a mixture-of-experts layer with int8 weights: the
 * arithmetic of running int8_linear per expert (kernels.cpu_int8, the torch
 * expert loop), in one call. Pairs offsets[e] .. offsets[e + 1] run expert e
 * on token row rows[p] with routing weight scales[p]; inv maps a token's
 * j-th choice to its pair. Expert e's gate/up weights ([gate; up], 2I x H)
 * and down weights (H x I) are packed as int8_linear's, zero point 128, and
 * stacked: c13 + e * (2I/16 * H/32 * 512) codes, s13 + e * (2I/16 * H/32 *
 * 16) scales, and likewise c2 / s2. Each token's rows are quantised once;
 * each pair's SiLU-and-multiply output is quantised per row like any
 * activation. out[t] sums scales[p] * down(h_p) over the token's pairs in
 * ascending pair (= expert) order, the loop's order; pairs offsets[E] .. P
 * (expert parallelism: another rank's experts) are skipped. Returns -1 (out
 * untouched) without VNNI, when H or I is not a multiple of 32, top-k is over
 * 64 or the routing is out of range. */
int moe_int8(const float *x, int64_t x_stride, float *out, int64_t out_stride, int64_t T,
             int64_t H, int64_t I, int64_t E, int64_t topk, const uint8_t *c13,
             const float *s13, const uint8_t *c2, const float *s2, const int64_t *offsets,
             const int64_t *rows, const float *scales, const int64_t *inv)
{
    if (H % GROUP || I % GROUP || T < 1 || topk < 1 || topk > 64)
        return -1;
    const int64_t P = T * topk, G1 = H / GROUP, G2 = I / GROUP;
    const int64_t pairs1 = I / 16, pairs2 = H / 32; /* block pairs of 2I and H outputs */
    const int64_t L1 = (2 * I / 16) * G1 * 512, S1 = (2 * I / 16) * G1 * 16;
    const int64_t L2 = (H / 16) * G2 * 512, S2 = (H / 16) * G2 * 16;
    const int64_t max_tasks = (P / ROWS + E) * (pairs1 > pairs2 ? pairs1 : pairs2);
    int8_t *qt = malloc((size_t)(T * H)), *q1 = malloc((size_t)(P * H));
    int8_t *q2 = malloc((size_t)(P * I));
    float *ft = malloc(sizeof(float) * (size_t)(2 * T * G1));
    float *f1 = malloc(sizeof(float) * (size_t)(2 * P * G1));
    float *f2 = malloc(sizeof(float) * (size_t)(2 * P * G2));
    int32_t *it = malloc(sizeof(int32_t) * (size_t)(T * G1));
    int32_t *i1 = malloc(sizeof(int32_t) * (size_t)(P * G1));
    int32_t *i2 = malloc(sizeof(int32_t) * (size_t)(P * G2));
    float *gu = malloc(sizeof(float) * (size_t)(P * 2 * I));
    float *h = malloc(sizeof(float) * (size_t)(P * I));
    float *y = malloc(sizeof(float) * (size_t)(P * H));
    task_t *tasks = malloc(sizeof(task_t) * (size_t)max_tasks);
    int rc = -1;
    if (!qt || !q1 || !q2 || !ft || !f1 || !f2 || !it || !i1 || !i2 || !gu || !h || !y || !tasks)
        goto done;
    for (int64_t p = 0; p < P; p++)
        if (rows[p] < 0 || rows[p] >= T || inv[p] < 0 || inv[p] >= P)
            goto done;
    for (int64_t e = 0; e < E; e++)
        if (offsets[e] > offsets[e + 1])
            goto done;
    if (offsets[0] != 0 || offsets[E] > P)
        goto done;
    const int64_t PL = offsets[E]; /* the pairs this rank runs */
    quantize_rows(x, x_stride, T, H, qt, ft, ft + T * G1, it);
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < P; p++) {
        const int64_t r = rows[p];
        memcpy(q1 + p * H, qt + r * H, (size_t)H);
        memcpy(f1 + p * G1, ft + r * G1, sizeof(float) * (size_t)G1);
        memcpy(f1 + P * G1 + p * G1, ft + T * G1 + r * G1, sizeof(float) * (size_t)G1);
        memcpy(i1 + p * G1, it + r * G1, sizeof(int32_t) * (size_t)G1);
    }
    int64_t nt = plan_tasks(tasks, offsets, E, pairs1);
    run_experts(tasks, nt, q1, f1, f1 + P * G1, i1, H, c13, L1, s13, S1, 2 * I, gu);
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < PL; p++)
        for (int64_t i = 0; i < I; i++)
            h[p * I + i] = silu_f32(gu[p * 2 * I + i]) * gu[p * 2 * I + I + i];
    quantize_rows(h, I, PL, I, q2, f2, f2 + P * G2, i2);
    nt = plan_tasks(tasks, offsets, E, pairs2);
    run_experts(tasks, nt, q2, f2, f2 + P * G2, i2, I, c2, L2, s2, S2, H, y);
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; t++) {
        int64_t ps[64];
        const int64_t k = topk;
        for (int64_t j = 0; j < k; j++) { /* the token's pairs, ascending */
            int64_t v = inv[t * topk + j], a = j;
            while (a > 0 && ps[a - 1] > v) {
                ps[a] = ps[a - 1];
                a--;
            }
            ps[a] = v;
        }
        float *o = out + t * out_stride;
        for (int64_t c = 0; c < H; c++)
            o[c] = 0.f;
        for (int64_t j = 0; j < k && ps[j] < PL; j++) {
            const float w = scales[ps[j]];
            const float *yr = y + ps[j] * H;
            for (int64_t c = 0; c < H; c++)
                o[c] += w * yr[c];
        }
    }
    rc = 0;
done:
    free(qt); free(q1); free(q2); free(ft); free(f1); free(f2); free(it); free(i1); free(i2);
    free(gu); free(h); free(y); free(tasks);
    return rc;
}
#else
int int8_linear_supported(void) { return 0; }

int int8_linear(const float *x, int64_t x_stride, int64_t M, int64_t K,
                const uint8_t *codes, const float *scale, const float *offs, int32_t zero,
                int64_t N, float *out, int64_t out_stride, int bits)
{
    (void)x; (void)x_stride; (void)M; (void)K; (void)codes; (void)scale; (void)offs;
    (void)zero; (void)N; (void)out; (void)out_stride; (void)bits;
    return -1;
}

int moe_int8(const float *x, int64_t x_stride, float *out, int64_t out_stride, int64_t T,
             int64_t H, int64_t I, int64_t E, int64_t topk, const uint8_t *c13,
             const float *s13, const uint8_t *c2, const float *s2, const int64_t *offsets,
             const int64_t *rows, const float *scales, const int64_t *inv)
{
    (void)x; (void)x_stride; (void)out; (void)out_stride; (void)T; (void)H; (void)I;
    (void)E; (void)topk; (void)c13; (void)s13; (void)c2; (void)s2; (void)offsets;
    (void)rows; (void)scales; (void)inv;
    return -1;
}
#endif
