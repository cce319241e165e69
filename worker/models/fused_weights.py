"""Checkpoints that store projections fused (Phi-3's ``qkv_proj`` and ``gate_up_proj``)
loaded into layers that take each part on its own.

A part is a block of the fused matrix's rows, read lazily: the layer asks for its own
rank's rows of the part, and only those rows are read from the file.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from pagedserve.worker.layers.linear import LazyTensor


class RowSlice:
    """Rows ``[start, stop)`` of a lazy checkpoint tensor, itself a ``LazyTensor``."""

    def __init__(self, lazy: LazyTensor, start: int, stop: int) -> None:
        if not 0 <= start <= stop <= lazy.shape[0]:
            raise ValueError(f"rows [{start}, {stop}) are outside a tensor of shape "
                             f"{tuple(lazy.shape)}")
        self.lazy, self.start, self.stop = lazy, start, stop

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.stop - self.start, *self.lazy.shape[1:])

    def __getitem__(self, idx: Any) -> torch.Tensor:
        first, rest = (idx[0], idx[1:]) if isinstance(idx, tuple) else (idx, ())
        if isinstance(first, slice) and first.step in (None, 1):
            a, b, _ = first.indices(self.shape[0])
            return self.lazy[(slice(self.start + a, self.start + max(a, b)), *rest)]
        return self.lazy[self.start:self.stop][idx]


def split_rows(lazy: LazyTensor, sizes: list[int], name: str) -> list[RowSlice]:
    """The consecutive row blocks of ``sizes`` that make up ``lazy`` (``ValueError``
    naming the tensor when they do not add up to its rows)."""
    if sum(sizes) != lazy.shape[0]:
        raise ValueError(f"{name}: checkpoint shape {tuple(lazy.shape)} does not hold "
                         f"{sizes} rows")
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    return [RowSlice(lazy, a, b) for a, b in itertools.pairwise(bounds)]


def neox_rows(lazy: LazyTensor, head_dim: int, rotary_dim: int) -> torch.Tensor:
    """A q or k projection (weight or bias) whose heads' rotary dims are rotated in
    interleaved pairs (GPT-J style: dims ``2i`` and ``2i + 1`` turn together, Ernie 4.5)
    reordered per head to the half-split layout our RoPE turns (``i`` with
    ``i + rotary_dim / 2``): evens first, then odds, the rest as they are. q and k get
    the same order, so their products, and the attention, are unchanged."""
    t = lazy[:]
    order = [*range(0, rotary_dim, 2), *range(1, rotary_dim, 2), *range(rotary_dim, head_dim)]
    heads = t.reshape(t.shape[0] // head_dim, head_dim, *t.shape[1:])
    return heads[:, order].reshape(t.shape)
