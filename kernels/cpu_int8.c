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
 * does for its integer dot products: sx = max|x| / 127, q = round(x / sx).
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
 * Without AVX512-VNNI (or AVX512BW) the entry returns -1 and the caller uses
 * the torch path (cpu_int8.reference), which computes the same integers.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GROUP 32
#define ROWS 4

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

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#include <immintrin.h>

/* NR rows x NB2 blocks of 16 outputs, all groups. */
static inline __attribute__((always_inline)) void
tile(const int NR, const int NB2, const int8_t *q, const float *sx, const float *xsum,
     const int32_t *qsum, int64_t K, const uint8_t *codes, const float *scale,
     const float *offs, int32_t zero, int64_t nb, float *out, int64_t out_stride,
     int64_t N, int64_t m0)
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
        const uint8_t *w0 = codes + ((nb * G) + g) * 512;
        const uint8_t *w1 = codes + (((nb + 1) * G) + g) * 512;
        for (int j = 0; j < 8; j++) {
            const __m512i wa = _mm512_loadu_si512((const void *)(w0 + 64 * j));
            const __m512i wb = NB2 > 1 ? _mm512_loadu_si512((const void *)(w1 + 64 * j)) : wa;
            for (int r = 0; r < NR; r++) {
                int32_t four;
                memcpy(&four, q + (m0 + r) * K + g * GROUP + 4 * j, 4);
                const __m512i xb = _mm512_set1_epi32(four);
                dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], wa, xb);
                if (NB2 > 1)
                    dot[r][1] = _mm512_dpbusd_epi32(dot[r][1], wb, xb);
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

static void run(const int8_t *q, const float *sx, const float *xsum, const int32_t *qsum,
                int64_t M, int64_t K, const uint8_t *codes, const float *scale,
                const float *offs, int32_t zero, int64_t N, float *out, int64_t out_stride)
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
#define TILE(R, B) tile(R, B, q, sx, xsum, qsum, K, codes, scale, offs, zero, nb, out, \
                        out_stride, N, m0)
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
    }
}

int int8_linear_supported(void) { return 1; }
#else
static void run(const int8_t *q, const float *sx, const float *xsum, const int32_t *qsum,
                int64_t M, int64_t K, const uint8_t *codes, const float *scale,
                const float *offs, int32_t zero, int64_t N, float *out, int64_t out_stride)
{
    (void)q; (void)sx; (void)xsum; (void)qsum; (void)M; (void)K; (void)codes;
    (void)scale; (void)offs; (void)zero; (void)N; (void)out; (void)out_stride;
}

int int8_linear_supported(void) { return 0; }
#endif

/* x [M][K] fp32 (row stride x_stride), out [M][N] fp32 (row stride out_stride).
 * Returns 0, or -1 when this build cannot run it (no VNNI) or K is not a
 * multiple of 32, leaving out untouched. */
int int8_linear(const float *x, int64_t x_stride, int64_t M, int64_t K,
                const uint8_t *codes, const float *scale, const float *offs, int32_t zero,
                int64_t N, float *out, int64_t out_stride)
{
    if (!int8_linear_supported() || K % GROUP || M < 1 || N < 1)
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
    run(q, sx, xsum, qsum, M, K, codes, scale, offs, zero, N, out, out_stride);
    free(q);
    free(sx);
    free(qsum);
    return 0;
}
