"""Pooling rows of embedding requests: their part of a step's final hidden states.

The runner hands over, per pooling row, what the engine needs to finish the
embedding later: the last token's state at the prompt's end ("last"), the first
token's ("cls", from the chunk at position 0), the
sum and count of this chunk's states ("mean", which a chunked prompt spreads
over several steps), or every state of the chunk (the token tasks' "all"); a
classifier's label head is applied to any of them. Sums are
fp32 whatever the model dtype. Only rank 0 computes them: the final hidden
states are the same on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
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
    task: str = "embed"  # (a multi-vector model picks its head by it)


def pool_hidden(hidden: torch.Tensor, jobs: list[PoolJob],
                head: Callable[[torch.Tensor], torch.Tensor] | None = None,
                task_heads: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] | None = None
                ) -> dict[str, tuple]:
    """``{request_id: ("last" | "cls" | "whole", vector) | ("mean", sum, count,
    position) | ("all", rows, position)}`` on the CPU ("cls" jobs are the chunks that
    start at position 0; "all" gives every row of the chunk).

    ``head`` (a classifier's ``ScoreHead``) maps each vector to label logits here, so
    only ``num_labels`` numbers a request leave the rank; a linear one (``head.linear``)
    takes a chunk's sum as it would the mean. An encoder's head is not linear, but its
    prompt is whole in one chunk: it gets the mean ("whole", a finished vector).
    ``task_heads`` (a multi-vector model's) replace ``head`` for the tasks they name:
    each maps every row of a token task on its own."""
    out: dict[str, tuple] = {}
    for j in jobs:
        if task_heads and j.task in task_heads:
            rows = task_heads[j.task](hidden[j.start:j.end])
            out[j.request_id] = ("all", rows.cpu(), j.position)
            continue
        if j.pooling in ("last", "cls"):
            v = hidden[j.end - 1 if j.pooling == "last" else j.start].float()
            out[j.request_id] = (j.pooling, (head(v) if head is not None else v).cpu())
        elif j.pooling == "splade":  # (an encoder's whole prompt: its sparse vector)
            out[j.request_id] = ("whole", head(hidden[j.start:j.end]).cpu())
        elif j.pooling == "all":  # (a head maps each row on its own)
            v = hidden[j.start:j.end].float()
            out[j.request_id] = ("all", (head(v) if head is not None else v).cpu(), j.position)
        elif head is not None and not getattr(head, "linear", True):
            if j.position != 0:
                raise RuntimeError(f"request {j.request_id}: a non-linear head pools a "
                                   "whole prompt, not a chunk")
            out[j.request_id] = ("whole", head(hidden[j.start:j.end].float().mean(0)).cpu())
        else:
            v = hidden[j.start:j.end].float().sum(0)
            out[j.request_id] = ("mean", (head(v) if head is not None else v).cpu(),
                                 j.end - j.start, j.position)
    return out
