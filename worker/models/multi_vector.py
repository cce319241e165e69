"""The per-token heads of the multi-vector encoders (``multi_vector_config``).

Each is a linear map of every token's final state, run in fp32 like the other
pooling heads: ColBERT's ``linear`` (no bias) and BGE-M3's ``colbert_linear`` give
a token's late-interaction vector (the engine makes it unit length), BGE-M3's
``sparse_linear`` then a ReLU a token's lexical weight. A head is picked by the
request's task (``pool_hidden``); it maps each row on its own, so a chunk of a
prompt maps as the whole would. The whole head sits on every rank: it is small,
and only rank 0 pools.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.worker.multi_vector_config import MultiVectorConfig


class TokenProjection(nn.Module):
    """``[relu](x @ weight.T [+ bias])`` over rows ``[n, hidden]``."""

    def __init__(self, rows: int, hidden: int, bias: bool, relu: bool, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows, hidden, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(rows, dtype=dtype, device=device),
                                 requires_grad=False) if bias else None
        self.relu = relu

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        out = F.linear(rows.float(), self.weight.float(),
                       None if self.bias is None else self.bias.float())
        return torch.relu(out) if self.relu else out


def task_heads(mv: MultiVectorConfig, hidden: int, dtype: torch.dtype, device: torch.device
               ) -> dict[str, TokenProjection]:
    """The heads by the task they answer."""
    if mv.kind == "colbert":
        return {"token_embed": TokenProjection(mv.dim, hidden, False, False, dtype, device)}
    return {"token_embed": TokenProjection(mv.dim, hidden, True, False, dtype, device),
            "token_classify": TokenProjection(1, hidden, True, True, dtype, device)}


# Another name some ColBERT files give their projection.
COLBERT_ALIASES = {"colbert_linear.weight": "linear.weight"}


def head_tensor_names(mv: MultiVectorConfig, heads: nn.ModuleDict
                      ) -> dict[str, torch.Tensor]:
    """The checkpoint's names (after the encoder's prefix is taken off) of the heads'
    tensors: ColBERT's ``linear.weight`` (``COLBERT_ALIASES`` maps the other name
    onto it), BGE-M3's side files' ``colbert_linear.*`` and ``sparse_linear.*``."""
    embed = heads["token_embed"]
    if mv.kind == "colbert":
        return {"linear.weight": embed.weight}
    sparse = heads["token_classify"]
    return {"colbert_linear.weight": embed.weight, "colbert_linear.bias": embed.bias,
            "sparse_linear.weight": sparse.weight, "sparse_linear.bias": sparse.bias}
