"""The gated delta rule's one-token step on a GPU, in place in each sequence's slot
(Qwen3-Next / Qwen3.5's DeltaNet decode; ``worker/layers/gated_deltanet.py``).

One program per (sequence, value head, tile of ``BLOCK_V`` value columns) loads its
``[key dim, BLOCK_V]`` tile of the fp32 state from the sequence's slot, decays it,
reads ``k^T S`` for its columns, writes ``k (outer) beta (v - k^T S)`` back, and
reads ``q^T S`` as its output: the state crosses memory once each way, where the
torch path gathers the batch's slots, makes five passes over the copy and scatters
it back. Every column of ``S`` only mixes rows of its own column, so tiles need
nothing from each other. No host sync: the step can run inside a CUDA graph.

Tested on CPU through the Triton interpreter and compiled for sm_80 / sm_90 without
a device (``tests/kernels/_aot_compile.py``); the GPU window runs it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _delta_rule_decode_kernel(state_ptr, slots_ptr, decay_ptr, beta_ptr, q_ptr, k_ptr,
                              v_ptr, out_ptr, HEADS: tl.constexpr, DK: tl.constexpr,
                              DV: tl.constexpr, BLOCK_K: tl.constexpr,
                              BLOCK_V: tl.constexpr):
    tile = tl.program_id(0)
    row = tl.program_id(1)  # (sequence, head) pairs, sequence-major
    seq = row // HEADS
    head = row % HEADS
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    vs = tile * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = ks < DK
    v_ok = vs < DV
    at = state_ptr + (slot * HEADS + head) * DK * DV + ks[:, None] * DV + vs[None, :]
    both = k_ok[:, None] & v_ok[None, :]
    s = tl.load(at, mask=both, other=0.0)
    q = tl.load(q_ptr + row * DK + ks, mask=k_ok, other=0.0)
    k = tl.load(k_ptr + row * DK + ks, mask=k_ok, other=0.0)
    v = tl.load(v_ptr + row * DV + vs, mask=v_ok, other=0.0)
    s = s * tl.load(decay_ptr + row)
    delta = (v - tl.sum(s * k[:, None], axis=0)) * tl.load(beta_ptr + row)
    s = s + k[:, None] * delta[None, :]
    tl.store(at, s, mask=both)
    tl.store(out_ptr + row * DV + vs, tl.sum(s * q[:, None], axis=0), mask=v_ok)


def block_v(dk: int, dv: int) -> int:
    """Value columns a program takes: a ``[key dim, BLOCK_V]`` tile of about 4096
    numbers (16 KB of registers for 128 threads), at most the value dim's power of 2."""
    return max(1, min(triton.next_power_of_2(dv), 4096 // triton.next_power_of_2(dk)))


def decode(state: torch.Tensor, slots: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
           q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One delta-rule step of ``state[slots]`` in place (``cpu_deltanet.update``'s
    contract): ``state [S, H, dk, dv]`` fp32 contiguous, ``slots [n]``, ``decay`` and
    ``beta [n, H]``, ``q`` and ``k [n, H, dk]``, ``v [n, H, dv]``; returns ``q^T S``
    ``[n, H, dv]`` fp32."""
    _, heads, dk, dv = state.shape
    n = slots.shape[0]
    if not state.is_contiguous() or state.dtype != torch.float32:
        raise ValueError("DeltaNet kernel: the state must be contiguous fp32")
    decay, beta, q, k, v = (t.float().contiguous() for t in (decay, beta, q, k, v))
    out = torch.empty((n, heads, dv), dtype=torch.float32, device=state.device)
    if n == 0:
        return out
    bv = block_v(dk, dv)
    grid = (triton.cdiv(dv, bv), n * heads)
    _delta_rule_decode_kernel[grid](state, slots.to(torch.int64).contiguous(), decay, beta,
                                    q, k, v, out, HEADS=heads, DK=dk, DV=dv,
                                    BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=bv)
    return out
