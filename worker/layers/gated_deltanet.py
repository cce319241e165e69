"""Qwen3-Next's gated DeltaNet layer over a flat, mixed batch, each sequence's state
in its slot (``worker.mamba_state``).

Per token the layer projects the input to q and k (per key head), v and a gate z
(per value head), and two numbers per value head: ``b`` (the write strength
``beta = sigmoid(b)``) and ``a`` (the decay ``g = -exp(A_log) * softplus(a +
dt_bias)``, in log space). q, k and v go through a causal depthwise convolution
and SiLU (``layers.causal_conv``), q and k are L2-normalised (q then scaled by
``1 / sqrt(key dim)``), and each value head's ``[key dim, value dim]`` matrix S is
decayed and rewritten by the delta rule before it is read:

    S = exp(g) S;   S += k (beta (v - k^T S))^T;   o = q^T S

The output, per value head, is RMS-normalised and gated by ``silu(z)`` before the
output projection: transformers' ``Qwen3NextGatedDeltaNet`` (its torch path),
which the tests hold this to.

One-token rows (decodes) run that update batched over their slots. Longer rows
(prompts, prefill chunks) run one sequence at a time through the chunked form
(``chunk_gated_delta_rule``): within a chunk the updates are folded into two
triangular solves and masked, decayed matmuls; between chunks a loop carries S,
starting from the slot's, so a prompt split into prefill chunks gives what it
gives whole.

Tensor parallelism splits key heads (with their value heads): Qwen3-Next's
projections are laid out key head by key head, so a rank's rows are one contiguous
block of each; Qwen3.5's unfused ones give each rank its block of every part.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels import cpu_deltanet
from pagedserve.worker.deltanet_config import DeltaNetConfig
from pagedserve.worker.layers.causal_conv import conv_decode, conv_prefill
from pagedserve.worker.layers.linear import (
    ColumnParallelLinear,
    LazyTensor,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from pagedserve.worker.layers.mixer_params import check_shape, frozen_param, rank_share
from pagedserve.worker.mamba_state import MambaStep
from pagedserve.worker.models.fused_weights import split_rows
from pagedserve.worker.parallel import ParallelContext

CHUNK = 64  # (transformers' and the fla kernels' chunk)


class GatedDeltaNet(nn.Module):
    """One gated DeltaNet layer; ``state_index`` is its place among this rank's
    recurrent layers (the slot tensors it reads in a ``MambaStep``)."""

    def __init__(self, hidden: int, dc: DeltaNetConfig, eps: float, ctx: ParallelContext,
                 dtype: torch.dtype, device: torch.device, state_index: int = 0) -> None:
        super().__init__()
        tp = ctx.world_size
        if dc.num_k_heads % tp:
            raise ValueError(f"model config field 'linear_num_key_heads' ({dc.num_k_heads}) "
                             f"must be divisible by tensor_parallel_size ({tp}): a gated "
                             "DeltaNet layer splits its key heads across ranks")
        self.dc, self.eps, self.rank, self.state_index = dc, eps, ctx.rank, state_index
        self.k_heads, self.v_heads = dc.num_k_heads // tp, dc.num_v_heads // tp
        self.key_dim = self.k_heads * dc.head_k_dim
        self.value_dim = self.v_heads * dc.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkvz: ColumnParallelLinear | MergedColumnParallelLinear
        self.in_proj_ba: ColumnParallelLinear | MergedColumnParallelLinear
        if dc.split_proj:  # (Qwen3.5: q | k | v | z and b | a, each part split by rank)
            self.in_proj_qkvz = MergedColumnParallelLinear(
                hidden, [dc.key_dim, dc.key_dim, dc.value_dim, dc.value_dim], ctx, dtype,
                device)
            self.in_proj_ba = MergedColumnParallelLinear(
                hidden, [dc.num_v_heads, dc.num_v_heads], ctx, dtype, device)
        else:  # (Qwen3-Next: key head by key head, [q k v z] and [b a] each)
            per_k = 2 * dc.head_k_dim + 2 * dc.v_per_k * dc.head_v_dim
            self.in_proj_qkvz = ColumnParallelLinear(hidden, dc.num_k_heads * per_k, False,
                                                     ctx, dtype, device)
            self.in_proj_ba = ColumnParallelLinear(hidden, 2 * dc.num_v_heads, False, ctx,
                                                   dtype, device)
        self.conv_weight = frozen_param((self.conv_dim, dc.d_conv), dtype, device)
        self.dt_bias = frozen_param((self.v_heads,), torch.float32, device)
        self.A_log = frozen_param((self.v_heads,), torch.float32, device)
        self.norm_weight = frozen_param((dc.head_v_dim,), dtype, device)
        self.out_proj = RowParallelLinear(dc.value_dim, hidden, False, ctx, dtype, device)

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """One sequence's slot on this rank: the convolution's last inputs ``[conv_dim,
        kernel - 1]`` and the delta rule's matrices ``[value heads, key dim, value dim]``."""
        dc = self.dc
        return (self.conv_dim, dc.d_conv - 1), (self.v_heads, dc.head_k_dim, dc.head_v_dim)

    # ---- loading -------------------------------------------------------------------------

    def checkpoint_names(self) -> set[str]:
        """Its tensors, as named under the layer's ``linear_attn.``."""
        proj = ({f"in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")} if self.dc.split_proj
                else {"in_proj_qkvz.weight", "in_proj_ba.weight"})
        return proj | {"conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight"}

    def load(self, name: str, lazy: LazyTensor) -> bool:
        """Copy this rank's share of tensor ``name`` (under ``linear_attn.``); False if
        unknown."""
        dc = self.dc
        if name in ("in_proj_qkvz.weight", "in_proj_ba.weight") and not dc.split_proj:
            getattr(self, name[:-7]).load(lazy)  # (a rank's key heads: contiguous rows)
        elif name == "in_proj_qkv.weight" and dc.split_proj:
            sizes = [dc.key_dim, dc.key_dim, dc.value_dim]
            for i, rows in enumerate(split_rows(lazy, sizes, name)):
                self.in_proj_qkvz.load(i, rows)
        elif name in ("in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight") \
                and dc.split_proj:
            part = name[8]
            target = self.in_proj_qkvz if part == "z" else self.in_proj_ba
            target.load({"z": 3, "b": 0, "a": 1}[part], lazy)
        elif name == "out_proj.weight":
            self.out_proj.load(lazy)
        elif name == "conv1d.weight":
            check_shape(name, lazy, (dc.conv_dim, 1, dc.d_conv))
            q, k, v = torch.split(lazy[:].reshape(dc.conv_dim, dc.d_conv),
                                  [dc.key_dim, dc.key_dim, dc.value_dim])
            self.conv_weight.data.copy_(torch.cat([
                rank_share(q, self.key_dim, self.rank), rank_share(k, self.key_dim, self.rank),
                rank_share(v, self.value_dim, self.rank)]))
        elif name in ("dt_bias", "A_log"):
            check_shape(name, lazy, (dc.num_v_heads,))
            getattr(self, name).data.copy_(rank_share(lazy[:], self.v_heads, self.rank))
        elif name == "norm.weight":
            check_shape(name, lazy, (dc.head_v_dim,))
            self.norm_weight.data.copy_(lazy[:])
        else:
            return False
        return True

    # ---- forward -------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, step: MambaStep) -> torch.Tensor:
        """``[T, hidden]`` in, ``[T, hidden]`` out; the rows' slots updated in place."""
        t, dc = x.shape[0], self.dc
        r, dk, dv = dc.v_per_k, dc.head_k_dim, dc.head_v_dim
        if dc.split_proj:
            q, k, v, z = self.in_proj_qkvz(x).split(
                [self.key_dim, self.key_dim, self.value_dim, self.value_dim], dim=-1)
            b, a = self.in_proj_ba(x).split([self.v_heads, self.v_heads], dim=-1)
        else:
            qkvz = self.in_proj_qkvz(x).view(t, self.k_heads, -1)
            q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)
            ba = self.in_proj_ba(x).view(t, self.k_heads, 2 * r)
            b, a = ba[..., :r], ba[..., r:]
        beta = torch.sigmoid(b.reshape(t, self.v_heads).float())
        g = -torch.exp(self.A_log) * F.softplus(a.reshape(t, self.v_heads).float()
                                               + self.dt_bias)
        qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        conv, state = step.conv[self.state_index], step.ssm[self.state_index]
        out = torch.empty(t, self.v_heads, dv, dtype=torch.float32, device=x.device)
        for j, (rows, slots) in enumerate(step.batches):
            if rows is None:  # every row a single token, in order
                out.copy_(self._decode(qkv, beta, g, conv, state, slots))
            else:
                out[rows] = self._decode(qkv[rows], beta[rows], g[rows], conv, state, slots)
            step.keep(self.state_index, j)
        for start, n, slot in step.multi:
            end = start + n
            out[start:end] = self._prefill(qkv[start:end], beta[start:end], g[start:end],
                                           conv, state, slot)
        y = gated_head_norm(out.to(x.dtype), z.reshape(t, self.v_heads, dv),
                            self.norm_weight, self.eps)
        return self.out_proj(y.reshape(t, self.value_dim))

    def _heads(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """From the activated convolution ``[n, conv_dim]``: q (normalised, scaled) and k
        (normalised) ``[n, value heads, key dim]``, each key head's repeated for its value
        heads, and v ``[n, value heads, value dim]``, fp32."""
        n, dc = h.shape[0], self.dc
        q, k, v = h.float().split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = _l2norm(q.view(n, self.k_heads, dc.head_k_dim)) * dc.head_k_dim ** -0.5
        k = _l2norm(k.view(n, self.k_heads, dc.head_k_dim))
        if dc.v_per_k > 1:
            q = q.repeat_interleave(dc.v_per_k, dim=1)
            k = k.repeat_interleave(dc.v_per_k, dim=1)
        return q, k, v.view(n, self.v_heads, dc.head_v_dim)

    def _decode(self, qkv: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
                conv: torch.Tensor, state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One token for each of ``len(slots)`` sequences: ``[n, value heads, value dim]``."""
        h = F.silu(conv_decode(qkv, conv, slots, self.conv_weight, None))
        q, k, v = self._heads(h)
        if cpu_deltanet.available(state):  # (in place in the slots, two cached passes)
            return cpu_deltanet.update(state, slots, torch.exp(g), beta, q, k, v)
        if state.is_cuda:  # (in place in the slots, one Triton program per tile)
            from pagedserve.kernels import triton_deltanet

            return triton_deltanet.decode(state, slots, torch.exp(g), beta, q, k, v)
        n, heads, dk = k.shape
        # In place on the gathered copy: the state is the step's biggest tensor.
        s = state.index_select(0, slots)  # [n, H, dk, dv]
        s.mul_(torch.exp(g)[..., None, None])
        flat = s.view(n * heads, dk, -1)
        kt = k.reshape(n * heads, 1, dk)
        delta = (v.reshape(n * heads, 1, -1) - torch.bmm(kt, flat)) \
            * beta.reshape(n * heads, 1, 1)
        flat.baddbmm_(kt.transpose(1, 2), delta)
        state.index_copy_(0, slots, s)
        return torch.bmm(q.reshape(n * heads, 1, dk), flat).view(n, heads, -1)

    def _prefill(self, qkv: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
                 conv: torch.Tensor, state: torch.Tensor, slot: int) -> torch.Tensor:
        """``L > 1`` tokens of one sequence from its slot's state: ``[L, value heads,
        value dim]``."""
        h = F.silu(conv_prefill(qkv, conv, slot, self.conv_weight, None))
        q, k, v = self._heads(h)
        out, final = chunk_gated_delta_rule(q, k, v, g, beta, state[slot])
        state[slot].copy_(final)
        return out


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           g: torch.Tensor, beta: torch.Tensor, s0: torch.Tensor,
                           chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence, ``chunk`` tokens at a time (fp32).

    ``q, k [L, H, dk]`` (normalised; q scaled), ``v [L, H, dv]``, ``g`` (log decay,
    <= 0) and ``beta [L, H]``, ``s0 [H, dk, dv]`` the state before the first token.
    Returns the outputs ``[L, H, dv]`` and the state after the last token. Within a
    chunk the token-by-token updates are one unit-lower-triangular system (the UT
    transform of DeltaNet), solved for the values each token actually writes and for
    how much of the chunk's starting state each one's key reads. The tail pads with
    ``k = v = beta = g = 0``, which neither reads nor writes.
    """
    length = k.shape[0]
    c = min(chunk, length)
    n = -(-length // c)
    pad = n * c - length
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))  # [H, L', d]
    g, beta = (F.pad(x.t(), (0, pad)) for x in (g, beta))  # [H, L']
    heads = k.shape[0]
    q, k, v = (x.reshape(heads, n, c, -1) for x in (q, k, v))
    beta = beta.view(heads, n, c, 1)
    g = g.view(heads, n, c).cumsum(-1)  # decay from each chunk's start, log space
    upper = torch.ones(c, c, dtype=torch.bool, device=k.device).triu(1)
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(upper, float("-inf")).exp()
    k_beta = k * beta
    system = (k_beta @ k.transpose(-1, -2)) * decay
    written = torch.linalg.solve_triangular(system, v * beta, upper=False, unitriangular=True)
    reads = torch.linalg.solve_triangular(system, k_beta * g.exp()[..., None], upper=False,
                                          unitriangular=True)
    inner = (q @ k.transpose(-1, -2)) * decay
    q = q * g.exp()[..., None]
    k = k * (g[..., -1:] - g).exp()[..., None]
    through = g[..., -1].exp()[..., None, None]  # [H, n, 1, 1]: a whole chunk's decay
    s = s0
    out = torch.empty_like(v)
    for i in range(n):  # (a loop over chunks only)
        new = written[:, i] - reads[:, i] @ s
        out[:, i] = q[:, i] @ s + inner[:, i] @ new
        s = s * through[:, i] + k[:, i].transpose(-1, -2) @ new
    return out.reshape(heads, n * c, -1)[:, :length].transpose(0, 1), s


def gated_head_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
                    ) -> torch.Tensor:
    """``weight * rmsnorm(y) * silu(z)`` per head (statistics over each head's values
    in fp32, the normalised values cast to ``y``'s dtype before the weight, as
    transformers' ``Qwen3NextRMSNormGated``); ``y``'s dtype out."""
    h = y.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(y.dtype)
    return (h * F.silu(z.float())).to(y.dtype)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(|x|^2 + eps)`` over the last dim (the fla kernels' form)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)
