"""A video as Qwen2-VL's encoder and M-RoPE take it: frames and each slice's time.

The video processor samples frames (``cluster.video``), resizes every frame to one
size, and groups them ``temporal_patch_size`` at a time: each group is one temporal
slice of ``rows x cols`` LLM tokens. Under M-RoPE slice ``k`` sits at temporal
position ``times[k]``: ``k`` for Qwen2-VL; for Qwen2.5-VL ``k`` times the seconds a
slice spans (``temporal_patch_size / fps``) times ``vision_config.tokens_per_second``,
truncated, as Hugging Face's ``get_vision_position_ids`` computes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class VideoPixels:
    """One video: ``frames`` ``[T, 3, H, W]`` (resized, normalised; ``T`` a multiple of
    the temporal patch size) and ``times``, each temporal slice's M-RoPE time."""

    frames: Any
    times: tuple[int, ...]

    def to(self, dtype: Any) -> VideoPixels:
        return VideoPixels(self.frames.to(dtype), self.times)


def slice_times(num_slices: int, seconds_per_slice: float | None,
                tokens_per_second: float) -> tuple[int, ...]:
    """Each slice's temporal position: ``0 .. n-1`` where time is not scaled (Qwen2-VL,
    ``seconds_per_slice`` None), else ``int(k * tokens_per_second * seconds_per_slice)``
    in float32, HF's ``(arange(t) * interval).long()`` with its float32 interval."""
    k = torch.arange(num_slices)
    if seconds_per_slice is None:
        return tuple(k.tolist())
    interval = tokens_per_second * torch.tensor(seconds_per_slice, dtype=torch.float32)
    return tuple((k * interval).long().tolist())
