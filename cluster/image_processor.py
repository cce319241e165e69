"""The model's image processor: a picture as the pixel tensor its encoder takes.

Hugging Face's processors on the PIL backend (Gemma 3's, CLIP's for LLaVA-1.5,
LLaVA-NeXT's, Qwen2-VL's), so a picture gives the pixels (and the content hash) HF's processor
gives it on any host, whatever else is installed there.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pagedserve.cluster.processor_options import PanAndScan
from pagedserve.worker.anyres import AnyresPixels, facts_token_count

if TYPE_CHECKING:  # PIL is imported where an image is read: text-only serving needs none
    from PIL import Image

DEFAULT_IMAGE_SIZE = 896  # Gemma 3's SigLIP tower; its config.json may leave it out


class ImageProcessor:
    """The model's Hugging Face image processor, on the PIL backend: Gemma 3's, CLIP's
    (LLaVA-1.5: resize the short side, centre-crop, CLIP's mean and std), or
    Qwen2-VL's (each picture resized to a multiple of ``patch_size x merge_size`` near
    its own size, between ``min_pixels`` and ``max_pixels``; its flattened patches are
    turned back into one ``[3, H, W]`` tensor per picture, which the encoder patches
    again the same way).

    The PIL backend always, even where torchvision is installed: it is the resize of HF's
    original (slow) processors, and the same image then gives the same pixels (and
    ``image_hash``) on every host, whatever is installed there.
    Gemma 3's is called with ``Gemma3Processor.images_kwargs`` (RGB conversion on,
    pan-and-scan off unless its saved config or ``options`` turn it on: ``PanAndScan``),
    as the processor calls it, so the output equals the processor's ``pixel_values``.
    ``options``: checked ``mm_processor_kwargs`` (``processor_options``), which take
    precedence over the saved config, as in the processor's call.
    """

    def __init__(self, hf_image_processor: Any, options: Mapping[str, Any] | None = None
                 ) -> None:
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
        from transformers.models.gemma3.image_processing_pil_gemma3 import (
            Gemma3ImageProcessorPil,
        )
        from transformers.models.gemma3.processing_gemma3 import Gemma3Processor
        from transformers.models.llava_next.image_processing_pil_llava_next import (
            LlavaNextImageProcessorPil,
        )
        from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
            LlavaOnevisionImageProcessorPil,
        )
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )

        hf = hf_image_processor
        options = dict(options or {})
        self._hf, self.options = hf, options
        self._qwen = isinstance(hf, Qwen2VLImageProcessorPil)
        self._anyres: dict[str, Any] | None = None
        self.pan_and_scan: PanAndScan | None = None
        self.pan_and_scan_bounds: PanAndScan | None = None  # Gemma 3's, on or off
        if self._qwen:  # sizes vary: no square side
            self._image_size, self._call_kwargs = 0, {}
            self._pixel_bounds = _pixel_bounds(hf, options)
            if options:
                lo, hi = self._pixel_bounds
                self._call_kwargs = {"size": {"shortest_edge": lo, "longest_edge": hi}}
            return
        if isinstance(hf, LlavaNextImageProcessorPil | LlavaOnevisionImageProcessorPil):
            self._image_size, self._call_kwargs = 0, {}
            self._anyres = _anyres_facts(hf)
            self._anyres["multi_image_base"] = isinstance(hf, LlavaOnevisionImageProcessorPil)
            return
        if isinstance(hf, Gemma3ImageProcessorPil):
            size, kwargs = hf.size, dict(Gemma3Processor.images_kwargs)
            self.pan_and_scan = PanAndScan.of(hf, options)
            self.pan_and_scan_bounds = PanAndScan.bounds(hf, options)
            if self.pan_and_scan is not None:
                kwargs.update(self.pan_and_scan.call_kwargs())
        elif isinstance(hf, CLIPImageProcessorPil):
            size = hf.crop_size if hf.do_center_crop else hf.size
            kwargs = {}
        else:
            raise ValueError(f"image processor: expected Gemma 3's, CLIP's or Qwen2-VL's, "
                             f"got {type(hf).__name__}")
        if size.height is None or size.height != size.width:
            raise ValueError(f"image processor: size must be square height=width, got {size}")
        self._image_size = int(size.height)
        self._call_kwargs = kwargs

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, hf_config: dict,
                       options: Mapping[str, Any] | None = None) -> ImageProcessor:
        """What ``AutoImageProcessor.from_pretrained(model_dir, backend="pil")`` loads where
        the checkpoint has a preprocessor config, else the model's defaults at
        ``vision_config.image_size`` (Gemma 3: 896 if absent; CLIP's: 224); ``options``
        as the constructor takes them."""
        from transformers import AutoImageProcessor
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
        from transformers.models.gemma3.image_processing_pil_gemma3 import (
            Gemma3ImageProcessorPil,
        )

        model_dir = Path(model_dir)
        if _has_image_processor_config(model_dir):
            hf = AutoImageProcessor.from_pretrained(str(model_dir), backend="pil",
                                                    local_files_only=True)
            return cls(hf, options)
        if hf_config.get("model_type") in ("qwen2_vl", "qwen2_5_vl"):
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
                Qwen2VLImageProcessorPil,
            )

            vision = hf_config.get("vision_config") or {}
            return cls(Qwen2VLImageProcessorPil(
                patch_size=vision.get("patch_size", 14),
                merge_size=vision.get("spatial_merge_size", 2),
                temporal_patch_size=vision.get("temporal_patch_size", 2)), options)
        if hf_config.get("model_type") == "llava_next":
            from transformers.models.llava_next.image_processing_pil_llava_next import (
                LlavaNextImageProcessorPil,
            )

            from pagedserve.worker.image_config import grid_pinpoints

            side = (hf_config.get("vision_config") or {}).get("image_size", 336)
            return cls(LlavaNextImageProcessorPil(
                size={"shortest_edge": side}, crop_size={"height": side, "width": side},
                image_grid_pinpoints=grid_pinpoints(hf_config)))
        if hf_config.get("model_type") == "llava_onevision":
            from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
                LlavaOnevisionImageProcessorPil,
            )

            from pagedserve.worker.image_config import grid_pinpoints

            side = (hf_config.get("vision_config") or {}).get("image_size", 384)
            return cls(LlavaOnevisionImageProcessorPil(
                size={"height": side, "width": side},
                image_grid_pinpoints=grid_pinpoints(hf_config)))
        llava = hf_config.get("model_type") == "llava"
        default = 224 if llava else DEFAULT_IMAGE_SIZE
        size = (hf_config.get("vision_config") or {}).get("image_size", default)
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"vision_config.image_size must be a positive int, got {size!r}")
        if llava:
            return cls(CLIPImageProcessorPil(size={"shortest_edge": size},
                                             crop_size={"height": size, "width": size}))
        return cls(Gemma3ImageProcessorPil(size={"height": size, "width": size}), options)

    def variant(self, options: Mapping[str, Any]) -> ImageProcessor:
        """This processor under one request's checked options over its own (vLLM's
        per-request ``mm_processor_kwargs``); itself where there are none."""
        if not options:
            return self
        return ImageProcessor(self._hf, {**self.options, **options})

    @property
    def hf(self) -> Any:
        """The Hugging Face processor (Qwen2-VL's resizes video frames too)."""
        return self._hf

    def resize_facts(self) -> dict[str, int] | None:
        """Qwen2-VL's resize rule (``factor``: patch x merge, the pixel bounds), for a
        front end to count an image's tokens from its size (``image_prompts
        .qwen_token_counts``) without the processor; None for the fixed-size ones."""
        if not self._qwen:
            return None
        lo, hi = self._pixel_bounds
        return {"factor": int(self._hf.patch_size) * int(self._hf.merge_size),
                "min_pixels": lo, "max_pixels": hi}

    def anyres_facts(self) -> dict[str, Any] | None:
        """LLaVA-NeXT's canvases and crop side (``anyres.anyres_facts``), for a front end
        to count a picture's tokens from its size; None for the others."""
        return self._anyres

    def check_model(self, hf_config: dict) -> None:
        """``ValueError`` where the processor's anyres layout is not the model's: its
        crops would not be the grid the encoder packs."""
        if self._anyres is None:
            return
        from pagedserve.worker.anyres import max_crops_of
        from pagedserve.worker.image_config import grid_pinpoints

        onevision = hf_config.get("model_type") == "llava_onevision"
        vision = hf_config.get("vision_config") or {}
        want = ([list(p) for p in grid_pinpoints(hf_config)],
                vision.get("image_size", 384 if onevision else 336))
        got = (self._anyres["pinpoints"], self._anyres["image_size"])
        if got != want:
            raise ValueError(f"image processor: image_grid_pinpoints / crop size {got} "
                             f"differ from the model's {want}")
        if self._anyres["multi_image_base"] != onevision:
            raise ValueError(f"image processor: {type(self._hf).__name__} does not process "
                             f"a {hf_config.get('model_type')} model's pictures")
        self._anyres["patch_size"] = int(vision.get("patch_size", 14))
        self._anyres["max_crops"] = max_crops_of(hf_config)

    def token_count(self, pixels: Any) -> int | None:
        """How many tokens a processed picture becomes, where that varies (Qwen2-VL's
        grid, LLaVA-NeXT's anyres layout); None for a fixed-size processor."""
        if isinstance(pixels, AnyresPixels):
            return facts_token_count(pixels.height, pixels.width, self._anyres or {},
                                     1 if pixels.single else 2)
        grid = self.grid(pixels)
        return None if grid is None else grid[0] * grid[1]

    @property
    def image_size(self) -> int:
        """The side S of the square pixel tensors (0: sizes vary, Qwen2-VL, LLaVA-NeXT)."""
        return self._image_size

    def grid(self, pixels: Any) -> tuple[int, int] | None:
        """``(rows, cols)`` of the tokens a ``[3, H, W]`` picture becomes under M-RoPE
        (Qwen2-VL); None for the others."""
        if not self._qwen:
            return None
        from pagedserve.worker.models.qwen2_vision_config import image_grid

        return image_grid(int(pixels.shape[-2]), int(pixels.shape[-1]),
                          int(self._hf.patch_size), int(self._hf.merge_size))

    def __call__(self, images: list[Image.Image]
                 ) -> torch.Tensor | list[torch.Tensor] | list[AnyresPixels]:
        """float32 ``[N, 3, S, S]`` pixel values, one row per image, in order (Qwen2-VL:
        a list of ``[3, H, W]``, each picture's own size; LLaVA-NeXT: a list of each
        picture's crops with its size; Gemma 3 with pan-and-scan: a list of
        ``[1 + crops, 3, S, S]``, the whole picture first, as the processor orders them)."""
        if self._qwen:
            return self._qwen_pixels(images)
        if self._anyres is not None:
            if self._anyres["multi_image_base"] and len(images) > 1:
                return self._whole_pictures(images)
            return [self._anyres_pixels(img) for img in images]
        if not images:
            return torch.empty((0, 3, self._image_size, self._image_size), dtype=torch.float32)
        out = self._hf(list(images), return_tensors="pt", **self._call_kwargs)
        pixel_values = out["pixel_values"]
        if pixel_values.dtype != torch.float32:
            raise ValueError(f"image processor returned {pixel_values.dtype}, expected float32")
        if self.pan_and_scan is None:
            return pixel_values
        views = [1 + int(n) for n in out["num_crops"]]
        return list(torch.split(pixel_values, views))

    def _anyres_pixels(self, image: Image.Image) -> AnyresPixels:
        """One picture's crops (HF's ``pixel_values[0]``, called alone: no padding to
        another picture's crop count) and its size as HF records it."""
        out = self._hf([image], return_tensors="pt", do_pad=False)
        height, width = (int(v) for v in out["image_sizes"][0])
        return AnyresPixels(torch.as_tensor(out["pixel_values"][0]).float(), height, width)

    def _whole_pictures(self, images: list[Image.Image]) -> list[AnyresPixels]:
        """A LLaVA-OneVision prompt's several pictures, processed as one prompt's (HF pads
        each to a square and resizes it: one crop a picture)."""
        out = self._hf([list(images)], return_tensors="pt")
        return [AnyresPixels(torch.as_tensor(px[:1]).float(), int(size[0]), int(size[1]),
                             single=False)
                for px, size in zip(out["pixel_values"], out["image_sizes"], strict=True)]

    def _qwen_pixels(self, images: list[Image.Image]) -> list[torch.Tensor]:
        """HF's patches and grids turned back into one ``[3, H, W]`` per picture."""
        if not images:
            return []
        from pagedserve.worker.models.qwen2_vision_config import patches_to_images

        hf = self._hf
        out = hf(list(images), return_tensors="pt", **self._call_kwargs)
        return patches_to_images(out["pixel_values"].float(), out["image_grid_thw"],
                                 int(hf.patch_size), int(hf.temporal_patch_size),
                                 int(hf.merge_size))


def _pixel_bounds(hf: Any, options: Mapping[str, Any]) -> tuple[int, int]:
    """Qwen2-VL's picture bounds in pixels: the saved ``size``, ``min_pixels`` /
    ``max_pixels`` in ``options`` over it; ``ValueError`` where they cross."""
    lo = int(options.get("min_pixels", hf.size.shortest_edge))
    hi = int(options.get("max_pixels", hf.size.longest_edge))
    if lo > hi:
        raise ValueError(f"mm_processor_kwargs: min_pixels {lo} > max_pixels {hi} (the "
                         "other bound is the processor's)")
    return lo, hi


def _anyres_facts(hf: Any) -> dict[str, Any]:
    """A LLaVA-NeXT processor's canvases and crop side (its patch size is the model's,
    set by ``check_model``); ``ValueError`` for a layout its encoder cannot pack."""
    from pagedserve.worker.anyres import anyres_facts, check_pinpoints

    crop = hf.crop_size if hf.do_center_crop else hf.size
    side = crop.height if crop.height is not None else crop.shortest_edge
    if not side or (crop.width is not None and crop.width != side):
        raise ValueError(f"image processor: crop_size must be square, got {crop}")
    pinpoints = check_pinpoints(hf.image_grid_pinpoints, int(side),
                                "preprocessor_config.image_grid_pinpoints")
    return anyres_facts(pinpoints, int(side), 14)  # the model's patch: ``check_model``


def _has_image_processor_config(model_dir: Path) -> bool:
    """Where AutoImageProcessor finds one: ``preprocessor_config.json``, or the
    ``image_processor`` section of ``processor_config.json`` (which it prefers)."""
    if (model_dir / "preprocessor_config.json").is_file():
        return True
    nested = model_dir / "processor_config.json"
    if not nested.is_file():
        return False
    try:
        return "image_processor" in json.loads(nested.read_text())
    except (OSError, ValueError):
        return False
