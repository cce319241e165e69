"""A multimodal checkpoint's text decoder with its image encoder beside it.

Gemma 3's 4B-27B files and LLaVA's save the decoder under ``language_model.`` (older
saves) or ``model.language_model.`` (transformers 5), next to a vision tower and a
projector; Qwen2-VL's under ``model.`` or ``model.language_model.``, next to
``visual.`` / ``model.visual.``. ``with_vision(cls)`` gives a decoder class (Llama's, Gemma's) that reads
such a file: the decoder's names re-rooted at ``model.`` / ``lm_head.``, the tower's
and projector's handed to the image encoder when one is attached (the first pipeline
stage's, when images are on) and never read otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from functools import cache
from typing import Any

import torch
from torch import nn

from pagedserve.worker.anyres import AnyresPixels
from pagedserve.worker.layers.linear import LazyTensor
from pagedserve.worker.video_pixels import VideoPixels

_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                    "model.multi_modal_projector.", "visual.", "model.visual.")
_VISION_NAMES = ("image_newline", "model.image_newline")  # LLaVA-NeXT's row end


def text_name(name: str) -> str | None:
    """A checkpoint name as the text decoder calls it; None for the vision tower's and
    the projector's."""
    for prefix, root in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return root + name[len(prefix):]
    return None if name.startswith(_VISION_PREFIXES) or name in _VISION_NAMES else name


def split_weights(weights: Iterable[tuple[str, LazyTensor]],
                  vision: list[tuple[str, LazyTensor]] | None
                  ) -> Iterator[tuple[str, LazyTensor]]:
    """The decoder's tensors under their re-rooted names; the vision tower's and the
    projector's are set aside in ``vision`` (left out when None)."""
    for name, lazy in weights:
        text = text_name(name)
        if text is not None:
            yield text, lazy
        elif vision is not None:
            vision.append((name, lazy))


def build_encoder(family: str, hf_config: dict, dtype: torch.dtype,
                  device: torch.device) -> nn.Module:
    """The image encoder of a ``family`` file ("gemma3": SigLIP + Gemma's projector;
    "llava": CLIP + LLaVA's two-layer projector; "llava_next" / "llava_onevision": the
    same (or SigLIP) over anyres crops; "qwen2_vl": Qwen2-VL's or Qwen2.5-VL's tower and patch merger)."""
    if family == "gemma3":
        from pagedserve.worker.models.gemma3_vision import Gemma3VisionEncoder

        return Gemma3VisionEncoder.from_hf_config(hf_config, dtype, device)
    if family == "llava":
        from pagedserve.worker.models.llava_vision import LlavaVisionEncoder

        return LlavaVisionEncoder.from_hf_config(hf_config, dtype, device)
    if family in ("llava_next", "llava_onevision"):
        from pagedserve.worker.models.llava_next_vision import LlavaNextVisionEncoder

        return LlavaNextVisionEncoder.from_hf_config(hf_config, dtype, device)
    if family == "qwen2_vl":
        from pagedserve.worker.models.qwen2_vision import Qwen2VisionEncoder

        return Qwen2VisionEncoder.from_hf_config(hf_config, dtype, device)
    raise ValueError(f"no image encoder for model family {family!r}")


def encode_picture(vision: nn.Module, pixels: Any, device: torch.device) -> torch.Tensor:
    """One picture's embeddings ``[tokens, hidden]``: its pixel tensor through the
    encoder, an anyres picture's crops with its size (LLaVA-NeXT), or a video's frames
    (Qwen2-VL)."""
    if isinstance(pixels, VideoPixels):
        if not hasattr(vision, "encode_video"):
            raise ValueError("this model takes no videos")
        return vision.encode_video(torch.as_tensor(pixels.frames).to(device))
    if isinstance(pixels, AnyresPixels):
        return vision.encode_anyres(  # type: ignore[operator]
            torch.as_tensor(pixels.crops).to(device), pixels.height, pixels.width,
            pixels.single)
    return vision(torch.as_tensor(pixels).to(device)[None])[0]


class VisionMixin:
    """Multimodal file reading for a decoder class (see the module docstring)."""

    config: object
    stage: object
    vision: nn.Module | None

    def attach_vision(self, dtype: torch.dtype, device: torch.device) -> None:
        """Build the image encoder (on the first pipeline stage only: the images'
        embeddings enter with the tokens'); ``load_weights`` fills it."""
        image = self.config.image  # type: ignore[attr-defined]
        if image is None:
            raise ValueError("this model takes no images")
        if self.stage.is_first:  # type: ignore[attr-defined]
            self.vision = build_encoder(image.family, image.hf_dict(), dtype, device)

    def load_weights(self, weights: Iterable[tuple[str, LazyTensor]],
                     on_layer: Callable[[str, nn.Module], None] | None = None) -> None:
        """The decoder's as the base class loads them, then the encoder's."""
        vision: list[tuple[str, LazyTensor]] = []
        keep = vision if self.vision is not None else None
        super().load_weights(split_weights(weights, keep), on_layer)  # type: ignore[misc]
        if self.vision is not None:
            self.vision.load_weights(vision)  # type: ignore[operator]

    def owns_tensor(self, name: str) -> bool:
        text = text_name(name)
        if text is None:
            return self.vision is not None
        return super().owns_tensor(text)  # type: ignore[misc]


@cache
def with_vision(cls: type) -> type:
    """``cls`` reading a multimodal file (one subclass per decoder class)."""
    return type(f"{cls.__name__}WithVision", (VisionMixin, cls), {})
