"""What a multimodal file says about its images, read from ``config.json``.

Three families take images. Gemma 3's 4B-27B releases (``model_type: gemma3``) put a
SigLIP tower and a projector in front of the decoder: an image becomes
``mm_tokens_per_image`` embeddings replacing as many ``image_token_index``
placeholders, which the processor writes between ``boi_token_index`` and
``eoi_token_index`` (a text prompt marks the image with the begin token), and an
image's tokens attend to each other both ways. LLaVA-1.5 (``model_type: llava``) puts a
CLIP tower and a two-layer projector in front of a Llama-family decoder: the
processor writes ``image_token_index`` once per patch (the text marks the image with
that token, once), attention stays causal. LLaVA-NeXT (``model_type: llava_next``) is
LLaVA with "anyres" pictures (``anyres``): its run's length depends on the picture's
size (``tokens_per_image`` 0); LLaVA-OneVision (``llava_onevision``) the same behind a
SigLIP tower, its grid shrunk past ``anyres_max_N`` crops and, in a prompt of several
pictures, each picture whole only; it takes videos too (``video_token_index``).
Qwen2-VL and Qwen2.5-VL (``qwen_vl_config``) size each image's run by the picture
(``tokens_per_image`` 0), causal too. Defaults are transformers' config classes' (the
released files list only what differs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

MULTIMODAL_MODEL_TYPES = ("gemma3", "llava", "llava_next", "llava_onevision", "qwen2_vl",
                          "qwen2_5_vl")


@dataclass(frozen=True)
class ImageConfig:
    """A multimodal file's image facts. ``marker_token_id`` is the token a text prompt
    marks an image with; ``eoi_token_id`` (Gemma 3) closes an image's run;
    ``bidirectional``: an image's tokens see each other both ways. ``hf_config`` is
    the whole ``config.json`` as JSON text (the encoder builds from it; text keeps the
    dataclass hashable). ``video_token_id``: the placeholder a video's run repeats
    (Qwen2-VL; None: no videos); ``tokens_per_second``: Qwen2.5-VL's temporal
    position scale (None: a slice's index is its time)."""

    family: str
    image_token_id: int
    marker_token_id: int
    eoi_token_id: int | None
    tokens_per_image: int
    image_size: int
    bidirectional: bool
    hf_config: str
    video_token_id: int | None = None
    tokens_per_second: float | None = None

    def hf_dict(self) -> dict[str, Any]:
        return json.loads(self.hf_config)

    def info(self) -> dict[str, Any]:
        """What the engine and the HTTP front need (``model_info()["image"]``)."""
        return {"family": self.family, "image_token_id": self.image_token_id,
                "marker_token_id": self.marker_token_id, "eoi_token_id": self.eoi_token_id,
                "tokens_per_image": self.tokens_per_image, "image_size": self.image_size,
                "bidirectional": self.bidirectional, "video_token_id": self.video_token_id,
                "tokens_per_second": self.tokens_per_second}


def image_config_from_hf(cfg: dict[str, Any]) -> ImageConfig | None:
    """The image facts of a ``gemma3``, ``llava``, ``llava_next`` or Qwen-VL config with a
    ``vision_config``; None otherwise. ``ValueError`` names a field that cannot be
    served."""
    family = cfg.get("model_type")
    if family not in MULTIMODAL_MODEL_TYPES or not isinstance(cfg.get("vision_config"), dict):
        return None

    def index(name: str, default: int) -> int:
        value = cfg.get(name, cfg.get(name.replace("_index", "_id")))
        return default if value is None else int(value)

    if family in ("llava", "llava_next", "llava_onevision"):
        default = 151_646 if family == "llava_onevision" else 32_000
        return _llava(cfg, index("image_token_index", default))
    if family in ("qwen2_vl", "qwen2_5_vl"):
        from pagedserve.worker.qwen_vl_config import qwen_vl_image_config

        return qwen_vl_image_config(cfg)
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
    return ImageConfig(
        family="gemma3", image_token_id=index("image_token_index", 262_144),
        marker_token_id=index("boi_token_index", 255_999),
        eoi_token_id=index("eoi_token_index", 256_000), tokens_per_image=tokens,
        image_size=image_size, bidirectional=True, hf_config=json.dumps(cfg))


def _llava(cfg: dict[str, Any], image_token: int) -> ImageConfig:
    from transformers import CLIPVisionConfig, SiglipVisionConfig

    from pagedserve.worker.anyres import check_pinpoints, max_crops_of

    family = cfg["model_type"]
    onevision = family == "llava_onevision"
    vision = dict(cfg["vision_config"])
    kind = vision.pop("model_type", "siglip_vision_model" if onevision else "clip_vision_model")
    if kind not in ("clip_vision_model", "siglip_vision_model"):
        raise ValueError("model config field 'vision_config.model_type' must be "
                         f"'clip_vision_model' or 'siglip_vision_model', got {kind!r}")
    siglip = kind == "siglip_vision_model"
    vision = (SiglipVisionConfig if siglip else CLIPVisionConfig)(**vision)
    strategy = cfg.get("vision_feature_select_strategy", "full" if onevision else "default")
    if strategy not in ("default", "full"):
        raise ValueError("model config field 'vision_feature_select_strategy' must be "
                         f"'default' or 'full', got {strategy!r}")
    if vision.image_size % vision.patch_size:
        raise ValueError(f"model config field 'vision_config.image_size' "
                         f"({vision.image_size}) must be a multiple of patch_size "
                         f"({vision.patch_size})")
    patches = (vision.image_size // vision.patch_size) ** 2
    # CLIP's class token leads the features; ``default`` drops the first one.
    tokens = patches + (not siglip) - (strategy == "default")
    if family in ("llava_next", "llava_onevision"):
        if tokens != patches:  # the packing lays out exactly P x P features a crop
            raise ValueError("model config field 'vision_feature_select_strategy' must "
                             f"leave {patches} features a crop for {family} ('default' "
                             f"for a CLIP tower, 'full' for SigLIP), got {strategy!r}")
        check_pinpoints(grid_pinpoints(cfg), vision.image_size, "image_grid_pinpoints")
        max_crops_of(cfg)
        tokens = 0  # each picture's own count
    video = None
    if onevision:  # its videos: frames pooled 2 x 2, ``LlavaNextVisionEncoder.encode_video``
        found = cfg.get("video_token_index", cfg.get("video_token_id"))
        video = 151_647 if found is None else int(found)
        if video == image_token:
            raise ValueError(f"model config field 'video_token_index' ({video}) is the "
                             "image token")
    return ImageConfig(
        family=family, image_token_id=image_token, marker_token_id=image_token,
        eoi_token_id=None, tokens_per_image=tokens, image_size=vision.image_size,
        bidirectional=False, hf_config=json.dumps(cfg), video_token_id=video)


# The config classes' canvases when a file lists none: LLaVA-NeXT's (made for a
# 336-pixel tower) and LLaVA-OneVision's (1 to 6 crops of 384 a side).
DEFAULT_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
ONEVISION_PINPOINTS = [[384 * i, 384 * j] for i in range(1, 7) for j in range(1, 7)]


def grid_pinpoints(cfg: dict[str, Any]) -> Any:
    """A ``llava_next`` / ``llava_onevision`` config's ``image_grid_pinpoints`` (its
    config class's default when absent), unchecked."""
    found = cfg.get("image_grid_pinpoints")
    if found is not None:
        return found
    return ONEVISION_PINPOINTS if cfg.get("model_type") == "llava_onevision" \
        else DEFAULT_PINPOINTS


def llava_text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A LLaVA config as its decoder's: ``text_config`` completed with its config
    class's defaults (a Llama unless it says), the top level's ids and dtype kept."""
    from transformers import AutoConfig

    text = dict(cfg.get("text_config") or {})
    model_type = text.pop("model_type",
                          "qwen2" if cfg.get("model_type") == "llava_onevision" else "llama")
    full = AutoConfig.for_model(model_type, **text).to_dict()
    for key in ("eos_token_id", "bos_token_id", "quantization_config", "dtype", "torch_dtype"):
        if cfg.get(key) is not None:
            full[key] = cfg[key]
    return {**full, "model_type": model_type}
