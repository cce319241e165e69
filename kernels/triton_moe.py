"""Routed SwiGLU (or squared-ReLU) experts on a GPU: a grouped GEMM in two Triton
kernels (vLLM's fused MoE).

A step's (token, expert) pairs are grouped by expert and each expert's group
padded to a multiple of ``BLOCK_M`` rows (``align``), so every row block of
the padded list belongs to one expert. Kernel one multiplies a block's token
rows by its expert's gate and up columns and keeps ``silu(gate) * up``; kernel
two multiplies that by the expert's down matrix and scales each row by its
routing weight. Each token's K results are then summed in fp32. fp32 models
get exact fp32 dots (``input_precision="ieee"``, not TF32: HF parity), 16-bit
ones tensor-core dots accumulating in fp32. Only the experts some
row chose are read, once per row block, and nothing is copied to the host:
the padded length has a static bound (``T K + E (BLOCK_M - 1)``), so the
whole layer can be captured in a CUDA graph. The torch loop over experts it
replaces read the per-expert row counts on the host every layer.

Tested on CPU through the Triton interpreter (fp32) and compiled for sm_80 /
sm_90 without a device; the GPU window (``bench/gpu_check.sh``) runs it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16


def align(chosen: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pairs, block_experts)``: pair ids (``token * K + j``) grouped by expert, each
    group padded with ``T * K`` (no pair) to a multiple of ``block_m``, the list padded
    to its static bound; and each row block's expert (-1 past the last group). A choice
    of -1 (another rank's expert, under expert parallelism) gets no slot."""
    t, k = chosen.shape
    n, dev = t * k, chosen.device
    flat = chosen.reshape(-1)
    held = flat >= 0
    flat = torch.where(held, flat, num_experts)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    counts = counts[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    first = torch.cumsum(counts, 0) - counts  # first sorted position of each expert
    experts_sorted = flat[order].clamp(max=num_experts - 1)
    dest = starts[experts_sorted] + torch.arange(n, device=dev) - first[experts_sorted]
    bound = n + num_experts * (block_m - 1)
    bound = (bound + block_m - 1) // block_m * block_m
    dest = torch.where(held[order], dest, bound)  # one slot past the list, cut off below
    pairs = torch.full((bound + 1,), n, dtype=torch.int64, device=dev)
    pairs.scatter_(0, dest, order)
    pairs = pairs[:bound]
    block_start = torch.arange(0, bound, block_m, device=dev)
    block_experts = torch.searchsorted(ends, block_start, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1)
    return pairs, block_experts


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, h_ptr, pairs_ptr, experts_ptr, num_pairs, hidden, inter, top_k,
    stride_xt, stride_we, stride_wn, stride_ht,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr, b_ptr=None, stride_be=0, alpha=1.0, limit=0.0,
    BIAS: tl.constexpr = False, CLAMP: tl.constexpr = False, RELU2: tl.constexpr = False,
):
    """h[pair, n] = silu(x[token] . w[e, n]) * (x[token] . w[e, inter + n]); with ``BIAS``
    ``b[e]`` (gate half, up half) added to both products first, with ``CLAMP`` GPT-OSS's
    ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g)``, ``g = min(gate, limit)``;
    with ``RELU2`` an ungated expert's ``relu(x[token] . w[e, n]) ** 2`` (``w[e]`` its up
    rows alone: Nemotron 3's)."""
    mb = tl.program_id(0)
    nb = tl.program_id(1)
    e = tl.load(experts_ptr + mb).to(tl.int64)
    if e >= 0:
        pair = tl.load(pairs_ptr + mb * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pair < num_pairs
        token = (pair // top_k).to(tl.int64)
        cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < inter
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        w_base = w_ptr + e * stride_we
        for k0 in range(0, hidden, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < hidden
            a = tl.load(x_ptr + token[:, None] * stride_xt + ks[None, :],
                        mask=valid[:, None] & k_ok[None, :], other=0.0)
            wg = tl.load(w_base + cols[None, :].to(tl.int64) * stride_wn + ks[:, None],
                         mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            if DOT_F32:
                gate += tl.dot(a.to(tl.float32), wg.to(tl.float32), input_precision="ieee")
            else:
                gate += tl.dot(a, wg)
            if not RELU2:
                wu = tl.load(w_base + (inter + cols[None, :]).to(tl.int64) * stride_wn
                             + ks[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
                if DOT_F32:
                    up += tl.dot(a.to(tl.float32), wu.to(tl.float32), input_precision="ieee")
                else:
                    up += tl.dot(a, wu)
        if BIAS:
            gate += tl.load(b_ptr + e * stride_be + cols, mask=col_ok, other=0.0
                            ).to(tl.float32)[None, :]
            up += tl.load(b_ptr + e * stride_be + inter + cols, mask=col_ok, other=0.0
                          ).to(tl.float32)[None, :]
        if RELU2:
            gate = tl.maximum(gate, 0.0)
            h = gate * gate
        elif CLAMP:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
            h = gate / (1.0 + tl.exp(-alpha * gate)) * (up + 1.0)
        else:
            h = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(h_ptr + pair[:, None].to(tl.int64) * stride_ht + cols[None, :],
                 h.to(h_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, y_ptr, scale_ptr, pairs_ptr, experts_ptr, num_pairs, hidden, inter,
    stride_ht, stride_we, stride_wn, stride_yt,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr, b_ptr=None, stride_be=0, BIAS: tl.constexpr = False,
):
    """y[pair, n] = scale[pair] * (h[pair] . w[e, n] (+ b[e, n] with ``BIAS``))."""
    mb = tl.program_id(0)
    nb = tl.program_id(1)
    e = tl.load(experts_ptr + mb).to(tl.int64)
    if e >= 0:
        pair = tl.load(pairs_ptr + mb * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pair < num_pairs
        prow = pair.to(tl.int64)
        cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < hidden
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        w_base = w_ptr + e * stride_we
        for k0 in range(0, inter, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < inter
            a = tl.load(h_ptr + prow[:, None] * stride_ht + ks[None, :],
                        mask=valid[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_base + cols[None, :].to(tl.int64) * stride_wn + ks[:, None],
                        mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            if DOT_F32:
                acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(a, w)
        if BIAS:
            acc += tl.load(b_ptr + e * stride_be + cols, mask=col_ok, other=0.0
                           ).to(tl.float32)[None, :]
        scale = tl.load(scale_ptr + prow, mask=valid, other=0.0).to(tl.float32)
        acc = acc * scale[:, None]
        tl.store(y_ptr + prow[:, None] * stride_yt + cols[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


def experts(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
            w13: torch.Tensor, w2: torch.Tensor, block_n: int = 64, block_k: int = 32,
            partial: bool = False, b13: torch.Tensor | None = None,
            b2: torch.Tensor | None = None, clamp: tuple[float, float] | None = None,
            relu2: bool = False) -> torch.Tensor:
    """Sum over each row's ``chosen [T, K]`` experts of ``weights [T, K]`` times the
    expert's SwiGLU of ``x [T, H]``; ``w13 [E, 2I, H]`` (gate rows, then up rows),
    ``w2 [E, H, I]``, all in ``x``'s dtype, last dimension contiguous. With ``partial``
    a choice may be -1 (another rank's expert), which adds nothing. GPT-OSS's experts:
    biases ``b13 [E, 2I]`` and ``b2 [E, H]`` (before the routing weight) and ``clamp``
    ``(alpha, limit)``, its clamped SwiGLU. ``relu2``: ungated experts, ``relu(x W1^T)
    ** 2`` with ``w13 [E, I, H]`` their up rows alone (Nemotron 3's)."""
    t, k = chosen.shape
    e, two_i, hidden = w13.shape
    inter = two_i if relu2 else two_i // 2
    if x.stride(1) != 1:
        x = x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    pairs, block_experts = align(chosen, e)
    n = t * k
    h = torch.empty((n, inter), dtype=x.dtype, device=x.device)
    # With another rank's pairs (expert parallelism) zeros: those rows are never written.
    y = (torch.zeros if partial else torch.empty)((n, hidden), dtype=torch.float32,
                                                   device=x.device)
    scales = weights.reshape(-1).to(torch.float32).contiguous()
    m_blocks = block_experts.shape[0]
    f32 = x.dtype == torch.float32  # exact fp32 dots (not TF32); 16-bit dots accumulate in fp32
    alpha, limit = clamp if clamp is not None else (1.0, 0.0)
    b13 = None if b13 is None else b13.contiguous()
    b2 = None if b2 is None else b2.contiguous()
    _gate_up_kernel[(m_blocks, triton.cdiv(inter, block_n))](
        x, w13, h, pairs, block_experts, n, hidden, inter, k,
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, DOT_F32=f32,
        b_ptr=b13, stride_be=0 if b13 is None else b13.stride(0), alpha=float(alpha),
        limit=float(limit), BIAS=b13 is not None, CLAMP=clamp is not None, RELU2=relu2)
    _down_kernel[(m_blocks, triton.cdiv(hidden, block_n))](
        h, w2, y, scales, pairs, block_experts, n, hidden, inter,
        h.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, DOT_F32=f32,
        b_ptr=b2, stride_be=0 if b2 is None else b2.stride(0), BIAS=b2 is not None)
    return y.view(t, k, hidden).sum(dim=1).to(x.dtype)
