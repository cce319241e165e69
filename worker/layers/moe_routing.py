"""Which experts each token goes to, and with what weight.

Mixtral and Qwen take the top-k of the router's softmax. DeepSeek narrows the
choice first: the experts are cut into ``num_groups`` groups, each token keeps
the ``topk_group`` best groups (V2: by their best score; V3: by the sum of their
two best, counting the learnt per-expert bias) and takes its top-k among their
experts. V3 scores by a sigmoid and adds the bias only to the scores that
choose, never to the weights. Every variant is a few tensor ops over the whole
step's rows (no host sync), so a decode step stays graph-capturable.
"""

from __future__ import annotations

import torch

from pagedserve.worker.moe_config import MoEConfig


def route(logits: torch.Tensor, moe: MoEConfig, bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k] fp32, experts [T, k])`` from router ``logits [T, E]`` (fp32).

    ``bias`` ([E], V3's ``e_score_correction_bias``) shifts the choosing scores.
    """
    if moe.scoring == "sigmoid":
        scores = logits.float().sigmoid()
    else:
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    if not moe.grouped and bias is None:
        weights, experts = scores.topk(moe.top_k, dim=-1)
    else:
        choice = scores if bias is None else scores + bias.float()
        if moe.grouped:
            choice = _keep_best_groups(choice, moe)
        experts = choice.topk(moe.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
    if moe.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if moe.routed_scale != 1.0 and not (moe.renormalize and moe.scale_unnormalized_only):
        weights = weights * moe.routed_scale
    return weights, experts


def _keep_best_groups(choice: torch.Tensor, moe: MoEConfig) -> torch.Tensor:
    """``choice`` with every expert outside the token's ``topk_group`` best groups at
    -inf (so the top-k never picks one)."""
    t, e = choice.shape
    grouped = choice.view(t, moe.num_groups, e // moe.num_groups)
    if moe.group_rank == "top2":
        rank = grouped.topk(2, dim=-1).values.sum(dim=-1)
    else:
        rank = grouped.amax(dim=-1)
    best = rank.topk(moe.topk_group, dim=-1).indices
    keep = torch.zeros_like(rank, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, e)
