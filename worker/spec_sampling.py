"""Speculative sampling for drafts drawn from a distribution (a draft model's ``q``).

A guess ``d`` drawn from ``q`` survives with probability ``min(1, p(d) / q(d))``; at
the first rejection the token comes from the residual ``max(0, p - q)``,
normalised, and after ``k`` survivors from ``p`` at the next position. Every output
token then follows the target's ``p`` exactly (Leviathan et al., Chen et al.),
and a ``q`` close to ``p`` keeps nearly every guess at any temperature, where a
greedy guess survives only with ``p(argmax q)``.

``p`` is the target's distribution as the sampler draws from it: penalties, bias,
grammar masks and ``min_tokens`` applied, then temperature, ``min_p``, top-k and
top-p (:func:`sampling_ops.truncated_probs`). ``q`` is whatever the draft drew its
guesses from; the rule is exact for any ``q`` that gave each guess non-zero mass.
Uniforms are unseeded: a seeded request keeps greedy guesses and the sampler's
draw-and-match rule, which reproduces its tokens without drafts.
"""

from __future__ import annotations

import torch

from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker.sampling_ops import apply_min_p, inverse_cdf, truncated_probs


def target_probs(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The normalised distribution each row of processed logits ``x`` samples from,
    row ``i`` under ``params[i]``'s temperature, ``min_p``, top-k and top-p."""
    temps = torch.tensor([p.temperature for p in params], device=x.device)
    z = x.float() / temps[:, None]
    if any(p.min_p for p in params):
        z = apply_min_p(z, [p.min_p for p in params])
    probs = truncated_probs(z, [p.top_k for p in params], [p.top_p for p in params])
    return probs / probs.sum(dim=-1, keepdim=True)


def verify(p: torch.Tensor, q: torch.Tensor, drafts: list[int]) -> list[int]:
    """The kept guesses, then one token of the target's, for ``k = len(drafts)``
    guesses drawn from ``q`` (``[k, V]``) and the target's ``p`` (``[k + 1, V]``,
    position ``j`` given the guesses before it)."""
    k = len(drafts)
    if q.shape[0] < k or p.shape[0] != k + 1:
        raise ValueError(f"verify: {k} drafts need {k} draft rows and {k + 1} target rows, "
                         f"got {q.shape[0]} and {p.shape[0]}")
    dev = p.device
    if k:
        d = torch.tensor(drafts, device=dev)
        j = torch.arange(k, device=dev)
        ratio = p[j, d] / q[j, d].to(p.dtype).clamp_min(torch.finfo(p.dtype).tiny)
        rejected = (torch.rand(k, device=dev) >= ratio).nonzero()
        m = int(rejected[0, 0]) if rejected.numel() else k
    else:
        m = 0
    if m == k:
        last = p[k]
    else:
        last = (p[m] - q[m].to(p.dtype)).clamp_min(0.0)
        if not bool(last.sum() > 0):  # p <= q everywhere: only rounding rejected the guess
            last = p[m]
    token = inverse_cdf(last[None].clone(), torch.rand(1, device=dev), in_place=True)
    return [*drafts[:m], int(token[0])]


def draft_probs(logits: torch.Tensor, params: list[SamplingParams],
                vocab_size: int) -> torch.Tensor:
    """A draft's ``q`` for its rows of logits, each under its request's temperature and
    truncation (penalties and grammars are the target's to apply), widened with zeros
    to the target's ``vocab_size``."""
    q = target_probs(logits, params)
    if q.shape[-1] < vocab_size:
        q = torch.nn.functional.pad(q, (0, vocab_size - q.shape[-1]))
    return q
