"""Parameter helpers the recurrent mixers (``layers.mamba2``, ``layers.gated_deltanet``)
share: their small per-head tensors are plain parameters, each rank holding a
contiguous share, and a file's tensor of the wrong shape fails naming itself."""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.worker.layers.linear import LazyTensor


def frozen_param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
                 ) -> nn.Parameter:
    """A zeroed inference-only parameter (loading fills it)."""
    return nn.Parameter(torch.zeros(shape, dtype=dtype, device=device), requires_grad=False)


def rank_share(t: torch.Tensor, n: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s ``n`` leading-dim rows of ``t``."""
    return t[rank * n:(rank + 1) * n]


def check_shape(name: str, lazy: LazyTensor, shape: tuple[int, ...]) -> None:
    """A ``ValueError`` naming tensor ``name`` when the file's shape is not ``shape``."""
    if tuple(lazy.shape) != shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(lazy.shape)} != {shape}")
