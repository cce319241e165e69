"""Pixel tensors that own their storage.

A preprocessor hands back one batched tensor; each picture's pixels are a view of
it. Pickled (into every Ray rank's step plan), a torch view carries its whole
storage, so N pictures shipped N times the batch's bytes. The inputs keep their
own copies instead, taken once when they are built.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


def own_storage(pixels: Any) -> Any:
    """``pixels`` (a tensor, or an ``AnyresPixels`` / ``VideoPixels`` holding one) with
    a storage of exactly its own bytes: copied where it is a view of something larger."""
    if isinstance(pixels, torch.Tensor):
        if pixels.untyped_storage().nbytes() > pixels.numel() * pixels.element_size():
            return pixels.clone()
        return pixels
    for name in ("crops", "frames"):
        inner = getattr(pixels, name, None)
        if isinstance(inner, torch.Tensor) and dataclasses.is_dataclass(pixels):
            return dataclasses.replace(pixels, **{name: own_storage(inner)})
    return pixels
