"""The causal depthwise convolution that Mamba-2 and gated DeltaNet layers run before
their recurrences, each sequence's last ``kernel - 1`` inputs carried in its state
slot (``worker.mamba_state``) between steps.

One-token rows (decodes) run as one batch: gather their windows, one multiply-add,
scatter the shifted windows back. A longer row (a prompt, a prefill chunk) runs on
its own, its slot's inputs prepended, so a prompt split into prefill chunks gives
what it gives whole. Both return the convolution before its activation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_mamba


def conv_decode(x: torch.Tensor, conv: torch.Tensor, slots: torch.Tensor,
                weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One input ``x[n, C]`` for each of ``len(slots)`` sequences: ``[n, C]``; the slots
    of ``conv [S, C, kernel - 1]`` shifted by one input in place (on CPU in one native
    pass: ``kernels.cpu_mamba.conv_update``)."""
    if cpu_mamba.conv_available(x, conv, weight, bias):
        return cpu_mamba.conv_update(x, conv, slots, weight, bias)
    window = torch.cat([conv.index_select(0, slots), x.unsqueeze(-1).to(conv.dtype)],
                       dim=-1)  # [n, C, kernel]
    conv.index_copy_(0, slots, window[:, :, 1:])
    h = (window * weight).sum(-1)
    return h if bias is None else h + bias


def conv_prefill(x: torch.Tensor, conv: torch.Tensor, slot: int, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """``L`` inputs ``x[L, C]`` of one sequence after its slot's: ``[L, C]``; the slot
    left holding the last ``kernel - 1`` inputs."""
    keep = weight.shape[-1] - 1
    full = torch.cat([conv[slot], x.t().to(conv.dtype)], dim=-1)  # [C, keep + L]
    conv[slot].copy_(full[:, full.shape[1] - keep:])
    return F.conv1d(full.unsqueeze(0), weight.unsqueeze(1), bias,
                    groups=weight.shape[0])[0].t()
