"""Rotary position embedding (NeoX / Hugging Face "rotate half" layout).

Supports the default schedule plus ``linear`` and ``llama3`` scaling, with the
same inverse-frequency formulas as transformers, so positions far past the
original context give identical angles. cos/sin are computed once per forward
for the batch's positions instead of caching a ``max_position`` table: that is
a few thousand ``cos`` calls, and it works for any position.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def compute_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim/2]`` (float32), scaled as transformers does."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv
    kind = scaling["rope_type"]
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv / factor
    if kind == "llama3":
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv
        inv_l = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, inv_l)
    raise ValueError(f"unsupported rope_type {kind!r}")


class RotaryEmbedding:
    """Holds the inverse frequencies; ``cos_sin`` then ``apply`` per forward."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None,
                 device: torch.device):
        self.head_dim = head_dim
        self.inv_freq = compute_inv_freq(head_dim, theta, scaling).to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, 1, D/2]`` cos and sin for ``positions`` (angles in fp32, then cast)."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        return freqs.cos().to(dtype).unsqueeze(1), freqs.sin().to(dtype).unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x[T, H, D]``: ``x*cos + rotate_half(x)*sin`` without building rotate_half."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
