/* One token of Mamba-2's selective scan for a batch of sequences, in place in
 * each sequence's slot of the layer's SSM state (fp32).
 *
 * For sequence i (slot slots[i]) and head h, with the state S [P][N]:
 *     S = S * dA[i, h] + xdt[i, h, :] (outer) b[i, h, :]
 *     y[i, h, :] = S @ c[i, h, :]
 * in one read and one write of S: torch needs a gather of the batch's
 * states, three passes over the copy and a scatter back, and the state
 * (heads x head_dim x d_state a sequence: 393k numbers in Granite 4.0-H)
 * is what a decode step waits for. Tasks are (sequence, head) pairs under
 * OpenMP; the inner loop runs along d_state, contiguous, and vectorises.
 * Returns 1 (nothing written) when a slot is out of range.
 */
#include <stdint.h>

int mamba_state_update(float *ssm, int64_t num_slots, const int64_t *slots, int64_t n,
                       int64_t heads, int64_t p, int64_t d_state, const float *da,
                       const float *xdt, const float *b, const float *c, float *y,
                       int threads)
{
    for (int64_t i = 0; i < n; i++)
        if (slots[i] < 0 || slots[i] >= num_slots)
            return 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t task = 0; task < n * heads; task++) {
        const int64_t i = task / heads, h = task % heads;
        float *s = ssm + (slots[i] * heads + h) * p * d_state;
        const float decay = da[task];
        const float *bv = b + task * d_state, *cv = c + task * d_state;
        const float *xv = xdt + task * p;
        float *out = y + task * p;
        for (int64_t r = 0; r < p; r++) {
            float *row = s + r * d_state;
            const float x = xv[r];
            float acc = 0.0f;
            for (int64_t k = 0; k < d_state; k++) {
                const float v = row[k] * decay + x * bv[k];
                row[k] = v;
                acc += v * cv[k];
            }
            out[r] = acc;
        }
    }
    return 0;
}
