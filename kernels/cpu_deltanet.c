/* One token of the gated delta rule (Qwen3-Next's DeltaNet layers) for a batch of
 * sequences, in place in each sequence's slot of the layer's state (fp32).
 *
 * For sequence i (slot slots[i]) and value head h, with the state S [dk][dv]:
 *     S = S * decay[i, h]
 *     delta = beta[i, h] * (v - k^T S)
 *     S = S + k (outer) delta
 *     out[i, h, :] = q^T S
 * in two passes over S (the first decays it and reads k^T S, the second writes
 * the update and reads q^T S from the row just written), the state going from
 * memory to the core and back once: a head's matrix (dk x dv: 64 KB in the
 * release) stays in cache between the passes. torch needs a gather of the
 * batch's states, five passes over the copy and a scatter back. Tasks are
 * (sequence, head) pairs under OpenMP; the inner loops run along dv, contiguous.
 * Returns 1 (nothing written) when a slot is out of range, 2 when dv is over
 * the kernel's row buffer.
 */
#include <stdint.h>

#define DV_MAX 1024

int delta_rule_update(float *state, int64_t num_slots, const int64_t *slots, int64_t n,
                      int64_t heads, int64_t dk, int64_t dv, const float *decay,
                      const float *beta, const float *q, const float *k, const float *v,
                      float *out, int threads)
{
    if (dv > DV_MAX)
        return 2;
    for (int64_t i = 0; i < n; i++)
        if (slots[i] < 0 || slots[i] >= num_slots)
            return 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t task = 0; task < n * heads; task++) {
        const int64_t i = task / heads, h = task % heads;
        float *s = state + (slots[i] * heads + h) * dk * dv;
        const float d = decay[task], b = beta[task];
        const float *qv = q + task * dk, *kv = k + task * dk, *vv = v + task * dv;
        float *o = out + task * dv;
        float delta[DV_MAX];
        for (int64_t c = 0; c < dv; c++)
            delta[c] = 0.0f;
        for (int64_t r = 0; r < dk; r++) {  /* decay; delta holds k^T S */
            float *row = s + r * dv;
            const float kr = kv[r];
            for (int64_t c = 0; c < dv; c++) {
                const float x = row[c] * d;
                row[c] = x;
                delta[c] += kr * x;
            }
        }
        for (int64_t c = 0; c < dv; c++) {
            delta[c] = b * (vv[c] - delta[c]);
            o[c] = 0.0f;
        }
        for (int64_t r = 0; r < dk; r++) {  /* write; o reads q^T S */
            float *row = s + r * dv;
            const float kr = kv[r], qr = qv[r];
            for (int64_t c = 0; c < dv; c++) {
                const float x = row[c] + kr * delta[c];
                row[c] = x;
                o[c] += qr * x;
            }
        }
    }
    return 0;
}
