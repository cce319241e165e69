"""Pooling rows of embedding requests: their part of a step's final hidden states.

The runner hands over, per pooling row, what the engine needs to finish the
embedding later: the last token's state at the prompt's end ("last"), or the
sum and count of this chunk's states ("mean", which a chunked prompt spreads
over several steps). Sums are fp32 whatever the model dtype. Only rank 0
computes them: the final hidden states are the same on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PoolJob:
    """Rows ``[start, end)`` of the step's hidden states belong to ``request_id``, whose
    chunk begins at prompt position ``position``."""

    request_id: str
    start: int
    end: int
    pooling: str
    position: int


def pool_hidden(hidden: torch.Tensor, jobs: list[PoolJob]) -> dict[str, tuple]:
    """``{request_id: ("last", vector) | ("mean", sum, count, position)}`` on the CPU."""
    out: dict[str, tuple] = {}
    for j in jobs:
        if j.pooling == "last":
            out[j.request_id] = ("last", hidden[j.end - 1].float().cpu())
        else:
            rows = hidden[j.start:j.end].float()
            out[j.request_id] = ("mean", rows.sum(0).cpu(), j.end - j.start, j.position)
    return out
