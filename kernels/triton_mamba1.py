"""Mamba-1's selective scan on a GPU (Jamba, Mamba, Falcon-Mamba;
``worker/layers/mamba1.py``): a batch's one-token update in place in each sequence's
slot, and a prompt's scan with each channel's state in registers.

The state is one decay per channel and state dimension, ``h[d, :] = h[d, :] *
exp(dt[d] A[d, :]) + dt[d] x[d] B``, ``y[d] = h[d, :] . C``: channels never mix, so a
program takes a tile of ``BLOCK_D`` channels with all ``d_state`` columns. The
update loads its tile of the slot's state, advances it and stores it back (one read,
one write; the torch path gathers the batch's slots, passes over the copy three times
and scatters it back). The scan walks a prompt's tokens in order with the tile in
registers, reading each token's ``dt``, ``x``, ``B`` and ``C`` once and writing ``y``:
the torch path's Hillis-Steele scan makes log2(chunk) passes over ``[chunk,
channels, d_state]`` tensors instead. Neither syncs with the host.

Tested on CPU through the Triton interpreter and compiled for sm_80 / sm_90 without a
device (``tests/kernels/_aot_compile.py``); the GPU window runs them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_D = 64  # channels a program takes (x d_state columns: 1,024 numbers at 16)


@triton.jit
def _mamba1_update_kernel(ssm_ptr, slots_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, y_ptr,
                          D: tl.constexpr, N: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_N: tl.constexpr):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    ds = tile * BLOCK_D + tl.arange(0, BLOCK_D)
    ns = tl.arange(0, BLOCK_N)
    d_ok = ds < D
    n_ok = ns < N
    both = d_ok[:, None] & n_ok[None, :]
    at = ssm_ptr + slot * D * N + ds[:, None] * N + ns[None, :]
    h = tl.load(at, mask=both, other=0.0)
    a = tl.load(a_ptr + ds[:, None] * N + ns[None, :], mask=both, other=0.0)
    step = tl.load(dt_ptr + seq * D + ds, mask=d_ok, other=0.0)
    u = step * tl.load(x_ptr + seq * D + ds, mask=d_ok, other=0.0)
    b = tl.load(b_ptr + seq * N + ns, mask=n_ok, other=0.0)
    c = tl.load(c_ptr + seq * N + ns, mask=n_ok, other=0.0)
    h = h * tl.exp(step[:, None] * a) + u[:, None] * b[None, :]
    tl.store(at, h, mask=both)
    tl.store(y_ptr + seq * D + ds, tl.sum(h * c[None, :], axis=1), mask=d_ok)


@triton.jit
def _mamba1_scan_kernel(h_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, y_ptr, length,
                        D: tl.constexpr, N: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    tile = tl.program_id(0)
    ds = tile * BLOCK_D + tl.arange(0, BLOCK_D)
    ns = tl.arange(0, BLOCK_N)
    d_ok = ds < D
    n_ok = ns < N
    both = d_ok[:, None] & n_ok[None, :]
    at = h_ptr + ds[:, None] * N + ns[None, :]
    h = tl.load(at, mask=both, other=0.0)
    a = tl.load(a_ptr + ds[:, None] * N + ns[None, :], mask=both, other=0.0)
    for t in range(length):
        step = tl.load(dt_ptr + t * D + ds, mask=d_ok, other=0.0)
        u = step * tl.load(x_ptr + t * D + ds, mask=d_ok, other=0.0)
        b = tl.load(b_ptr + t * N + ns, mask=n_ok, other=0.0)
        c = tl.load(c_ptr + t * N + ns, mask=n_ok, other=0.0)
        h = h * tl.exp(step[:, None] * a) + u[:, None] * b[None, :]
        tl.store(y_ptr + t * D + ds, tl.sum(h * c[None, :], axis=1), mask=d_ok)
    tl.store(at, h, mask=both)


def update(ssm: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, dt: torch.Tensor,
           a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """One token for each of ``len(slots)`` sequences in place in ``ssm [S, D, N]``
    (fp32, contiguous): ``x`` and ``dt [n, D]``, ``a [D, N]``, ``b`` and ``c [n, N]``;
    returns ``y [n, D]`` fp32 (``cpu_mamba.mamba1_state_update``'s contract)."""
    _, width, d_state = ssm.shape
    n = slots.shape[0]
    if not ssm.is_contiguous() or ssm.dtype != torch.float32:
        raise ValueError("Mamba-1 kernel: the state must be contiguous fp32")
    x, dt, a, b, c = (t.float().contiguous() for t in (x, dt, a, b, c))
    y = torch.empty((n, width), dtype=torch.float32, device=ssm.device)
    if n == 0:
        return y
    grid = (triton.cdiv(width, BLOCK_D), n)
    _mamba1_update_kernel[grid](ssm, slots.to(torch.int64).contiguous(), x, dt, a, b, c, y,
                                D=width, N=d_state, BLOCK_D=BLOCK_D,
                                BLOCK_N=triton.next_power_of_2(d_state))
    return y


def scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
         c: torch.Tensor, h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's scan (``layers.mamba1.selective_scan``'s contract): ``x`` and
    ``dt [L, D]``, ``a [D, N]``, ``b`` and ``c [L, N]``, ``h0 [D, N]``; returns ``y
    [L, D]`` and the state after the last token, fp32."""
    length, width = x.shape
    d_state = a.shape[1]
    h = h0.float().clone().contiguous()
    x, dt, a, b, c = (t.float().contiguous() for t in (x, dt, a, b, c))
    y = torch.empty((length, width), dtype=torch.float32, device=x.device)
    if length == 0:
        return y, h
    _mamba1_scan_kernel[(triton.cdiv(width, BLOCK_D),)](
        h, x, dt, a, b, c, y, length, D=width, N=d_state, BLOCK_D=BLOCK_D,
        BLOCK_N=triton.next_power_of_2(d_state))
    return y, h
