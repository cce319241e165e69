"""LLaVA-NeXT's "anyres" image layout, in plain Python: which grid of crops a picture
gets, and how many tokens it becomes.

The processor picks, among ``image_grid_pinpoints`` (``[height, width]`` canvases,
multiples of the tower's square input ``S``), the canvas that keeps most of the
picture's pixels and wastes least (Hugging Face's ``select_best_resolution``),
resizes the picture into it keeping its aspect, pads it centred, and cuts it into
``S x S`` crops; the picture squashed to ``S x S`` goes first. The encoder turns each
crop into ``P x P`` features (``P = S / patch_size``), lays the crops' features out
as the canvas's ``rows*P x cols*P`` grid, cuts the padding's rows or columns back
off (``unpadded_size``) and closes every remaining row with a learned newline
embedding: ``P*P + h*w + h`` tokens in all. Both the front (to write the prompt's
placeholder run) and the encoder (to pack) count with these functions, as HF's
processor and model do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AnyresPixels:
    """One picture as the LLaVA-NeXT encoder takes it: ``crops`` ``[1 + rows*cols, 3,
    S, S]`` (the whole picture first, then the canvas's crops row by row) and the
    picture's size before processing, which decides how much padding to cut off.
    ``single`` False: LLaVA-OneVision's picture among several in its prompt, which
    gets only the whole picture (padded square), ``crops`` ``[1, 3, S, S]``."""

    crops: Any
    height: int
    width: int
    single: bool = True

    def to(self, dtype: Any) -> AnyresPixels:
        return AnyresPixels(self.crops.to(dtype), self.height, self.width, self.single)


def check_pinpoints(pinpoints: Any, image_size: int, field: str) -> list[tuple[int, int]]:
    """``image_grid_pinpoints`` as ``(height, width)`` pairs; ``ValueError`` naming
    ``field`` unless each is a pair of positive multiples of ``image_size``."""
    if not isinstance(pinpoints, list | tuple) or not pinpoints:
        raise ValueError(f"model config field '{field}' must be a non-empty list of "
                         f"[height, width] pairs, got {pinpoints!r}")
    out = []
    for p in pinpoints:
        if (not isinstance(p, list | tuple) or len(p) != 2
                or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0
                       or v % image_size for v in p)):
            raise ValueError(f"model config field '{field}' must hold [height, width] pairs "
                             f"of positive multiples of the image size {image_size}, got {p!r}")
        out.append((int(p[0]), int(p[1])))
    return out


def best_resolution(height: int, width: int,
                    pinpoints: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The canvas ``(height, width)`` that keeps most of the picture's pixels once it is
    scaled into it, then wastes least (HF's ``select_best_resolution``)."""
    best, most, waste = pinpoints[0], -1, float("inf")
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        wasted = h * w - kept
        if kept > most or (kept == most and wasted < waste):
            best, most, waste = (h, w), kept, wasted
    return best


def unpadded_size(height: int, width: int, grid_h: int, grid_w: int) -> tuple[int, int]:
    """The part of a ``grid_h x grid_w`` feature grid the picture covers once the
    centred padding's rows (or columns) are cut off (HF's ``unpad_image``)."""
    if width / height > grid_w / grid_h:
        kept = int(round(height * (grid_w / width), 7))
        return grid_h - 2 * ((grid_h - kept) // 2), grid_w
    kept = int(round(width * (grid_h / height), 7))
    return grid_h, grid_w - 2 * ((grid_w - kept) // 2)


def shrunk_size(h: int, w: int, side: int, max_crops: int | None) -> tuple[int, int]:
    """LLaVA-OneVision's ``anyres_max_N``: an unpadded grid holding more than ``N`` crops'
    features (by more than 10% a side) is scaled down, bilinearly, to about ``N``'s."""
    if not max_crops:
        return h, w
    ratio = math.sqrt(h * w / (max_crops * side * side))
    if ratio > 1.1:
        return int(h // ratio), int(w // ratio)
    return h, w


def anyres_layout(height: int, width: int, pinpoints: Sequence[tuple[int, int]],
                  image_size: int, patch_size: int, max_crops: int | None = None
                  ) -> tuple[int, int, int, int]:
    """``(rows, cols, h, w)``: the crop grid a ``height x width`` picture gets and the
    features left of its ``rows*P x cols*P`` grid after unpadding (and shrinking to
    ``max_crops`` crops' worth, LLaVA-OneVision)."""
    if height <= 0 or width <= 0:
        raise ValueError(f"image size {height}x{width} is empty")
    canvas_h, canvas_w = best_resolution(height, width, pinpoints)
    rows, cols = canvas_h // image_size, canvas_w // image_size
    side = image_size // patch_size
    h, w = unpadded_size(height, width, rows * side, cols * side)
    return (rows, cols, *shrunk_size(h, w, side, max_crops))


def anyres_token_count(height: int, width: int, pinpoints: Sequence[tuple[int, int]],
                       image_size: int, patch_size: int, max_crops: int | None = None,
                       single: bool = True) -> int:
    """Tokens a ``height x width`` picture becomes: the whole picture's ``P*P``, the
    unpadded grid's ``h*w`` and one newline per grid row; a LLaVA-OneVision picture
    among several in its prompt: ``P*P`` and one newline."""
    side = image_size // patch_size
    if not single:
        return side * side + 1
    _, _, h, w = anyres_layout(height, width, pinpoints, image_size, patch_size, max_crops)
    return side * side + h * w + h


def anyres_facts(pinpoints: Sequence[tuple[int, int]], image_size: int, patch_size: int,
                 max_crops: int | None = None, multi_image_base: bool = False
                 ) -> dict[str, Any]:
    """What a front end needs to count a picture's tokens (``model_info()["image"]``);
    ``multi_image_base``: a prompt of several pictures gives each only its whole
    picture (LLaVA-OneVision)."""
    return {"pinpoints": [list(p) for p in pinpoints], "image_size": image_size,
            "patch_size": patch_size, "max_crops": max_crops,
            "multi_image_base": multi_image_base}


def facts_token_count(height: int, width: int, facts: dict[str, Any],
                      num_images: int = 1) -> int:
    """``anyres_token_count`` from ``anyres_facts``, for one of ``num_images`` pictures
    of a prompt."""
    return anyres_token_count(height, width, [tuple(p) for p in facts["pinpoints"]],
                              int(facts["image_size"]), int(facts["patch_size"]),
                              facts.get("max_crops"),
                              not (facts.get("multi_image_base") and num_images > 1))


def max_crops_of(cfg: dict[str, Any]) -> int | None:
    """``vision_aspect_ratio`` ``anyres_max_N`` of a ``llava_onevision`` config as N
    (its config class's default, 9, when absent); None for other models."""
    if cfg.get("model_type") != "llava_onevision":
        return None
    ratio = cfg.get("vision_aspect_ratio", "anyres_max_9")
    tail = ratio.removeprefix("anyres_max_") if isinstance(ratio, str) else ""
    if not tail.isdigit() or int(tail) < 1:
        raise ValueError("model config field 'vision_aspect_ratio' must be 'anyres_max_N' "
                         f"with N >= 1, got {ratio!r}")
    return int(tail)
