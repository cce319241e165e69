"""A prompt and its images as the scheduler takes them: placeholder ids and spans.

Gemma 3's processor writes each image into the text as its full placeholder run
(``\\n\\n<start_of_image>`` + 256 soft tokens + ``<end_of_image>\\n\\n``), LLaVA's
writes ``<image>`` once per patch (576 for LLaVA-1.5), before tokenising, so the text
around an image tokenises as Hugging Face's processor tokenises it; this does the
same, then hands the scheduler one ``ImageInput`` per run: where it is, the image's
content hash and its preprocessed pixels. The engine holds one per multimodal model;
``LLM.chat`` and the HTTP front build chat prompts the same way (``media_runs
.chat_ids``), where the runs are written out.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagedserve.cluster.image_processor import ImageProcessor
from pagedserve.cluster.media_runs import (
    chat_ids,
    expand_single_markers,
    expand_text,
    place_media,
    split_runs,
    write_out_runs,
)
from pagedserve.cluster.multimodal import image_hash, image_spans, load_image
from pagedserve.cluster.onevision_video import OnevisionVideoProcessor
from pagedserve.cluster.pixel_storage import own_storage
from pagedserve.cluster.processor_options import (
    MediaList,
    check_processor_kwargs,
    crop_counts,
    options_of,
    pan_and_scan_inputs,
    request_info,
)
from pagedserve.cluster.video import VideoSource, is_video, load_video
from pagedserve.cluster.video_processor import VideoProcessor, frame_fit
from pagedserve.scheduler.multimodal import ImageInput
from pagedserve.worker.video_pixels import VideoPixels


@dataclass(frozen=True)
class PreparedImages(Sequence[Any]):
    """Images already preprocessed: their pixel tensors and content hashes, in order,
    and the request's processor options they were processed under."""

    pixels: list[Any]
    keys: list[str]
    options: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.pixels)

    def __getitem__(self, i: Any) -> Any:
        return self.pixels[i]


class ImagePrompts:
    """Builds image prompts for one multimodal model (``info``: the worker's
    ``model_info()["image"]``) with its tokenizer, at most ``limit`` images (and
    ``video_limit`` videos, where the model takes them: Qwen2-VL) a prompt, pixels in the
    model's ``dtype``; ``processor_kwargs``: vLLM's ``mm_processor_kwargs``
    (``processor_options``)."""

    def __init__(self, model_dir: str, info: dict[str, Any], tokenizer: Any, limit: int,
                 allowed_local_media_path: str | None = None, dtype: str = "float32",
                 video_limit: int = 0, processor_kwargs: dict[str, Any] | None = None,
                 max_model_len: int | None = None) -> None:
        self.tokenizer, self.limit, self.video_limit = tokenizer, limit, video_limit
        self.allowed_local_media_path = allowed_local_media_path
        hf_config = json.loads((Path(model_dir) / "config.json").read_text())
        options = check_processor_kwargs(processor_kwargs, hf_config.get("model_type"))
        self.processor = ImageProcessor.from_model_dir(model_dir, hf_config, options)
        self.processor.check_model(hf_config)
        resize, anyres = self.processor.resize_facts(), self.processor.anyres_facts()
        pas = self.processor.pan_and_scan
        # What the HTTP front needs (``EngineServer.info``): the rule that sizes a
        # picture's run where it varies (Qwen2-VL's resize, LLaVA-NeXT's canvases,
        # Gemma 3's pan-and-scan crops).
        bounds = self.processor.pan_and_scan_bounds
        self.info = {**info, **({"resize": resize} if resize else {}),
                     **({"anyres": anyres} if anyres else {}),
                     **({"pan_and_scan": pas.facts()} if pas else {}),
                     **({"pan_and_scan_bounds": bounds.facts()} if bounds else {}),
                     "max_model_len": max_model_len}
        self.video: VideoProcessor | OnevisionVideoProcessor | None = None
        self.video_token_id = info.get("video_token_id")
        if self.video_token_id is not None and video_limit:
            self.video = OnevisionVideoProcessor.from_model_dir(model_dir, hf_config, options) \
                if info["family"] == "llava_onevision" else VideoProcessor.from_model_dir(
                    model_dir, self.processor.hf, info.get("tokens_per_second"), options)
            self.info["video"] = {**self.video.facts(), "limit": video_limit}
        self.dtype = getattr(torch, dtype)
        self.image_token_id = int(info["image_token_id"])
        self.tokens_per_image = int(info["tokens_per_image"])

    def build(self, prompt: str | list[int], images: Sequence[Any],
              encode: Callable[[str], list[int]]) -> tuple[list[int], tuple[ImageInput, ...]]:
        """Token ids and image inputs of ``prompt`` with ``images`` (any form
        ``multimodal.load_image`` takes). A text prompt marks each image with its marker
        (Gemma 3's begin-of-image token, LLaVA's ``<image>``; ``encode`` tokenises it after
        expansion); token ids hold every image's placeholder run (LLaVA's may hold a lone
        image token). Videos (``is_video``) fill the video placeholder's runs the same
        way. A ``MediaList``'s options (vLLM's per-request ``mm_processor_kwargs``)
        process its pictures. ``ValueError`` names the field."""
        videos = self._check_counts(images)
        info = request_info(self.info, options_of(images))
        if info.get("pan_and_scan"):
            return self._build_views(prompt, images, encode)
        ids = encode(expand_text(self.tokenizer, info, prompt)) \
            if isinstance(prompt, str) else expand_single_markers(list(prompt), info)
        if videos:
            return self._build_media(ids, images)
        spans = image_spans(ids, self.image_token_id)
        prepared = None
        if images and not self.tokens_per_image:  # runs by picture: split them by the counts
            prepared = images if isinstance(images, PreparedImages) else self.prepare(images)
            counts = [self.processor.token_count(p) for p in prepared.pixels]
            spans = split_runs(spans, counts)
        if len(spans) != len(images):
            where = "image markers" if isinstance(prompt, str) \
                else f"runs of image token {self.image_token_id}"
            raise ValueError(f"images: the prompt marks {len(spans)} images ({where}) but "
                             f"{len(images)} were given")
        if self.tokens_per_image:
            for a, b in spans:
                if b - a != self.tokens_per_image:
                    raise ValueError(f"prompt: an image takes {self.tokens_per_image} "
                                     f"placeholder tokens, the run at {a} has {b - a}")
        if not images:
            return ids, ()
        if prepared is None:
            prepared = images if isinstance(images, PreparedImages) else self.prepare(images)
        grids = [self.processor.grid(p) for p in prepared.pixels]
        if not self.tokens_per_image:  # each run as long as its picture makes it
            ids, spans = write_out_runs(ids, spans, counts, self.image_token_id)
        causal = not self.info["bidirectional"]
        return ids, tuple(ImageInput(a, b, key, p, grid, causal) for (a, b), p, key, grid
                          in zip(spans, prepared.pixels, prepared.keys, grids, strict=True))

    def _build_views(self, prompt: str | list[int], images: Sequence[Any],
                     encode: Callable[[str], list[int]]
                     ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """A Gemma 3 prompt under pan-and-scan: a text prompt's markers written out to
        each picture's sentence of runs once its crops are known; token ids as they are
        (their runs the processor's); a run for each view (``pan_and_scan_inputs``)."""
        prepared = images if isinstance(images, PreparedImages) else self.prepare(images)
        ids = list(prompt) if not isinstance(prompt, str) else encode(expand_text(
            self.tokenizer, self.info, prompt, [int(p.shape[0]) - 1 for p in prepared.pixels]))
        runs = image_spans(ids, self.image_token_id)
        return ids, pan_and_scan_inputs(runs, prepared.pixels, prepared.keys,
                                        self.tokens_per_image)

    def chat_prompt(self, messages: list[dict[str, Any]], sources: Sequence[Any],
                    add_generation_prompt: bool, options: dict[str, Any] | None = None,
                    **template: Any) -> tuple[list[int], list[Any]]:
        """``chat_ids`` of rendered ``messages`` whose image parts came out as
        ``sources`` (``multimodal.split_chat_images``), and the sources to hand the
        engine (with ``options``, the request's ``mm_processor_kwargs``: a
        ``MediaList``): under pan-and-scan the pictures are read first, their crop
        counts writing out the runs, and handed on read (not fetched twice)."""
        info = request_info(self.info, options)
        crops = None
        if info.get("pan_and_scan"):
            self._check_counts(sources)
            at = self.allowed_local_media_path
            sources = [load_image(s, allowed_local_media_path=at) for s in sources]
            crops = crop_counts(sources, info)
        ids = chat_ids(self.tokenizer, info, messages, add_generation_prompt, crops, **template)
        return ids, MediaList(sources, options) if options else list(sources)

    def _check_counts(self, items: Sequence[Any]) -> int:
        """``ValueError`` for more images or videos than a prompt may carry, or videos
        for a model without them (before anything is decoded); the video count."""
        videos = sum(1 for x in items if is_video(x))
        if len(items) - videos > self.limit:
            raise ValueError(f"images: at most {self.limit} images a prompt "
                             f"(limit_mm_per_prompt), got {len(items) - videos}")
        if videos and self.video is None:
            why = " (limit_mm_per_prompt has video: 0)" \
                if self.video_token_id is not None else ""
            raise ValueError(f"videos: this model takes no videos{why}")
        if videos > self.video_limit:
            raise ValueError(f"videos: at most {self.video_limit} videos a prompt "
                             f"(limit_mm_per_prompt), got {videos}")
        return videos

    def _build_media(self, ids: list[int], items: Sequence[Any]
                     ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """A prompt with videos (and perhaps images; Qwen2-VL, LLaVA-OneVision): each
        kind's runs written out to its items' token counts; the inputs in prompt order
        (a video's slices on M-RoPE's time axis where the model has one)."""
        prepared = items if isinstance(items, PreparedImages) else self.prepare(items)
        assert self.video is not None  # ``_check_counts`` refused videos for a model without
        kinds = ["video" if isinstance(p, VideoPixels) else "image" for p in prepared.pixels]
        grids = [self.processor.grid(p.frames if isinstance(p, VideoPixels) else p)
                 for p in prepared.pixels]
        times = [p.times if isinstance(p, VideoPixels) and g is not None else (0,)
                 for p, g in zip(prepared.pixels, grids, strict=True)]
        counts = [self.video.token_count(p) if isinstance(p, VideoPixels)
                  else self.processor.token_count(p) for p in prepared.pixels]
        ids, spans = place_media(ids, kinds, counts, {"image": self.image_token_id,
                                                      "video": int(self.video_token_id)})
        inputs = [ImageInput(a, b, key, p, grid, True, t) for (a, b), p, key, grid, t
                  in zip(spans, prepared.pixels, prepared.keys, grids, times, strict=True)]
        return ids, tuple(sorted(inputs, key=lambda i: i.start))

    def prepare(self, images: Sequence[Any]) -> PreparedImages:
        """Load and preprocess ``images`` and videos (the slow part, seconds for a URL:
        the async engine runs it off its event loop and hands ``build`` the result),
        under the request's options where ``images`` is a ``MediaList``."""
        self._check_counts(images)
        options = options_of(images)
        checked = check_processor_kwargs(options, self.info["family"])
        processor = self.processor.variant(checked)
        at = self.allowed_local_media_path
        videos = {i: self._video_pixels(x, checked) for i, x in enumerate(images)
                  if is_video(x)}
        pictures = [load_image(img, allowed_local_media_path=at)
                    for i, img in enumerate(images) if i not in videos]
        if processor.pan_and_scan is not None:  # refused before cutting more than fits
            crop_counts(pictures, {**self.info, "pan_and_scan": processor.pan_and_scan.facts()})
        # In the encoder's dtype already (its first step casts them): a bf16 model's
        # pixels take half the bytes in the request and in every rank's plan.
        processed = iter(p.to(self.dtype) for p in processor(pictures)) \
            if pictures else iter(())
        pixels = [own_storage(videos[i].to(self.dtype) if i in videos else next(processed))
                  for i in range(len(images))]
        return PreparedImages(pixels, [image_hash(p) for p in pixels], options)

    def _video_pixels(self, video: Any, options: dict[str, Any]) -> VideoPixels:
        """A video processed under the request's options, read and sampled first where
        it arrives encoded (frames given are taken as sampled)."""
        if isinstance(video, VideoPixels):
            return video
        assert self.video is not None  # ``_check_counts`` refused videos for a model without
        processor = self.video.variant(options)
        source = video.source if isinstance(video, VideoSource) else video
        clip = load_video(source, processor.sampling,
                          allowed_local_media_path=self.allowed_local_media_path,
                          fit=frame_fit(processor.facts(), self.info.get("max_model_len")))
        return processor(clip)

    def check_text_only(self, ids: Sequence[int]) -> None:
        """A prompt without images may not hold image (or video) placeholders: nothing
        would fill them (Hugging Face refuses the mismatch too)."""
        if self.image_token_id in ids:
            raise ValueError(f"prompt: image placeholder token {self.image_token_id} "
                             "without an image")
        if self.video_token_id is not None and self.video_token_id in ids:
            raise ValueError(f"prompt: video placeholder token {self.video_token_id} "
                             "without a video")
