/* One token of Mamba-2's selective scan for a batch of sequences, in place in
 * each sequence's slot of the layer's SSM state (fp32); and Mamba-1's (a decay
 * per channel and state dimension), one token for a batch and a whole sequence.
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

#include "cpu_math.h"

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

/* Mamba-1, one token for each of n sequences: for sequence i (slot slots[i]) and
 * channel d, with the state row S [d_state]:
 *     S = S * exp(dt[i, d] * a[d, :]) + dt[i, d] x[i, d] b[i, :]
 *     y[i, d] = S . c[i, :]
 * in place in the slot, one read and one write of S; torch's gather, exp,
 * update and scatter pass over the batch's states four times. Tasks are
 * (sequence, channel) pairs; the decay's exp is the vectorisable one (its
 * argument is never positive: dt >= 0, a < 0). Returns 1 (nothing written)
 * when a slot is out of range.
 */
int mamba1_state_update(float *ssm, int64_t num_slots, const int64_t *slots, int64_t n,
                        int64_t channels, int64_t d_state, const float *dt, const float *x,
                        const float *a, const float *b, const float *c, float *y,
                        int threads)
{
    for (int64_t i = 0; i < n; i++)
        if (slots[i] < 0 || slots[i] >= num_slots)
            return 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t task = 0; task < n * channels; task++) {
        const int64_t i = task / channels, d = task % channels;
        float *row = ssm + (slots[i] * channels + d) * d_state;
        const float step = dt[task], u = step * x[task];
        const float *av = a + d * d_state, *bv = b + i * d_state, *cv = c + i * d_state;
        float acc = 0.0f;
        for (int64_t k = 0; k < d_state; k++) {
            const float v = row[k] * exp_nonpos(step * av[k]) + u * bv[k];
            row[k] = v;
            acc += v * cv[k];
        }
        y[task] = acc;
    }
    return 0;
}

/* Mamba-1 over one sequence of `length` tokens from the state h [channels,
 * d_state] (left holding the state after the last token): the recurrence above
 * token by token, each channel's row kept in registers through the sequence.
 * dt and x come channel-major ([channels, length]) so a channel reads its own
 * contiguous run; b and c are [length, d_state]; y is written [channels,
 * length]. Exact (no chunking), one pass over the inputs; tasks are channels.
 */
void mamba1_scan(float *h, int64_t length, int64_t channels, int64_t d_state,
                 const float *dt, const float *x, const float *a, const float *b,
                 const float *c, float *y, int threads)
{
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t d = 0; d < channels; d++) {
        float *row = h + d * d_state;
        const float *av = a + d * d_state, *dtv = dt + d * length, *xv = x + d * length;
        float *out = y + d * length;
        for (int64_t t = 0; t < length; t++) {
            const float step = dtv[t], u = step * xv[t];
            const float *bv = b + t * d_state, *cv = c + t * d_state;
            float acc = 0.0f;
            for (int64_t k = 0; k < d_state; k++) {
                const float v = row[k] * exp_nonpos(step * av[k]) + u * bv[k];
                row[k] = v;
                acc += v * cv[k];
            }
            out[t] = acc;
        }
    }
}
