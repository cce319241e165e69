"""LLaVA-NeXT's image encoder: LLaVA's CLIP tower and projector over each crop of an
"anyres" picture (``anyres``), the crops' features packed as Hugging Face's
``pack_image_features`` packs them.

The whole picture's ``P x P`` features come first; the canvas's crops are laid out
as one ``rows*P x cols*P`` grid, the rows or columns the processor padded are cut
off, and each remaining row is closed by the learned ``image_newline`` embedding,
read row by row. The tower runs all of a picture's crops as one batch.

LLaVA-OneVision packs the same way behind a SigLIP tower, with two departures: a grid
holding more than ``anyres_max_N`` crops' features is scaled down bilinearly to about
``N``'s before the newlines (``anyres.shrunk_size``), and a picture among several in
its prompt is encoded whole only (its features and one newline). It takes videos too
(``encode_video``): each frame's ``P x P`` features pooled to ``ceil(P / 2)`` a side,
the frames in order, one newline after the last.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from pagedserve.worker.anyres import anyres_layout, check_pinpoints, max_crops_of
from pagedserve.worker.image_config import grid_pinpoints
from pagedserve.worker.layers.linear import LazyTensor
from pagedserve.worker.models.llava_vision import (
    _IGNORED,
    LlavaVisionConfig,
    LlavaVisionEncoder,
)
from pagedserve.worker.models.vit import load_targets, param, tower_key

_NEWLINE_NAMES = ("image_newline", "model.image_newline")


def _key(name: str) -> str | None:
    return "image_newline" if name in _NEWLINE_NAMES else tower_key(name)


class LlavaNextVisionEncoder(LlavaVisionEncoder):
    """Crops ``[1 + rows*cols, 3, S, S]`` of one picture -> its tokens ``[count,
    text_hidden]`` (``anyres.anyres_token_count``)."""

    def __init__(self, cfg: LlavaVisionConfig, pinpoints: list[tuple[int, int]],
                 dtype: torch.dtype, device: torch.device, max_crops: int | None = None):
        super().__init__(cfg, dtype, device)
        side = cfg.image_size // cfg.patch_size
        if self.tokens_per_image != side * side:
            raise ValueError(f"vision_feature_select_strategy {cfg.select_strategy!r} leaves "
                             f"{self.tokens_per_image} features a crop, not {side * side}")
        self.pinpoints, self.max_crops = pinpoints, max_crops
        self.image_newline = param(cfg.text_hidden_size, dtype=dtype, device=device)

    @classmethod
    def from_hf_config(cls, hf_config: dict, dtype: torch.dtype,
                       device: torch.device) -> LlavaNextVisionEncoder:
        cfg = LlavaVisionConfig.from_hf(hf_config)
        pinpoints = check_pinpoints(grid_pinpoints(hf_config), cfg.image_size,
                                    "image_grid_pinpoints")
        return cls(cfg, pinpoints, dtype, device, max_crops_of(hf_config))

    def encode_anyres(self, crops: torch.Tensor, height: int, width: int,
                      single: bool = True) -> torch.Tensor:
        """One picture's tokens from its crops and its size before processing (``single``
        False: a OneVision picture among several, its whole-picture crop only);
        ValueError when the crops are not the grid that size gets."""
        cfg = self.cfg
        side = cfg.image_size // cfg.patch_size
        rows, cols, h, w = anyres_layout(height, width, self.pinpoints, cfg.image_size,
                                         cfg.patch_size)
        want = 1 + rows * cols if single else 1
        if crops.dim() != 4 or crops.shape[0] != want:
            raise ValueError(f"a {height}x{width} picture takes {want} crops here, got "
                             f"pixels of shape {tuple(crops.shape)}")
        feats = self(crops)  # [crops, side*side, hidden]
        hidden = feats.shape[-1]
        if not single:
            return torch.cat([feats[0], self.image_newline.to(feats.dtype)[None]])
        grid = feats[1:].view(rows, cols, side, side, hidden)
        grid = grid.permute(0, 2, 1, 3, 4).reshape(rows * side, cols * side, hidden)
        top, left = (rows * side - h) // 2, (cols * side - w) // 2
        grid = grid[top:top + h, left:left + w]
        _, _, small_h, small_w = anyres_layout(height, width, self.pinpoints, cfg.image_size,
                                               cfg.patch_size, self.max_crops)
        if (small_h, small_w) != (h, w):
            grid = F.interpolate(grid.permute(2, 0, 1)[None], [small_h, small_w],
                                 mode="bilinear")[0].permute(1, 2, 0)
            h = small_h
        newline = self.image_newline.to(grid.dtype).expand(h, 1, hidden)
        return torch.cat([feats[0], torch.cat([grid, newline], dim=1).reshape(-1, hidden)])

    def encode_video(self, frames: torch.Tensor) -> torch.Tensor:
        """A LLaVA-OneVision video's frames ``[F, 3, S, S]`` -> ``[F * Q * Q + 1,
        hidden]``, ``Q = ceil(P / 2)``: each frame's projected features scaled down
        bilinearly (HF's ``apply_pooling``), then one ``image_newline`` (HF's
        ``get_video_features``). The frames run through the tower as one batch."""
        side = self.cfg.image_size // self.cfg.patch_size
        feats = self(frames)  # [F, side*side, hidden]
        count, _, hidden = feats.shape
        grid = feats.view(count, side, side, hidden).permute(0, 3, 1, 2)
        pooled = F.interpolate(grid, size=[-(-side // 2)] * 2, mode="bilinear")
        pooled = pooled.permute(0, 2, 3, 1).reshape(-1, hidden)
        return torch.cat([pooled, self.image_newline.to(pooled.dtype)[None]])

    def load_weights(self, weights: Iterable[tuple[str, LazyTensor]]) -> None:
        """LLaVA's tensors and ``image_newline`` (saved at the top level or under
        ``model.``); ValueError as ``LlavaVisionEncoder.load_weights``."""
        targets = {**self._targets(), "image_newline": self.image_newline}
        load_targets(targets, weights, "LLaVA-NeXT vision tower / projector", _IGNORED,
                     key_of=_key)
