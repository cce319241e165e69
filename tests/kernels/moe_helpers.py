"""The reference both MoE kernel tests check against: Hugging Face's loop over experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def expert_loop(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
                w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Experts in ascending order, each over the rows that chose it, ``index_add_`` into
    zeros; ``w13 [E, 2I, H]`` (gate rows, then up rows), ``w2 [E, H, I]``."""
    i = w2.shape[2]
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        tok, j = torch.where(chosen == e)
        if len(tok):
            gu = F.linear(x[tok], w13[e])
            out.index_add_(0, tok, F.linear(F.silu(gu[:, :i]) * gu[:, i:], w2[e])
                           * weights[tok, j, None])
    return out


def gpt_oss_expert_loop(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
                        w13: torch.Tensor, w2: torch.Tensor, b13: torch.Tensor,
                        b2: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's experts the same way: biased projections, the clamped SwiGLU."""
    i = w2.shape[2]
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        tok, j = torch.where(chosen == e)
        if len(tok):
            gu = F.linear(x[tok], w13[e], b13[e])
            gate, up = gu[:, :i].clamp(max=limit), gu[:, i:].clamp(-limit, limit)
            h = (up + 1) * gate * torch.sigmoid(alpha * gate)
            out.index_add_(0, tok, F.linear(h, w2[e], b2[e]) * weights[tok, j, None])
    return out
