/*
 * Row-wise fused ops for the CPU forward, fp32 or bf16, built into the same
 * library as the paged decode kernel.
 *
 * Each op does in one pass over memory what the torch path does in several
 * (with a fresh temporary per step): RMSNorm with its residual add is seven
 * torch ops, SiLU-and-multiply two, rotary embedding of q or k seven (views,
 * four multiplies, an add, a subtract and a cat). At prefill batch sizes these
 * passes are memory-bound; at decode sizes the op dispatch costs more than
 * the arithmetic.
 *
 * Rows are split over OpenMP threads, and each row is summed in fp32, as
 * transformers' LlamaRMSNorm does. The bf16 entry points run the same code
 * with fp32 math, rounding where the torch path rounds: RMSNorm's residual
 * sum, its normalised row (before the weight, as transformers casts it) and
 * its output; RoPE only its output.
 */
#include <math.h>
#include <stdint.h>

#include "cpu_math.h"

/* One row: out = w * r / sqrt(mean(r^2) + eps), where r = x + res (or x). When
 * res is given, r is also written to res_out (the next residual). */
static inline __attribute__((always_inline)) void
rms_norm_row(const void *x, const void *res, void *res_out, const void *w, void *out,
             int64_t H, float eps, int bf16)
{
    const void *r = x;
    if (res != 0) {
        for (int64_t j = 0; j < H; j++)
            st(res_out, j, ld(x, j, bf16) + ld(res, j, bf16), bf16);
        r = res_out;
    }
    float ss = 0.f;
    for (int64_t j = 0; j < H; j++) {
        const float v = ld(r, j, bf16);
        ss += v * v;
    }
    const float inv = 1.f / sqrtf(ss / (float)H + eps);
    for (int64_t j = 0; j < H; j++)
        st(out, j, ld(w, j, bf16) * rnd(ld(r, j, bf16) * inv, bf16), bf16);
}

/* Rows m of x (x_stride elements apart) into contiguous out / res_out. The
 * element type is a constant in each branch: OpenMP outlines the loop body, so
 * a flag passed through would stay a runtime value and block vectorisation. */
static void rms_norm_rows(const void *x, int64_t x_stride, const void *res, void *res_out,
                          const void *w, void *out, int64_t M, int64_t H, float eps,
                          int nthreads, int bf16)
{
    const int64_t es = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * H >= 32768)
    for (int64_t m = 0; m < M; m++) {
        const char *xm = (const char *)x + m * x_stride * es;
        const char *rm = res ? (const char *)res + m * H * es : 0;
        char *rom = res ? (char *)res_out + m * H * es : 0;
        char *om = (char *)out + m * H * es;
        if (bf16)
            rms_norm_row(xm, rm, rom, w, om, H, eps, 1);
        else
            rms_norm_row(xm, rm, rom, w, om, H, eps, 0);
    }
}

void rms_norm_f32(const float *x, int64_t x_stride, const float *res, float *res_out,
                  const float *w, float *out, int64_t M, int64_t H, float eps, int nthreads)
{
    rms_norm_rows(x, x_stride, res, res_out, w, out, M, H, eps, nthreads, 0);
}

void rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *res, uint16_t *res_out,
                   const uint16_t *w, uint16_t *out, int64_t M, int64_t H, float eps,
                   int nthreads)
{
    rms_norm_rows(x, x_stride, res, res_out, w, out, M, H, eps, nthreads, 1);
}

/* out[m, i] = silu(gu[m, i]) * gu[m, I + i]: the gate and up halves of one
 * merged projection. */
void silu_and_mul_f32(const float *gu, int64_t gu_stride, float *out, int64_t M, int64_t I,
                      int nthreads)
{
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * I >= 32768)
    for (int64_t m = 0; m < M; m++) {
        const float *g = gu + m * gu_stride;
        const float *u = g + I;
        float *o = out + m * I;
        for (int64_t i = 0; i < I; i++)
            o[i] = silu_f32(g[i]) * u[i];
    }
}

/* Rotary embedding, "rotate half" layout, of one head: out = [x1*c - x2*s,
 * x2*c + x1*s] with x1, x2 the head's halves and c, s its token's cos and sin
 * (D/2 each). */
static inline __attribute__((always_inline)) void
rope_head(const char *x, const char *c, const char *s, char *__restrict out, int64_t half,
          int bf16)
{
    const int64_t es = bf16 ? 2 : 4;
    const char *x2 = x + half * es;
    char *__restrict o2 = out + half * es;
    for (int64_t i = 0; i < half; i++) {
        const float a = ld(x, i, bf16), b = ld(x2, i, bf16);
        const float ci = ld(c, i, bf16), si = ld(s, i, bf16);
        st(out, i, a * ci - b * si, bf16);
        st(o2, i, b * ci + a * si, bf16);
    }
}

/* Every head h of every token m of x (rows x_stride elements apart, heads D
 * apart) into contiguous out [M, H, D]; the type is a constant per branch, as
 * in rms_norm_rows. */
static void rope_rows(const void *x, int64_t x_stride, const void *cos_t, const void *sin_t,
                      void *out, int64_t M, int64_t H, int64_t D, int nthreads, int bf16)
{
    const int64_t half = D / 2, es = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * H * D >= 65536)
    for (int64_t m = 0; m < M; m++) {
        const char *c = (const char *)cos_t + m * half * es;
        const char *s = (const char *)sin_t + m * half * es;
        for (int64_t h = 0; h < H; h++) {
            const char *xh = (const char *)x + (m * x_stride + h * D) * es;
            char *oh = (char *)out + (m * H + h) * D * es;
            if (bf16)
                rope_head(xh, c, s, oh, half, 1);
            else
                rope_head(xh, c, s, oh, half, 0);
        }
    }
}

void rope_f32(const float *x, int64_t x_stride, const float *cos_t, const float *sin_t,
              float *out, int64_t M, int64_t H, int64_t D, int nthreads)
{
    rope_rows(x, x_stride, cos_t, sin_t, out, M, H, D, nthreads, 0);
}

void rope_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *cos_t,
               const uint16_t *sin_t, uint16_t *out, int64_t M, int64_t H, int64_t D,
               int nthreads)
{
    rope_rows(x, x_stride, cos_t, sin_t, out, M, H, D, nthreads, 1);
}
