"""Vocab-parallel embedding and LM head.

The vocabulary is split into equal contiguous ranges (the last one padded), so
each rank holds ``ceil(V / world)`` rows. The embedding all-reduces partial
lookups; the LM head gathers partial logits on rank 0 only, because only rank
0 samples.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.worker.layers.linear import LazyTensor
from pagedserve.worker.layers.packed import PackableLinear
from pagedserve.worker.parallel import ParallelContext


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose rows are split across ranks by vocabulary range."""

    def __init__(self, vocab_size: int, hidden: int, ctx: ParallelContext,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.ctx = ctx
        self.vocab_size, self.hidden = vocab_size, hidden
        self.per_rank = -(-vocab_size // ctx.world_size)
        self.start = ctx.rank * self.per_rank
        self.end = min(self.start + self.per_rank, vocab_size)
        self.weight = nn.Parameter(
            torch.zeros(self.per_rank, hidden, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.ctx.world_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill_(outside, 0)
        out = F.embedding(local, self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.ctx.all_reduce(out)

    def load(self, lazy: LazyTensor) -> None:
        if tuple(lazy.shape) != (self.vocab_size, self.hidden):
            raise ValueError(f"embedding: checkpoint shape {tuple(lazy.shape)} != "
                             f"{(self.vocab_size, self.hidden)}")
        n = self.end - self.start
        if n > 0:
            self.weight.data[:n].copy_(lazy[self.start:self.end])


class ParallelLMHead(VocabParallelEmbedding, PackableLinear):
    """Vocab-parallel output projection; may share its weight with the embedding."""

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary logits on rank 0, None on the other ranks."""
        local = self.matmul(hidden)
        full = self.ctx.gather_last_dim(local)
        if full is None:
            return None
        if full.shape[-1] != self.vocab_size:
            full = full[..., : self.vocab_size]
        return full
