"""Qwen2-VL and Qwen2.5-VL files (``model_type: qwen2_vl`` / ``qwen2_5_vl``), read as a
Qwen2 decoder with multimodal RoPE plus their image facts.

The decoder is Qwen2's (q/k/v bias, SwiGLU, RMSNorm). What differs is M-RoPE: each
head's rotary frequencies are split in three sections (``mrope_section``, e.g.
``[16, 24, 24]`` of a 128-wide head's 64) turning by a token's temporal, row and
column position. Text tokens have the three equal, so they turn as plain RoPE; an
image's tokens sit on its grid. Released files come in two layouts: older saves put
the decoder's fields at the top level with ``rope_scaling: {"type": "mrope",
"mrope_section": [...]}``; transformers 5 nests them in ``text_config`` with
``rope_parameters: {"rope_type": "default", "mrope_section": [...]}``. Both read
here. The image processor resizes each picture to a multiple of ``patch_size x
spatial_merge_size`` near its own size, so an image's token count varies with it
(``tokens_per_image`` 0): the prompt carries one ``<|image_pad|>`` per image and the
engine writes it out to the image's run once the picture is resized.
"""

from __future__ import annotations

import json
from typing import Any

from pagedserve.worker.image_config import ImageConfig

QWEN_VL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
# transformers' Qwen2VLTextConfig / Qwen2_5_VLTextConfig default (rotary embedding's).
_DEFAULT_MROPE_SECTION = (16, 24, 24)
_DEFAULT_IMAGE_TOKEN_ID = 151_655  # <|image_pad|>
_DEFAULT_VIDEO_TOKEN_ID = 151_656  # <|video_pad|>


def qwen_vl_text_config(cfg: dict[str, Any]) -> tuple[dict[str, Any], tuple[int, ...]]:
    """The decoder's config as a ``qwen2`` config without the M-RoPE sections, and the
    sections. ``ValueError`` names a malformed ``mrope_section``."""
    text = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
    text.update(cfg.get("text_config") or {})
    rope = {**(text.pop("rope_scaling", None) or {}), **(text.get("rope_parameters") or {})}
    section = rope.pop("mrope_section", None)
    section = _DEFAULT_MROPE_SECTION if section is None else section
    if (not isinstance(section, list | tuple) or len(section) != 3
            or any(isinstance(s, bool) or not isinstance(s, int) or s <= 0 for s in section)):
        raise ValueError(f"model config field 'rope_parameters.mrope_section' must be three "
                         f"positive ints, got {section!r}")
    kind = rope.pop("rope_type", rope.pop("type", "default"))
    rope["rope_type"] = "default" if kind == "mrope" else kind
    if "rope_theta" not in rope and "rope_theta" in text:
        rope["rope_theta"] = text["rope_theta"]
    text["rope_parameters"] = rope
    text["model_type"] = "qwen2"
    return text, tuple(section)


def qwen_vl_image_config(cfg: dict[str, Any]) -> ImageConfig:
    """The image facts of a Qwen2-VL / Qwen2.5-VL config: ``<|image_pad|>`` is both the
    marker a prompt holds once per image and the placeholder its run repeats
    (``<|video_pad|>`` a video's); attention stays causal, as in Hugging Face's model."""
    image = _token_id(cfg, "image_token_id", "image_token_index", _DEFAULT_IMAGE_TOKEN_ID)
    video = _token_id(cfg, "video_token_id", "video_token_index", _DEFAULT_VIDEO_TOKEN_ID)
    if video == image:
        raise ValueError(f"model config field 'video_token_id' ({video}) is the image token")
    vision = cfg["vision_config"]
    for name in ("patch_size", "spatial_merge_size"):
        value = vision.get(name, 14 if name == "patch_size" else 2)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"model config field 'vision_config.{name}' must be a positive "
                             f"int, got {value!r}")
    tokens_per_second = None
    if cfg.get("model_type") == "qwen2_5_vl":  # HF's Qwen2_5_VLVisionConfig default: 4
        tokens_per_second = vision.get("tokens_per_second", 4)
        if isinstance(tokens_per_second, bool) or not isinstance(tokens_per_second, int | float) \
                or tokens_per_second <= 0:
            raise ValueError("model config field 'vision_config.tokens_per_second' must be a "
                             f"positive number, got {tokens_per_second!r}")
        tokens_per_second = float(tokens_per_second)
    return ImageConfig(family="qwen2_vl", image_token_id=image, marker_token_id=image,
                       eoi_token_id=None, tokens_per_image=0, image_size=0,
                       bidirectional=False, hf_config=json.dumps(cfg), video_token_id=video,
                       tokens_per_second=tokens_per_second)


def _token_id(cfg: dict[str, Any], name: str, alias: str, default: int) -> int:
    value = cfg.get(name, cfg.get(alias))
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"model config field '{name}' must be a token id, got {value!r}")
    return value
