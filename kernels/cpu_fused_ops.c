/*
 * Row-wise fused ops for the CPU forward, fp32, built into the same library
 * as the paged decode kernel.
 *
 * Each op does in one pass over memory what the torch path does in several
 * (with a fresh temporary per step): RMSNorm with its residual add is seven
 * torch ops, SiLU-and-multiply two, rotary embedding of q or k seven (views,
 * four multiplies, an add, a subtract and a cat). At prefill batch sizes these passes
 * are memory-bound; at decode sizes the op dispatch costs more than the
 * arithmetic.
 *
 * Rows are split over OpenMP threads, and each row is summed in fp32, as
 * transformers' LlamaRMSNorm does.
 *
 * The bf16 variants compute in fp32 and round where the torch path rounds:
 * RMSNorm's residual sum, its normalised row (before the weight, as
 * transformers casts it) and its output; RoPE only its output.
 */
#include <math.h>
#include <stdint.h>

#include "cpu_math.h"

/* out[m] = w * r / sqrt(mean(r^2) + eps), where r = x[m] + res[m] (or x[m]).
 * When res is given, r is also written to res_out[m] (the next residual). */
void rms_norm_f32(const float *x, int64_t x_stride, const float *res, float *res_out,
                  const float *w, float *out, int64_t M, int64_t H, float eps, int nthreads)
{
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * H >= 32768)
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * x_stride;
        const float *r = xr;
        if (res != 0) {
            const float *rr = res + m * H;
            float *ro = res_out + m * H;
            for (int64_t j = 0; j < H; j++)
                ro[j] = xr[j] + rr[j];
            r = ro;
        }
        float ss = 0.f;
        for (int64_t j = 0; j < H; j++)
            ss += r[j] * r[j];
        const float inv = 1.f / sqrtf(ss / (float)H + eps);
        float *o = out + m * H;
        for (int64_t j = 0; j < H; j++)
            o[j] = w[j] * (r[j] * inv);
    }
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

/* Rotary embedding, "rotate half" layout: for token m and head h of x (rows of
 * x_stride floats, heads D apart), out = [x1*c - x2*s, x2*c + x1*s] with
 * x1, x2 the head's halves and c, s = cos[m], sin[m] (D/2 each). out is
 * contiguous [M, H, D]. */
void rope_f32(const float *x, int64_t x_stride, const float *cos_t, const float *sin_t,
              float *out, int64_t M, int64_t H, int64_t D, int nthreads)
{
    const int64_t half = D / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * H * D >= 65536)
    for (int64_t m = 0; m < M; m++) {
        const float *c = cos_t + m * half;
        const float *s = sin_t + m * half;
        for (int64_t h = 0; h < H; h++) {
            const float *x1 = x + m * x_stride + h * D;
            const float *x2 = x1 + half;
            float *o1 = out + (m * H + h) * D;
            float *o2 = o1 + half;
            for (int64_t i = 0; i < half; i++) {
                o1[i] = x1[i] * c[i] - x2[i] * s[i];
                o2[i] = x2[i] * c[i] + x1[i] * s[i];
            }
        }
    }
}

/* rms_norm_f32 over bf16 rows (x, res, w, out, res_out all bf16). */
void rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *res, uint16_t *res_out,
                   const uint16_t *w, uint16_t *out, int64_t M, int64_t H, float eps,
                   int nthreads)
{
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * H >= 32768)
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *r = x + m * x_stride;
        if (res != 0) {
            const uint16_t *rr = res + m * H;
            uint16_t *ro = res_out + m * H;
            for (int64_t j = 0; j < H; j++)
                ro[j] = f32_to_bf16(bf16_to_f32(r[j]) + bf16_to_f32(rr[j]));
            r = ro;
        }
        float ss = 0.f;
        for (int64_t j = 0; j < H; j++) {
            const float v = bf16_to_f32(r[j]);
            ss += v * v;
        }
        const float inv = 1.f / sqrtf(ss / (float)H + eps);
        uint16_t *o = out + m * H;
        for (int64_t j = 0; j < H; j++) {
            const float normed = bf16_to_f32(f32_to_bf16(bf16_to_f32(r[j]) * inv));
            o[j] = f32_to_bf16(bf16_to_f32(w[j]) * normed);
        }
    }
}

/* rope_f32 over bf16 x and out, with bf16 cos/sin. */
void rope_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *cos_t,
               const uint16_t *sin_t, uint16_t *out, int64_t M, int64_t H, int64_t D,
               int nthreads)
{
    const int64_t half = D / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * H * D >= 65536)
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *c = cos_t + m * half;
        const uint16_t *s = sin_t + m * half;
        for (int64_t h = 0; h < H; h++) {
            const uint16_t *x1 = x + m * x_stride + h * D;
            const uint16_t *x2 = x1 + half;
            uint16_t *o1 = out + (m * H + h) * D;
            uint16_t *o2 = o1 + half;
            for (int64_t i = 0; i < half; i++) {
                const float a = bf16_to_f32(x1[i]), b = bf16_to_f32(x2[i]);
                const float ci = bf16_to_f32(c[i]), si = bf16_to_f32(s[i]);
                o1[i] = f32_to_bf16(a * ci - b * si);
                o2[i] = f32_to_bf16(b * ci + a * si);
            }
        }
    }
}
