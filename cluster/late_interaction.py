"""Scoring two texts from their vectors: the dot product of two unit embeddings (a
bi-encoder's cosine similarity) or, for a multi-vector model such as ColBERT, late
interaction. MaxSim takes each query token's best dot product with any document
token and sums them: the query's every term must find its match somewhere in the
document, which one pooled vector cannot say. Shared by ``LLM.score`` and the HTTP
``/score`` and ``/rerank`` routes; pure torch, no Ray."""

from __future__ import annotations

from typing import Any

import torch


def late_interaction(model_info: dict[str, Any]) -> bool:
    """Whether the model scores by MaxSim over its token vectors (a ColBERT file)."""
    return bool((model_info.get("multi_vector") or {}).get("late_interaction"))


def pair_score(first: Any, second: Any) -> float:
    """The score of two texts' vectors: their dot product for one vector each, MaxSim
    for two matrices ``[tokens, dim]`` (``first`` is the query). fp64, so a score does
    not depend on how the sums are ordered."""
    a = torch.as_tensor(first, dtype=torch.float64)
    b = torch.as_tensor(second, dtype=torch.float64)
    if a.dim() == 1 and b.dim() == 1:
        return float(a @ b)
    if a.dim() != 2 or b.dim() != 2 or a.shape[-1] != b.shape[-1]:
        raise ValueError(f"MaxSim needs two [tokens, dim] matrices, got {tuple(a.shape)} "
                         f"and {tuple(b.shape)}")
    if not len(a) or not len(b):
        return 0.0
    return float((a @ b.T).amax(-1).sum())
