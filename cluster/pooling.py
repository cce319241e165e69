"""Finishing embeddings: combine the runner's pooled parts of one request.

A "last"-pooled request gets one part, at its prompt's end. A "mean"-pooled
one gets a (sum, count) part per prefill chunk; a chunk starting at position
0 restarts the sum, since a request preempted by recompute runs its prompt
again from the start (mean pooling never starts from prefix-cache hits).
Then ``dimensions`` truncates (Matryoshka) and ``normalize`` scales to unit
L2 norm, as vLLM and OpenAI's ``dimensions`` do.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedserve.scheduler.pooling_params import PoolingParams


class PoolAccumulator:
    """The running pooled state of one embedding request."""

    def __init__(self, params: PoolingParams, hidden_size: int) -> None:
        if params.dimensions is not None and params.dimensions > hidden_size:
            raise ValueError(f"dimensions ({params.dimensions}) exceeds the model's hidden "
                             f"size ({hidden_size})")
        self.params = params
        self.total: torch.Tensor | None = None
        self.count = 0

    def add(self, part: Any) -> None:
        """Fold one runner part (see ``worker.pooling.pool_hidden``) in."""
        if part[0] == "last":
            self.total, self.count = part[1], 1
            return
        _, chunk_sum, n, position = part
        if position == 0 or self.total is None:
            self.total, self.count = chunk_sum.clone(), 0
        else:
            self.total += chunk_sum
        self.count += n

    def result(self) -> list[float]:
        """The embedding: mean (or last) state, truncated, then normalised if asked."""
        if self.total is None or self.count == 0:
            raise RuntimeError("embedding request finished without pooled hidden states")
        v = self.total / self.count
        if self.params.dimensions is not None:
            v = v[: self.params.dimensions]
        if self.params.normalize:
            v = torch.nn.functional.normalize(v, dim=0)
        return v.tolist()
