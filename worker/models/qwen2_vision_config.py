"""Qwen2-VL's and Qwen2.5-VL's vision tower shape and pixel layout, read from config.json.

``Qwen2VisionConfig`` is the tower's shape, validated with the HF field named;
``image_grid``, ``patches_to_images`` and ``_patchify`` are the image processor's
patch order (each ``spatial_merge_size``-square block of patches contiguous, the still
image repeated ``temporal_patch_size`` times), kept apart from the tower so the image
processor side imports no model code.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedserve.worker.models.vit import ACTIVATIONS, positive_int

ACTIVATIONS_QWEN = {**ACTIVATIONS, "silu": F.silu}
_FAMILIES = ("qwen2_vl", "qwen2_5_vl")


@dataclass(frozen=True)
class Qwen2VisionConfig:
    """The tower's shape, validated; errors name the HF config field at fault.
    ``window_size`` is 0 for Qwen2-VL, whose every layer attends to the whole image."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    hidden_act: str
    rope_theta: float
    out_hidden_size: int
    window_size: int
    fullatt_blocks: tuple[int, ...]

    def __post_init__(self) -> None:
        width = "hidden_size" if self.windowed else "embed_dim"
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision_config.num_heads ({self.num_heads}) does not divide "
                             f"vision_config.{width} ({self.hidden_size})")
        if self.head_dim % 4:
            raise ValueError(f"vision_config.{width} / num_heads ({self.head_dim}) is not a "
                             "multiple of 4, which the 2-D rotary embedding needs")
        if self.hidden_act not in ACTIVATIONS_QWEN:
            raise ValueError(f"vision_config.hidden_act {self.hidden_act!r} is not one of "
                             f"{sorted(ACTIVATIONS_QWEN)}")
        if self.windowed and self.window_size < self.patch_size * self.merge_size:
            raise ValueError(f"vision_config.window_size ({self.window_size}) is smaller than "
                             f"patch_size * spatial_merge_size ({self.patch_size * self.merge_size})")
        if any(not 0 <= i < self.num_layers for i in self.fullatt_blocks):
            raise ValueError(f"vision_config.fullatt_block_indexes {list(self.fullatt_blocks)} "
                             f"are not all indices into the {self.num_layers} blocks")

    @property
    def windowed(self) -> bool:
        return self.model_type == "qwen2_5_vl"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merger_window(self) -> int:
        """A window's side in merged (LLM) tokens, as HF rounds it."""
        return self.window_size // self.merge_size // self.patch_size

    @classmethod
    def from_hf(cls, hf_config: dict) -> Qwen2VisionConfig:
        """Read a ``qwen2_vl`` / ``qwen2_5_vl`` config.json dict. Released files list only
        the fields that differ from the config classes' defaults, so those fill in the rest.
        The merger's width is what HF builds it with (Qwen2-VL: ``vision_config.hidden_size``,
        Qwen2.5-VL: ``out_hidden_size``); it must equal the text model's hidden size where
        the file gives one (top level in older flat saves, ``text_config`` in newer)."""
        from transformers import Qwen2_5_VLVisionConfig, Qwen2VLVisionConfig

        model_type = hf_config.get("model_type")
        if model_type not in _FAMILIES:
            raise ValueError(f"model_type {model_type!r} is not one of {list(_FAMILIES)}")
        raw = hf_config.get("vision_config")
        if not isinstance(raw, dict):
            raise ValueError("vision_config is missing or not a dict")
        if raw.get("model_type", model_type) not in (model_type, f"{model_type}_vision"):
            raise ValueError(f"vision_config.model_type {raw['model_type']!r} is not "
                             f"'{model_type}_vision'")
        windowed = model_type == "qwen2_5_vl"
        defaults = (Qwen2_5_VLVisionConfig if windowed else Qwen2VLVisionConfig)().to_dict()
        vision = {**defaults, **raw}
        pos = functools.partial(positive_int, vision, where="vision_config")
        if windowed:
            hidden, inter = pos("hidden_size"), pos("intermediate_size")
            out, window = pos("out_hidden_size"), pos("window_size")
            full = vision["fullatt_block_indexes"]
            if not isinstance(full, list | tuple) or any(
                    isinstance(i, bool) or not isinstance(i, int) for i in full):
                raise ValueError(f"vision_config.fullatt_block_indexes {full!r} is not a "
                                 "list of ints")
        else:
            hidden, out, window, full = pos("embed_dim"), pos("hidden_size"), 0, ()
            inter = int(hidden * _positive_number(vision["mlp_ratio"], "mlp_ratio"))  # HF's
        text = hf_config.get("text_config")
        top = text if isinstance(text, dict) and "hidden_size" in text else hf_config
        if "hidden_size" in top:
            where = "text_config" if top is text else ""
            text_hidden = positive_int(top, "hidden_size", where)
            if text_hidden != out:
                field = "out_hidden_size" if windowed else "hidden_size"
                raise ValueError(f"vision_config.{field} ({out}), the merger's width, != the "
                                 f"text model's {where + '.' if where else ''}hidden_size "
                                 f"({text_hidden})")
        return cls(model_type=model_type, hidden_size=hidden, intermediate_size=inter,
                   num_layers=pos("depth"), num_heads=pos("num_heads"),
                   num_channels=pos("in_channels"), patch_size=pos("patch_size"),
                   temporal_patch_size=pos("temporal_patch_size"),
                   merge_size=pos("spatial_merge_size"), hidden_act=str(vision["hidden_act"]),
                   rope_theta=_rope_theta(raw), out_hidden_size=out, window_size=window,
                   fullatt_blocks=tuple(full))


def _rope_theta(raw: dict) -> float:
    """HF's order: ``rope_parameters.rope_theta``, then a bare ``rope_theta``, then 10000."""
    rope = raw.get("rope_parameters") or {}
    if not isinstance(rope, dict) or rope.get("rope_type", "axial") not in ("axial", "default"):
        raise ValueError(f"vision_config.rope_parameters {rope!r} is not an axial RoPE dict")
    return _positive_number(rope.get("rope_theta", raw.get("rope_theta", 10000.0)), "rope_theta")


def _positive_number(value: object, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"vision_config.{key} {value!r} is not a positive number")
    return float(value)


def image_grid(height: int, width: int, patch_size: int, merge_size: int) -> tuple[int, int]:
    """(rows, cols) of LLM tokens for a resized image of that size: ``(H/P/m, W/P/m)``; the
    engine sizes an image's placeholder run from it. ValueError if a side is not a positive
    multiple of ``P*m`` (the processor always resizes to one)."""
    unit = patch_size * merge_size
    if height <= 0 or width <= 0 or height % unit or width % unit:
        raise ValueError(f"image size {height}x{width} is not a positive multiple of "
                         f"patch_size * spatial_merge_size ({unit})")
    return height // unit, width // unit


def patchify(image: torch.Tensor, patch_size: int, temporal_patch_size: int,
              merge_size: int) -> torch.Tensor:
    """``[C, H, W]`` -> the processor's ``flatten_patches`` ``[H/P * W/P, C*tp*P*P]``."""
    c, h, w = image.shape
    p, m = patch_size, merge_size
    x = image.reshape(c, h // p // m, m, p, w // p // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
    x = x.unsqueeze(5).expand(*x.shape[:5], temporal_patch_size, p, p)
    return x.reshape((h // p) * (w // p), c * temporal_patch_size * p * p)


def patchify_frames(frames: torch.Tensor, patch_size: int, merge_size: int) -> torch.Tensor:
    """One temporal slice of a video, ``[tp, C, H, W]`` consecutive frames -> the video
    processor's ``flatten_patches`` rows for it ``[H/P * W/P, C*tp*P*P]`` (a still image
    is ``patchify``'s: its one frame repeated ``tp`` times)."""
    tp, c, h, w = frames.shape
    p, m = patch_size, merge_size
    x = frames.reshape(tp, c, h // p // m, m, p, w // p // m, m, p).permute(2, 5, 3, 6, 1, 0, 4, 7)
    return x.reshape((h // p) * (w // p), c * tp * p * p)


def patches_to_images(pixel_values: torch.Tensor, grid_thw: torch.Tensor, patch_size: int,
                      temporal_patch_size: int, merge_size: int) -> list[torch.Tensor]:
    """Invert the HF processor's flattening: per image a ``[C, H, W]`` tensor (temporal
    slice 0), so that ``forward(img[None])`` sees exactly the processor's patches; the
    engine passes images around as pixels, not as the processor's packed rows.
    ValueError if the rows do not add up to the grids or an entry is a video (``t != 1``)."""
    p, tp, m = patch_size, temporal_patch_size, merge_size
    if pixel_values.dim() != 2 or pixel_values.shape[1] % (tp * p * p):
        raise ValueError(f"pixel_values shape {tuple(pixel_values.shape)} is not "
                         f"[patches, C * {tp} * {p} * {p}]")
    if grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
        raise ValueError(f"grid_thw shape {tuple(grid_thw.shape)} is not [images, 3]")
    grids = [tuple(int(v) for v in row) for row in grid_thw.tolist()]
    if any(t != 1 or h <= 0 or w <= 0 or h % m or w % m for t, h, w in grids):
        raise ValueError(f"grid_thw {grids} is not images (t == 1) with h and w multiples "
                         f"of merge_size {m}")
    if sum(h * w for _, h, w in grids) != pixel_values.shape[0]:
        raise ValueError(f"grid_thw {grids} covers {sum(h * w for _, h, w in grids)} patches, "
                         f"pixel_values has {pixel_values.shape[0]}")
    c = pixel_values.shape[1] // (tp * p * p)
    out = []
    for rows, (_, h, w) in zip(pixel_values.split([h * w for _, h, w in grids]), grids):
        x = rows.reshape(h // m, w // m, m, m, c, tp, p, p)[:, :, :, :, :, 0]
        out.append(x.permute(4, 0, 2, 5, 1, 3, 6).reshape(c, h * p, w * p).contiguous())
    return out
