"""The Mamba-1 mixer (Jamba's, Mamba's, Falcon-Mamba's) over a flat, mixed batch, each
sequence's state in its slot.

Per token the mixer projects the input to the convolution's input x and a gate z;
runs a causal depthwise convolution over x (its last ``d_conv - 1`` inputs carried in
the state) and a SiLU; projects that to a low-rank step size, B and C (``x_proj``;
Jamba RMS-normalises each, Falcon-Mamba without weights), lifts the step to a
channel's ``dt`` (``dt_proj``, then softplus); then the selective scan ``h_t =
exp(dt_t A) h_{t-1} + dt_t x_t B_t``, ``y_t = h_t C_t + D x_t`` with one decay per
channel and state dimension (``A``: ``[intermediate, d_state]``), gated by
``silu(z)`` before the output projection: transformers' ``JambaMambaMixer``,
``MambaMixer`` and ``FalconMambaMixer`` (their torch paths), which the tests hold
this to.

One-token rows (decodes) run as batches: a gather of their states, one update, a
scatter back (one pass in the slots: ``kernels.cpu_mamba`` on CPU,
``kernels.triton_mamba1`` on CUDA). Longer rows (prompts, prefill chunks) run one
sequence at a time through the scan, from the slot's state, so a prompt split into
prefill chunks gives what it gives whole. Mamba-1's decay differs per state
dimension, so the chunked matmul form of Mamba-2's scan (``layers.mamba2.ssd_scan``)
does not apply. The native and Triton scans run the recurrence token by token, each
channel's state in registers; elsewhere ``selective_scan`` is a Hillis-Steele prefix
scan within chunks (log2 of the chunk's length passes, each over the whole chunk)
and a carry between chunks: no Python loop runs per token, and no step exponentiates
anything but a decay in (0, 1].

Tensor parallelism splits the channels (vLLM's split): each rank projects, convolves
and scans its share; ``x_proj`` is row-parallel (its all-reduce gives every rank the
whole step size, B and C: one collective a layer, after every row's convolution, so
ranks agree however the step's rows split), ``dt_proj`` column-parallel, and the
row-parallel output projection sums the ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels import cpu_mamba
from pagedserve.worker.layers.causal_conv import conv_decode, conv_prefill
from pagedserve.worker.layers.linear import (
    ColumnParallelLinear,
    LazyTensor,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from pagedserve.worker.layers.mixer_params import check_shape, frozen_param, rank_share
from pagedserve.worker.mamba1_config import Mamba1Config
from pagedserve.worker.mamba_state import MambaStep
from pagedserve.worker.models.fused_weights import split_rows
from pagedserve.worker.parallel import ParallelContext

# The scan's chunk holds at most this many state numbers (chunk x channels x d_state):
# a few MB a pass, whatever the model's width.
_SCAN_NUMBERS = 1 << 22


class Mamba1Mixer(nn.Module):
    """A Mamba-1 layer's mixer; ``state_index`` is its place among this rank's mixers
    (the slot tensors it reads in a ``MambaStep``)."""

    def __init__(self, hidden: int, mc: Mamba1Config, ctx: ParallelContext,
                 dtype: torch.dtype, device: torch.device, state_index: int) -> None:
        super().__init__()
        tp = ctx.world_size
        if mc.intermediate % tp:
            raise ValueError(f"a Mamba-1 layer's width ({mc.intermediate} channels) must be "
                             f"divisible by tensor_parallel_size ({tp})")
        self.mc, self.rank, self.state_index = mc, ctx.rank, state_index
        self.inter = mc.intermediate // tp
        n, r = mc.d_state, mc.dt_rank
        self.in_proj = MergedColumnParallelLinear(
            hidden, [mc.intermediate, mc.intermediate], ctx, dtype, device, bias=mc.proj_bias)
        self.conv_weight = frozen_param((self.inter, mc.d_conv), dtype, device)
        self.conv_bias = frozen_param((self.inter,), dtype, device) if mc.conv_bias else None
        self.x_proj = RowParallelLinear(mc.intermediate, r + 2 * n, False, ctx, dtype, device)
        self.dt_proj = ColumnParallelLinear(r, mc.intermediate, True, ctx, dtype, device)
        self.A_log = frozen_param((self.inter, n), torch.float32, device)
        self.D = frozen_param((self.inter,), torch.float32, device)
        if mc.inner_norms not in ("weighted", "plain", "none"):
            raise ValueError(f"inner_norms must be 'weighted', 'plain' or 'none', got "
                             f"{mc.inner_norms!r}")
        self.norms = {"dt_layernorm": frozen_param((r,), dtype, device),
                      "b_layernorm": frozen_param((n,), dtype, device),
                      "c_layernorm": frozen_param((n,), dtype, device)} \
            if mc.inner_norms == "weighted" else {}
        for name, p in self.norms.items():
            self.register_parameter(name, p)
        self.out_proj = RowParallelLinear(mc.intermediate, hidden, mc.proj_bias, ctx, dtype,
                                          device)

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """One sequence's slot on this rank: the convolution's last inputs ``[channels,
        d_conv - 1]`` and the SSM state ``[channels, d_state]``."""
        return (self.inter, self.mc.d_conv - 1), (self.inter, self.mc.d_state)

    # ---- loading -------------------------------------------------------------------------

    def checkpoint_names(self) -> set[str]:
        """Its tensors, as named under the layer's mixer (``mamba.``, ``mixer.``)."""
        names = {"in_proj.weight", "conv1d.weight", "x_proj.weight", "dt_proj.weight",
                 "dt_proj.bias", "A_log", "D", "out_proj.weight"}
        names |= {f"{n}.weight" for n in self.norms}
        if self.mc.conv_bias:
            names.add("conv1d.bias")
        if self.mc.proj_bias:
            names |= {"in_proj.bias", "out_proj.bias"}
        return names

    def load(self, name: str, lazy: LazyTensor) -> bool:
        """Copy this rank's share of tensor ``name`` (under the mixer); False if unknown."""
        mc = self.mc
        module, _, kind = name.rpartition(".")
        if name in ("in_proj.weight", "in_proj.bias"):
            for i, rows in enumerate(split_rows(lazy, [mc.intermediate] * 2, name)):
                self.in_proj.load(i, rows, kind == "bias")
        elif module in ("x_proj", "dt_proj", "out_proj") and kind in ("weight", "bias"):
            getattr(self, module).load(lazy, kind == "bias")
        elif name == "conv1d.weight" or (name == "conv1d.bias" and self.conv_bias is not None):
            target = self.conv_weight if kind == "weight" else self.conv_bias
            full = (mc.intermediate, 1, mc.d_conv) if kind == "weight" else (mc.intermediate,)
            check_shape(name, lazy, full)
            mine = rank_share(lazy[:].reshape(mc.intermediate, -1), self.inter, self.rank)
            target.data.copy_(mine.reshape(target.shape))
        elif name in ("A_log", "D"):
            check_shape(name, lazy, (mc.intermediate, mc.d_state) if name == "A_log"
                        else (mc.intermediate,))
            getattr(self, name).data.copy_(rank_share(lazy[:], self.inter, self.rank))
        elif module in self.norms and kind == "weight":
            check_shape(name, lazy, tuple(self.norms[module].shape))
            self.norms[module].data.copy_(lazy[:])
        else:
            return False
        return True

    # ---- forward -------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, step: MambaStep) -> torch.Tensor:
        """``[T, hidden]`` in, ``[T, hidden]`` out; the rows' slots updated in place.

        Every row's convolution runs first, then one ``x_proj`` (the layer's
        collective) for the step, then the scans: a row that verifies guesses keeps its
        convolution's state after each position in the first pass, its SSM state's in
        the second (``MambaStep.keep``'s parts)."""
        xs, z = self.in_proj(x).split([self.inter, self.inter], dim=-1)
        conv, ssm = step.conv[self.state_index], step.ssm[self.state_index]
        h = torch.empty(x.shape[0], self.inter, dtype=conv.dtype, device=x.device)
        for j, (rows, slots) in enumerate(step.batches):
            if rows is None:  # every row a single token, in order
                h.copy_(conv_decode(xs, conv, slots, self.conv_weight, self.conv_bias))
            else:
                h[rows] = conv_decode(xs[rows], conv, slots, self.conv_weight,
                                      self.conv_bias)
            step.keep(self.state_index, j, ssm=False)
        for start, n, slot in step.multi:
            end = start + n
            h[start:end] = conv_prefill(xs[start:end], conv, slot, self.conv_weight,
                                        self.conv_bias)
        h = F.silu(h).to(x.dtype)
        dt, b, c = self._ssm_inputs(h)
        hf = h.float()
        y = torch.empty(hf.shape, dtype=torch.float32, device=x.device)
        a = -torch.exp(self.A_log)
        for j, (rows, slots) in enumerate(step.batches):
            if rows is None:
                y.copy_(_state_update(ssm, slots, hf, dt, a, b, c))
            else:
                y[rows] = _state_update(ssm, slots, hf[rows], dt[rows], a, b[rows], c[rows])
            step.keep(self.state_index, j, conv=False)
        scan = _scan_for(ssm)
        for start, n, slot in step.multi:
            end = start + n
            y[start:end], final = scan(hf[start:end], dt[start:end], a, b[start:end],
                                       c[start:end], ssm[slot])
            ssm[slot].copy_(final)
        out = (y + self.D * hf) * F.silu(z.float())
        return self.out_proj(out.to(x.dtype))

    def _ssm_inputs(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """From the activated convolution ``[T, channels]``: each channel's step ``dt``
        (after ``dt_proj``, its bias and softplus) and B and C ``[T, d_state]``, fp32."""
        mc = self.mc
        low, b, c = self.x_proj(h).split([mc.dt_rank, mc.d_state, mc.d_state], dim=-1)
        if mc.inner_norms != "none":
            weight = self.norms.get
            low = _rms(low, weight("dt_layernorm"), mc.norm_eps)
            b = _rms(b, weight("b_layernorm"), mc.norm_eps)
            c = _rms(c, weight("c_layernorm"), mc.norm_eps)
        dt = F.softplus(self.dt_proj(low).float())
        return dt, b.float(), c.float()


def _rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``weight * x / rms(x)``, the statistics in fp32, back in ``x``'s dtype (Jamba's
    ``JambaRMSNorm``; Falcon-Mamba's has no weight)."""
    xf = x.float()
    h = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return h if weight is None else weight * h


def _state_update(ssm: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, dt: torch.Tensor,
                  a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """One token for each of ``len(slots)`` sequences: ``x`` and ``dt [n, channels]``,
    ``b`` and ``c [n, d_state]`` (fp32); their slots' states advanced in place. Returns
    ``y [n, channels]`` without the ``D x`` skip."""
    if cpu_mamba.available(ssm):  # (in place in the slots, one pass)
        return cpu_mamba.mamba1_state_update(ssm, slots, x, dt, a, b, c)
    if ssm.is_cuda:  # (in place in the slots, one Triton program per channel tile)
        from pagedserve.kernels import triton_mamba1

        return triton_mamba1.update(ssm, slots, x, dt, a, b, c)
    state = ssm.index_select(0, slots)  # [n, channels, d_state]
    state.mul_(torch.exp(dt[..., None] * a))
    state.baddbmm_((dt * x)[..., None], b[:, None, :])
    ssm.index_copy_(0, slots, state)
    return torch.bmm(state, c[..., None]).squeeze(-1)


def _scan_for(ssm: torch.Tensor) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """A prompt's scan where the state lives: native on CPU, Triton on CUDA, else the
    torch prefix scan (all with ``selective_scan``'s contract)."""
    if cpu_mamba.available(ssm):
        return cpu_mamba.mamba1_scan
    if ssm.is_cuda:
        from pagedserve.kernels import triton_mamba1

        return triton_mamba1.scan
    return selective_scan


def selective_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   c: torch.Tensor, h0: torch.Tensor, chunk: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The selective scan of one sequence (fp32 throughout).

    ``x`` and ``dt [L, D]`` (dt discretised), ``a [D, N]`` (negative), ``b`` and ``c
    [L, N]``, ``h0 [D, N]`` the state before the first token. Returns ``y [L, D]``
    (without the ``D x`` skip) and the state after the last token. Within a chunk each
    token's pair (decay, input) is combined with the pair ``k`` tokens back, ``k`` =
    1, 2, 4...: after log2(chunk) passes every token holds its state; the chunk's
    last state starts the next chunk.
    """
    length, width = x.shape
    if chunk is None:
        chunk = max(16, min(1024, _SCAN_NUMBERS // max(1, width * a.shape[1])))
    ys, h = [], h0
    for s in range(0, length, chunk):
        e = min(s + chunk, length)
        decay = torch.exp(dt[s:e, :, None] * a)  # [q, D, N]
        u = (dt[s:e] * x[s:e])[:, :, None] * b[s:e, None, :]
        u[0].addcmul_(decay[0], h)
        k, q = 1, e - s
        while k < q:
            nxt = torch.empty_like(u)
            nxt[:k] = u[:k]
            torch.addcmul(u[k:], decay[k:], u[:-k], out=nxt[k:])
            u = nxt
            if 2 * k < q:  # (the last pass needs no decays after it)
                spans = torch.empty_like(decay)
                spans[:k] = decay[:k]
                torch.mul(decay[k:], decay[:-k], out=spans[k:])
                decay = spans
            k *= 2
        ys.append(torch.bmm(u, c[s:e, :, None]).squeeze(-1))
        h = u[-1]
    return torch.cat(ys), h.clone()
