"""The Mamba-2 mixer over a flat, mixed batch, each sequence's state in its slot.

Per token the mixer projects the input to a gate z, the convolution's input (x, B
and C) and a step size dt per head; runs a causal depthwise convolution over the
sequence (its last ``d_conv - 1`` inputs carried in the state), then the selective
scan ``h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t``, ``y_t = C_t h_t + D x_t``, and a
gated RMSNorm (``y * silu(z)``, normalised per group) before the output
projection: transformers' ``GraniteMoeHybridMambaLayer`` (its torch path), which
the tests hold this to.

One-token rows (decodes) run as one batch: a gather of their states, one update,
a scatter back. Longer rows (prompts, prefill chunks) run one sequence at a time
through the chunked scan of state-space duality (SSD): within a chunk of
``chunk_size`` tokens the scan is a masked, decayed ``C B^T`` matmul (attention-like),
between chunks a recurrence over chunk states, starting from the slot's state, so
a prompt split into prefill chunks gives what it gives whole. No loop runs per token.

Tensor parallelism splits heads and groups: each rank projects its heads' z, x and
dt and its groups' B and C, convolves and scans them, normalises its whole groups
and the row-parallel output projection sums the ranks. That needs ``num_groups``
divisible by the TP size (Granite 4.0-H has one group: TP 1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels import cpu_mamba
from pagedserve.worker.layers.causal_conv import conv_decode, conv_prefill
from pagedserve.worker.layers.linear import (
    LazyTensor,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from pagedserve.worker.layers.mixer_params import check_shape, frozen_param, rank_share
from pagedserve.worker.mamba_config import MambaConfig
from pagedserve.worker.mamba_state import MambaStep
from pagedserve.worker.models.fused_weights import split_rows
from pagedserve.worker.parallel import ParallelContext


class Mamba2Mixer(nn.Module):
    """A Mamba-2 layer's mixer; ``state_index`` is its place among this rank's Mamba
    layers (the slot tensors it reads in a ``MambaStep``)."""

    def __init__(self, hidden: int, mc: MambaConfig, eps: float, ctx: ParallelContext,
                 dtype: torch.dtype, device: torch.device, state_index: int) -> None:
        super().__init__()
        tp = ctx.world_size
        if mc.num_groups % tp:
            raise ValueError(f"model config field 'mamba_n_groups' ({mc.num_groups}) must be "
                             f"divisible by tensor_parallel_size ({tp}): a Mamba-2 layer "
                             "splits its groups across ranks")
        self.mc, self.eps, self.rank, self.state_index = mc, eps, ctx.rank, state_index
        self.heads, self.groups = mc.num_heads // tp, mc.num_groups // tp
        self.inter = self.heads * mc.head_dim
        self.bc = self.groups * mc.d_state
        self.conv_dim = self.inter + 2 * self.bc
        gn = mc.num_groups * mc.d_state
        self.in_proj = MergedColumnParallelLinear(
            hidden, [mc.intermediate, mc.intermediate, gn, gn, mc.num_heads], ctx, dtype,
            device, bias=mc.proj_bias)
        self.conv_weight = frozen_param((self.conv_dim, mc.d_conv), dtype, device)
        self.conv_bias = frozen_param((self.conv_dim,), dtype, device) if mc.conv_bias else None
        self.dt_bias = frozen_param((self.heads,), torch.float32, device)
        self.A_log = frozen_param((self.heads,), torch.float32, device)
        self.D = frozen_param((self.heads,), torch.float32, device)
        self.norm_weight = frozen_param((self.inter,), dtype, device)  # (unread: gate_only)
        self.out_proj = RowParallelLinear(mc.intermediate, hidden, mc.proj_bias, ctx, dtype,
                                          device)

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """One sequence's slot on this rank: the convolution's last inputs ``[conv_dim,
        d_conv - 1]`` and the SSM state ``[heads, head_dim, d_state]``."""
        return (self.conv_dim, self.mc.d_conv - 1), (self.heads, self.mc.head_dim,
                                                     self.mc.d_state)

    # ---- loading -------------------------------------------------------------------------

    def checkpoint_names(self) -> set[str]:
        """Its tensors, as named under the layer's ``mamba.``."""
        names = {"in_proj.weight", "conv1d.weight", "dt_bias", "A_log", "D", "out_proj.weight"}
        if self.mc.gate_norm != "gate_only":
            names.add("norm.weight")
        if self.mc.conv_bias:
            names.add("conv1d.bias")
        if self.mc.proj_bias:
            names |= {"in_proj.bias", "out_proj.bias"}
        return names

    def load(self, name: str, lazy: LazyTensor) -> bool:
        """Copy this rank's share of tensor ``name`` (under ``mamba.``); False if unknown."""
        mc = self.mc
        gn = mc.num_groups * mc.d_state
        if name in ("in_proj.weight", "in_proj.bias"):
            sizes = [mc.intermediate, mc.intermediate, gn, gn, mc.num_heads]
            for i, rows in enumerate(split_rows(lazy, sizes, name)):
                self.in_proj.load(i, rows, name.endswith("bias"))
        elif name in ("out_proj.weight", "out_proj.bias"):
            self.out_proj.load(lazy, name.endswith("bias"))
        elif name in ("conv1d.weight", "conv1d.bias") and (
                name == "conv1d.weight" or self.conv_bias is not None):
            full = (mc.conv_dim, 1, mc.d_conv) if name == "conv1d.weight" else (mc.conv_dim,)
            check_shape(name, lazy, full)
            t = lazy[:].reshape(mc.conv_dim, -1)
            x, b, c = torch.split(t, [mc.intermediate, gn, gn])
            mine = torch.cat([rank_share(x, self.inter, self.rank),
                              rank_share(b, self.bc, self.rank),
                              rank_share(c, self.bc, self.rank)])
            target = self.conv_weight if name == "conv1d.weight" else self.conv_bias
            target.data.copy_(mine.reshape(target.shape))
        elif name in ("dt_bias", "A_log", "D"):
            check_shape(name, lazy, (mc.num_heads,))
            getattr(self, name).data.copy_(rank_share(lazy[:], self.heads, self.rank))
        elif name == "norm.weight":
            check_shape(name, lazy, (mc.intermediate,))
            self.norm_weight.data.copy_(rank_share(lazy[:], self.inter, self.rank))
        else:
            return False
        return True

    # ---- forward -------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, step: MambaStep) -> torch.Tensor:
        """``[T, hidden]`` in, ``[T, hidden]`` out; the rows' slots updated in place."""
        t = x.shape[0]
        zxbcdt = self.in_proj(x)
        z, xbc, dt = zxbcdt.split([self.inter, self.conv_dim, self.heads], dim=-1)
        conv, ssm = step.conv[self.state_index], step.ssm[self.state_index]
        y = torch.empty(t, self.heads, self.mc.head_dim, dtype=torch.float32, device=x.device)
        for j, (rows, slots) in enumerate(step.batches):
            if rows is None:  # every row a single token, in order
                y.copy_(self._decode(xbc, dt, conv, ssm, slots))
            else:
                y[rows] = self._decode(xbc[rows], dt[rows], conv, ssm, slots)
            step.keep(self.state_index, j)
        for start, n, slot in step.multi:
            end = start + n
            y[start:end] = self._prefill(xbc[start:end], dt[start:end], conv, ssm, slot)
        out = gated_rms_norm(y.view(t, self.inter), z, self.norm_weight, self.groups,
                             self.eps, self.mc.gate_norm)
        return self.out_proj(out.to(x.dtype))

    def _discretize(self, h: torch.Tensor, dt: torch.Tensor
                    ) -> tuple[torch.Tensor, ...]:
        """From the convolution's activated output ``[n, conv_dim]`` and the raw ``dt``
        ``[n, heads]``: x ``[n, H, P]``, B and C ``[n, H, N]`` (each head its group's),
        dt after its bias, softplus and limits, and A, all fp32."""
        n, mc = h.shape[0], self.mc
        xs, b, c = h.float().split([self.inter, self.bc, self.bc], dim=-1)
        per = self.heads // self.groups
        b = b.view(n, self.groups, mc.d_state).repeat_interleave(per, dim=1)
        c = c.view(n, self.groups, mc.d_state).repeat_interleave(per, dim=1)
        dt = F.softplus(dt.float() + self.dt_bias).clamp(mc.dt_min, mc.dt_max)
        return xs.view(n, self.heads, mc.head_dim), b, c, dt, -torch.exp(self.A_log)

    def _decode(self, xbc: torch.Tensor, dt: torch.Tensor, conv: torch.Tensor,
                ssm: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One token for each of ``len(slots)`` sequences: ``[n, H, P]``."""
        h = conv_decode(xbc, conv, slots, self.conv_weight, self.conv_bias)
        xs, b, c, dt, a = self._discretize(F.silu(h), dt)
        n, heads, p = xs.shape
        if cpu_mamba.available(ssm):  # (in place in the slots, one pass)
            y = cpu_mamba.state_update(ssm, slots, torch.exp(dt * a), dt[..., None] * xs, b, c)
            return y + self.D[:, None] * xs
        # In place on the gathered copy: the state is the step's biggest tensor (heads x
        # head_dim x d_state a row), so each pass over it is what a decode step costs.
        state = ssm.index_select(0, slots)  # [n, H, P, N]
        state.mul_(torch.exp(dt * a)[..., None, None])
        flat = state.view(n * heads, p, -1)
        flat.baddbmm_((dt[..., None] * xs).view(n * heads, p, 1), b.reshape(n * heads, 1, -1))
        ssm.index_copy_(0, slots, state)
        y = torch.bmm(flat, c.reshape(n * heads, -1, 1)).view(n, heads, p)
        return y + self.D[:, None] * xs

    def _prefill(self, xbc: torch.Tensor, dt: torch.Tensor, conv: torch.Tensor,
                 ssm: torch.Tensor, slot: int) -> torch.Tensor:
        """``L > 1`` tokens of one sequence from its slot's state: ``[L, H, P]``."""
        h = conv_prefill(xbc, conv, slot, self.conv_weight, self.conv_bias)
        xs, b, c, dt, a = self._discretize(F.silu(h), dt)
        y, final = ssd_scan(xs, dt, a, b, c, self.mc.chunk_size, ssm[slot])
        ssm[slot].copy_(final)
        return y + self.D[:, None] * xs


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             c: torch.Tensor, chunk_size: int, h0: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The selective scan of one sequence, chunk by chunk (fp32 throughout).

    ``x [L, H, P]``, ``dt [L, H]`` (discretised), ``a [H]`` (negative), ``b`` and ``c
    [L, H, N]``, ``h0 [H, P, N]`` the state before the first token. Returns ``y [L, H,
    P]`` (without the ``D x`` skip) and the state after the last token. The tail pads
    with ``dt = 0``, which neither decays the state nor adds to it.
    """
    length, heads, p = x.shape
    q = min(chunk_size, length)
    nc = -(-length // q)
    pad = nc * q - length
    xdt = F.pad(x * dt[..., None], (0, 0, 0, 0, 0, pad)).view(nc, q, heads, p)
    acs = F.pad(dt * a, (0, 0, 0, pad)).view(nc, q, heads).cumsum(1)  # [c, l, h]
    b = F.pad(b, (0, 0, 0, 0, 0, pad)).view(nc, q, heads, -1)
    c = F.pad(c, (0, 0, 0, 0, 0, pad)).view(nc, q, heads, -1)
    causal = torch.ones(q, q, dtype=torch.bool, device=x.device).tril()[None, :, :, None]
    seg = (acs[:, :, None, :] - acs[:, None, :, :]).masked_fill(~causal, float("-inf"))
    scores = torch.einsum("clhn,cshn->clsh", c, b) * torch.exp(seg)
    y = torch.einsum("clsh,cshp->clhp", scores, xdt)
    decay = torch.exp(acs[:, -1:, :] - acs)  # [c, l, h]: from each token to its chunk's end
    chunk_states = torch.einsum("clhn,clhp->chpn", b * decay[..., None], xdt)
    through = torch.exp(acs[:, -1, :])  # [c, h]: a whole chunk's decay
    starts = []
    h = h0
    for k in range(nc):  # (a loop over chunks: tokens / chunk_size steps)
        starts.append(h)
        h = h * through[k][:, None, None] + chunk_states[k]
    y = y + torch.einsum("clhn,chpn->clhp", c, torch.stack(starts)) * torch.exp(acs)[..., None]
    return y.reshape(nc * q, heads, p)[:length], h


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, groups: int,
                   eps: float, order: str = "gate_then_norm") -> torch.Tensor:
    """``weight * rmsnorm(y * silu(z))`` with the statistics per group of channels, in
    fp32 (transformers' ``GraniteMoeHybridRMSNormGated``); fp32 out. ``order``
    "norm_then_gate" gates the normalised ``y`` instead, "gate_only" skips the norm
    (Falcon-H1's two other forms, ``MambaConfig.gate_norm``)."""
    n, width = y.shape
    gate = F.silu(z.float())
    if order == "gate_only":
        return y.float() * gate
    h = y.float() if order == "norm_then_gate" else y.float() * gate
    h = h.view(n, groups, width // groups)
    h = weight.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).view(n, width)
    return h * gate if order == "norm_then_gate" else h
