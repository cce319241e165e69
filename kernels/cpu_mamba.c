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
/* One Mamba-1 state row (one channel's d_state numbers) through one token, in
 * place: row = row * exp(step a) + u b; returns row . c. */
static inline float mamba1_row(float *row, const float *a, float step, float u,
                               const float *b, const float *c, int64_t d_state)
{
    float acc = 0.0f;
    for (int64_t k = 0; k < d_state; k++) {
        const float v = row[k] * exp_nonpos(step * a[k]) + u * b[k];
        row[k] = v;
        acc += v * c[k];
    }
    return acc;
}

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
        y[task] = mamba1_row(ssm + (slots[i] * channels + d) * d_state, a + d * d_state,
                             dt[task], dt[task] * x[task], b + i * d_state, c + i * d_state,
                             d_state);
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
        for (int64_t t = 0; t < length; t++)
            out[t] = mamba1_row(row, av, dtv[t], dtv[t] * xv[t], b + t * d_state,
                                c + t * d_state, d_state);
    }
}

/* The causal depthwise convolution's one-token step for n sequences, in place in
 * each sequence's slot of the layer's convolution state (every recurrent mixer
 * runs it before its recurrence: layers/causal_conv.py):
 *     window = [state[slots[i], c, :], x[i, c]]       (kernel taps)
 *     out[i, c] = window . w[c, :] + bias[c]
 *     state[slots[i], c, :] = window[1:]
 * in one pass (torch gathers the slots, concatenates, scatters the shifted window
 * back and multiplies, sums and adds: five passes). x rows are `xs` elements apart
 * (a column slice of the input projection's output); state, w, bias and out are
 * contiguous, all fp32 or (bf16 != 0) all bf16, summed in fp32. Tasks are
 * (sequence, block of 64 channels). Returns 1 (nothing written) when a slot is out
 * of range.
 */
int conv_state_update(const void *x, int64_t xs, void *state, int64_t num_slots,
                      const int64_t *slots, int64_t n, int64_t channels, int64_t kernel,
                      const void *w, const void *bias, void *out, int bf16, int threads)
{
    for (int64_t i = 0; i < n; i++)
        if (slots[i] < 0 || slots[i] >= num_slots)
            return 1;
    const int64_t keep = kernel - 1, blocks = (channels + 63) / 64;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t task = 0; task < n * blocks; task++) {
        const int64_t i = task / blocks, c0 = (task % blocks) * 64;
        const int64_t c1 = c0 + 64 < channels ? c0 + 64 : channels;
        for (int64_t c = c0; c < c1; c++) {
            const int64_t row = (slots[i] * channels + c) * keep;
            float acc = bias ? ld(bias, c, bf16) : 0.0f;
            float prev = ld(x, i * xs + c, bf16);
            acc += prev * ld(w, c * kernel + keep, bf16);
            for (int64_t k = keep - 1; k >= 0; k--) {  /* shift right to left */
                const float s = ld(state, row + k, bf16);
                acc += s * ld(w, c * kernel + k, bf16);
                st(state, row + k, prev, bf16);
                prev = s;
            }
            st(out, i * channels + c, acc, bf16);
        }
    }
    return 0;
}
