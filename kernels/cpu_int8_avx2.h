/* The int8 tile for CPUs with AVX2 and FMA but not AVX512-VNNI; included by
 * cpu_int8.c (whose comment describes the layout and the arithmetic) in place
 * of its VNNI tile, with the same signature and results. */
#ifndef PAGEDSERVE_CPU_INT8_AVX2_H
#define PAGEDSERVE_CPU_INT8_AVX2_H

#include <immintrin.h>

/* The same tile with AVX2's 256-bit integer ops, for CPUs without VNNI (Zen 2/3,
 * Haswell to Comet Lake): still exact. A 64-byte vector of the packed layout is
 * two halves of 8 lanes. vpmaddubsw multiplies unsigned by signed bytes into
 * pairs summed in 16 bits, with saturation, so each product pair must stay
 * within +-32767: 4-bit codes (<= 15 * 127 * 2) go in as they are; 8-bit codes
 * go in as u - 128 (xor 0x80), split into |u - 128| and the sign moved onto q
 * (<= 128 * 127 * 2), llama.cpp's trick, and (128 - z) * sum(q) makes up the
 * zero point. vpmaddwd by ones then sums the pairs into 32 bits. Per (block,
 * half) the NR rows' sums stay in registers across the group's vectors, and
 * the float accumulators are touched once per group. */
static inline __attribute__((always_inline)) void
tile(const int NR, const int NB2, const int FOUR, const int8_t *q, const float *sx,
     const float *xsum, const int32_t *qsum, int64_t K, const uint8_t *codes,
     const float *scale, const float *offs, int32_t zero, int64_t nb, float *out,
     int64_t out_stride, int64_t N, int64_t m0)
{
    const int64_t G = K / GROUP;
    const int64_t per_group = FOUR ? 256 : 512;
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    const int32_t zfix = FOUR ? -zero : 128 - zero;
    __m256 acc[ROWS][2][2];
    for (int r = 0; r < NR; r++)
        for (int b = 0; b < NB2; b++)
            for (int hf = 0; hf < 2; hf++)
                acc[r][b][hf] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        for (int b = 0; b < NB2; b++) {
            const uint8_t *w = codes + (((nb + b) * G) + g) * per_group;
            for (int hf = 0; hf < 2; hf++) {
                __m256i dot[ROWS];
                for (int r = 0; r < NR; r++)
                    dot[r] = _mm256_set1_epi32(zfix * qsum[(m0 + r) * G + g]);
                for (int v = 0; v < (FOUR ? 4 : 8); v++) {
                    const __m256i raw = _mm256_loadu_si256((const void *)(w + 64 * v + 32 * hf));
                    if (FOUR) {
                        const __m256i wl = _mm256_and_si256(raw, low);
                        const __m256i wh = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                        for (int r = 0; r < NR; r++) {
                            const int8_t *qr = q + (m0 + r) * K + g * GROUP;
                            int32_t f0, f1;
                            memcpy(&f0, qr + 4 * v, 4);
                            memcpy(&f1, qr + 4 * (v + 4), 4);
                            const __m256i p0 = _mm256_maddubs_epi16(wl, _mm256_set1_epi32(f0));
                            const __m256i p1 = _mm256_maddubs_epi16(wh, _mm256_set1_epi32(f1));
                            dot[r] = _mm256_add_epi32(
                                dot[r], _mm256_madd_epi16(_mm256_add_epi16(p0, p1), ones));
                        }
                    } else {
                        const __m256i ws = _mm256_xor_si256(raw, flip);
                        const __m256i aw = _mm256_abs_epi8(ws);
                        for (int r = 0; r < NR; r++) {
                            int32_t f;
                            memcpy(&f, q + (m0 + r) * K + g * GROUP + 4 * v, 4);
                            const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(f), ws);
                            dot[r] = _mm256_add_epi32(
                                dot[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xs), ones));
                        }
                    }
                }
                const int64_t at = ((nb + b) * G + g) * 16 + 8 * hf;
                const __m256 d = _mm256_loadu_ps(scale + at);
                for (int r = 0; r < NR; r++) {
                    const __m256 ds = _mm256_mul_ps(d, _mm256_set1_ps(sx[(m0 + r) * G + g]));
                    acc[r][b][hf] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), ds,
                                                    acc[r][b][hf]);
                    if (offs)
                        acc[r][b][hf] = _mm256_fmadd_ps(
                            _mm256_loadu_ps(offs + at),
                            _mm256_set1_ps(xsum[(m0 + r) * G + g]), acc[r][b][hf]);
                }
            }
        }
    }
    for (int b = 0; b < NB2; b++) {
        const int64_t n0 = (nb + b) * 16;
        for (int hf = 0; hf < 2; hf++) {
            const int64_t left = N - n0 - 8 * hf;
            for (int r = 0; r < NR; r++) {
                float *dst = out + (m0 + r) * out_stride + n0 + 8 * hf;
                if (left >= 8) {
                    _mm256_storeu_ps(dst, acc[r][b][hf]);
                } else if (left > 0) {
                    float tmp[8];
                    _mm256_storeu_ps(tmp, acc[r][b][hf]);
                    memcpy(dst, tmp, sizeof(float) * (size_t)left);
                }
            }
        }
    }
}

#endif
