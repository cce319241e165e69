"""What a multimodal Gemma 3 file says about its images, read from ``config.json``.

The 4B-27B Gemma 3 releases (``model_type: gemma3``, ``Gemma3ForConditionalGeneration``)
put a SigLIP vision tower and a projector in front of the text decoder: an image
becomes ``mm_tokens_per_image`` embeddings that replace as many ``image_token_index``
placeholders, which the processor writes between ``boi_token_index`` and
``eoi_token_index``. The defaults are transformers' ``Gemma3Config``'s (the released
files list only what differs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ImageConfig:
    """A multimodal file's image facts; ``hf_config`` is its whole ``config.json`` as
    JSON text (the vision encoder builds from it; text keeps the dataclass hashable)."""

    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    tokens_per_image: int
    image_size: int
    hf_config: str

    def hf_dict(self) -> dict[str, Any]:
        return json.loads(self.hf_config)


def image_config_from_hf(cfg: dict[str, Any]) -> ImageConfig | None:
    """The image facts of a ``gemma3`` config with a ``vision_config``; None otherwise.
    ``ValueError`` names a field that cannot be served."""
    if cfg.get("model_type") != "gemma3" or not isinstance(cfg.get("vision_config"), dict):
        return None
    vision = cfg["vision_config"]
    tokens = int(cfg.get("mm_tokens_per_image") or 256)
    side = int(tokens ** 0.5)
    if side * side != tokens:
        raise ValueError(f"model config field 'mm_tokens_per_image' must be a square, got "
                         f"{tokens}")
    image_size = int(vision.get("image_size", 224))
    patch = int(vision.get("patch_size", 16))
    if image_size % patch or (image_size // patch) % side:
        raise ValueError(f"model config field 'vision_config.image_size' ({image_size}) must "
                         f"be a multiple of patch_size ({patch}) x sqrt(mm_tokens_per_image)")

    def index(name: str, default: int) -> int:
        value = cfg.get(name, cfg.get(name.replace("_index", "_id")))
        return default if value is None else int(value)

    return ImageConfig(
        image_token_id=index("image_token_index", 262_144),
        boi_token_id=index("boi_token_index", 255_999),
        eoi_token_id=index("eoi_token_index", 256_000),
        tokens_per_image=tokens,
        image_size=image_size,
        hf_config=json.dumps(cfg),
    )
