"""Rotary position embedding (NeoX / Hugging Face "rotate half" layout).

Supports the default schedule plus ``linear``, ``llama3`` and ``yarn`` scaling,
with the same inverse-frequency formulas as transformers, so positions far past
the original context give identical angles, and ``freq_factors`` (llama.cpp's
per-frequency divisors, kept from GGUF files). YaRN also scales cos and sin by
its attention factor (the paper's temperature), as transformers does; so does
LongRoPE, whose tokens turn by its short or its long factors: the scheduler says
which rows run long (``scheduler.long_rope``) and the model runner marks their
positions (:func:`mark_long_rope`). A
``rotary_dim`` below the head size turns only the head's first dimensions
(``partial_rotary_factor``). cos/sin
are computed once per forward for the batch's positions instead of caching a
``max_position`` table: that is a few thousand ``cos`` calls, and it works for
any position.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from pagedserve.kernels import cpu_fused

# Added to a position whose token turns by LongRoPE's long factors: far past any real
# position, so the positions tensor carries the choice (CUDA graphs included).
LONG_ROPE_MARK = 1 << 40


def compute_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim/2]`` (float32), scaled as transformers does."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv
    kind = scaling["rope_type"]
    if kind == "freq_factors":  # llama.cpp's rope_freqs: each frequency divided by its own
        return inv / torch.tensor(scaling["freq_factors"], dtype=torch.float32)
    if kind == "longrope":  # the short factors; RotaryEmbedding keeps the long ones too
        return longrope_inv_freq(head_dim, theta, scaling["short_factor"])
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
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, factor, scaling)
    raise ValueError(f"unsupported rope_type {kind!r}")


def longrope_inv_freq(dim: int, theta: float, factors: list[float]) -> torch.Tensor:
    """LongRoPE's ``1 / (factor_i * theta^(2i/dim))``, in transformers' order of operations."""
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta ** shape)


def _yarn_inv_freq(head_dim: int, theta: float, factor: float,
                   scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN: dimensions rotating fast within the original context keep their
    frequency, slow ones are interpolated by ``factor``, with a linear ramp between."""
    old_len = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def dim_for(rotations: float) -> float:  # the dimension that turns `rotations` times
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_for(beta_fast), dim_for(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (original frequency), 0: interpolate
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by: 1, except YaRN's ``0.1 ln(factor) + 1`` and
    LongRoPE's (``rope_config`` sets it)."""
    if scaling and scaling["rope_type"] == "longrope":
        return float(scaling["attention_factor"])
    if not scaling or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
    return mscale(factor)


class RotaryEmbedding:
    """Holds the inverse frequencies; ``cos_sin`` then ``apply`` per forward."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None,
                 device: torch.device, rotary_dim: int = 0,
                 mrope_section: tuple[int, ...] = ()):
        self.head_dim = head_dim
        self.mrope_section = tuple(mrope_section)
        rd = rotary_dim or head_dim
        self.inv_freq = compute_inv_freq(rd, theta, scaling).to(device)
        self.inv_freq_long: torch.Tensor | None = None
        if scaling and scaling["rope_type"] == "longrope":
            self.inv_freq_long = longrope_inv_freq(rd, theta, scaling["long_factor"]).to(device)
        self.scale = attention_factor(scaling)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, 1, rotary_dim/2]`` cos and sin for ``positions`` (angles in fp32, then
        cast); under LongRoPE a position marked by :func:`mark_long_rope` turns by the
        long factors. Under M-RoPE ``positions`` may be ``[3, T]`` (temporal, row,
        column): frequency section ``i`` of ``mrope_section`` turns by row ``i`` of it,
        as Hugging Face's ``Qwen2VLRotaryEmbedding`` recomposes them."""
        if positions.dim() == 2:
            if not self.mrope_section:
                raise ValueError("[3, T] positions need a model with mrope_section")
            per_axis = positions.float().unsqueeze(-1) * self.inv_freq  # [3, T, D/2]
            parts = per_axis.split(list(self.mrope_section), dim=-1)
            freqs = torch.cat([p[i % 3] for i, p in enumerate(parts)], dim=-1)
        elif self.inv_freq_long is not None:
            long = positions >= LONG_ROPE_MARK
            positions = positions - long * LONG_ROPE_MARK
            inv = torch.where(long.unsqueeze(-1), self.inv_freq_long, self.inv_freq)
            freqs = positions.float().unsqueeze(-1) * inv
        else:
            freqs = positions.float().unsqueeze(-1) * self.inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x[T, H, D]``: ``x*cos + rotate_half(x)*sin`` without building rotate_half.

        Returns a new contiguous tensor; on CPU fp32 one native pass does it.
        """
        if 2 * cos.shape[-1] < x.shape[-1]:  # partial: the first rotary_dim dims turn
            rd = 2 * cos.shape[-1]
            turned = RotaryEmbedding.apply(x[..., :rd].contiguous(), cos, sin)
            return torch.cat((turned, x[..., rd:]), dim=-1)
        fused = cpu_fused.rope(x, cos, sin)
        if fused is not None:
            return fused
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def mark_long_rope(positions: torch.Tensor, seq_idx: torch.Tensor,
                   long_rows: list[bool]) -> torch.Tensor:
    """``positions`` with :data:`LONG_ROPE_MARK` added to the tokens of ``long_rows``
    (``seq_idx``: each token's row), which turn by LongRoPE's long factors."""
    long = torch.tensor(long_rows, dtype=torch.bool)[seq_idx]
    return positions + long.long() * LONG_ROPE_MARK
