"""Qwen2-VL's video processor: a sampled clip as the frames and times its encoder takes.

Hugging Face's ``Qwen2VLVideoProcessor`` resizes every frame of a video to one size
(``smart_resize`` of the frame's size within the video's own pixel bounds, 128 x 28^2 to
768 x 28^2 by default), rescales and normalises with CLIP's mean and std, repeats the
last frame up to a multiple of ``temporal_patch_size`` and cuts the result into
``temporal_patch_size``-deep patches. Its resize runs on torchvision; here each frame
goes through the model's image processor on the PIL backend (the resize of HF's
original processors, as pictures do) with the video's bounds, so a frame is resized
as a picture of that size would be, on any host. ``video_preprocessor_config.json``
(transformers 5 saves one beside the image processor's) sets the bounds, mean, std and
sampling; without it, HF's class defaults hold. ``mm_processor_kwargs`` (the engine's,
then a request's: ``processor_options``) move the bounds and the sampling over it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from pagedserve.cluster.processor_options import VIDEO_SAMPLING_KEYS, with_options
from pagedserve.cluster.video import FrameFit, VideoClip, VideoSampling
from pagedserve.worker.video_pixels import VideoPixels, slice_times

# Qwen2VLVideoProcessor's class defaults.
_MIN_PIXELS, _MAX_PIXELS = 128 * 28 * 28, 768 * 28 * 28


class VideoProcessor:
    """Frames of a ``VideoClip`` -> ``VideoPixels`` for a Qwen2-VL / Qwen2.5-VL model.
    ``hf_image`` is the model's PIL image processor (patch, merge and temporal patch
    sizes); ``config`` the video processor's saved fields (may be empty)."""

    def __init__(self, hf_image: Any, config: dict[str, Any],
                 tokens_per_second: float | None) -> None:
        self._config = dict(config)
        size = config.get("size") or {}
        lo = config.get("min_pixels", size.get("shortest_edge", _MIN_PIXELS))
        hi = config.get("max_pixels", size.get("longest_edge", _MAX_PIXELS))
        for name, v in (("min_pixels", lo), ("max_pixels", hi)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"video_preprocessor_config: {name} must be a positive int, "
                                 f"got {v!r}")
        if lo > hi:
            raise ValueError(f"video_preprocessor_config: min_pixels {lo} > max_pixels {hi}")
        self._hf = hf_image
        self.patch, self.merge = int(hf_image.patch_size), int(hf_image.merge_size)
        self.temporal_patch_size = int(config.get("temporal_patch_size",
                                                  hf_image.temporal_patch_size))
        if self.temporal_patch_size != int(hf_image.temporal_patch_size):
            raise ValueError(f"video_preprocessor_config: temporal_patch_size "
                             f"{self.temporal_patch_size} differs from the image "
                             f"processor's {hf_image.temporal_patch_size}")
        self.min_pixels, self.max_pixels = lo, hi
        self.tokens_per_second = tokens_per_second
        self._norm = {k: config[k] for k in ("image_mean", "image_std") if k in config}
        frames = config.get("num_frames")
        self.sampling = VideoSampling(
            fps=float(config.get("fps") or 2.0),
            min_frames=int(config.get("min_frames") or 4),
            max_frames=int(config.get("max_frames") or 768),
            temporal_patch_size=self.temporal_patch_size,
            num_frames=None if frames is None else int(frames))

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, hf_image: Any,
                       tokens_per_second: float | None,
                       options: dict[str, Any] | None = None) -> VideoProcessor:
        """The saved video processor (``video_preprocessor_config.json``, or HF's
        defaults) under checked ``options``."""
        path = Path(model_dir) / "video_preprocessor_config.json"
        config = json.loads(path.read_text()) if path.is_file() else {}
        if not isinstance(config, dict):
            raise ValueError(f"{path.name} is not a JSON object")
        return cls(hf_image, config, tokens_per_second).variant(options or {})

    def variant(self, options: dict[str, Any]) -> VideoProcessor:
        """This processor under checked options over its own fields: the pixel bounds
        and the sampling move; itself where none of them is given."""
        taken = {k: v for k, v in options.items()
                 if k in ("min_pixels", "max_pixels", *VIDEO_SAMPLING_KEYS)}
        if not taken:
            return self
        return VideoProcessor(self._hf, with_options(self._config, taken),
                              self.tokens_per_second)

    def facts(self) -> dict[str, Any]:
        """What a front end needs to count a decoded clip's tokens (``token_count``)."""
        s = self.sampling
        return {"factor": self.patch * self.merge, "min_pixels": self.min_pixels,
                "max_pixels": self.max_pixels, "temporal_patch_size": self.temporal_patch_size,
                "fps": s.fps, "min_frames": s.min_frames, "max_frames": s.max_frames,
                "num_frames": s.num_frames}

    def token_count(self, pixels: VideoPixels) -> int:
        """A processed video's run: its slices of ``rows x cols`` merged patches."""
        _, _, height, width = pixels.frames.shape
        cell = self.patch * self.merge
        return len(pixels.times) * (height // cell) * (width // cell)

    def __call__(self, clip: VideoClip) -> VideoPixels:
        """The clip's frames resized, normalised and padded to whole temporal slices,
        and each slice's M-RoPE time."""
        from pagedserve.worker.models.qwen2_vision_config import patches_to_images

        hf, tp = self._hf, self.temporal_patch_size
        frames = list(clip.frames)
        frames += [frames[-1]] * (-len(frames) % tp)
        out = hf(frames, size={"shortest_edge": self.min_pixels,
                               "longest_edge": self.max_pixels},
                 return_tensors="pt", **self._norm)
        pictures = patches_to_images(out["pixel_values"].float(), out["image_grid_thw"],
                                     self.patch, tp, self.merge)
        seconds = None if self.tokens_per_second is None else tp / clip.fps
        times = slice_times(len(frames) // tp, seconds, self.tokens_per_second or 1.0)
        return VideoPixels(torch.stack(pictures), times)


def sampling_of(facts: dict[str, Any]) -> VideoSampling:
    """The sampling ``facts`` (``VideoProcessor.facts``, ``OnevisionVideoProcessor
    .facts``) describe, for a front end that decodes videos before the replica
    processes them."""
    return VideoSampling(fps=facts["fps"], min_frames=facts["min_frames"],
                         max_frames=facts["max_frames"],
                         temporal_patch_size=facts["temporal_patch_size"],
                         num_frames=facts.get("num_frames"),
                         cap_frames=bool(facts.get("cap_frames")))


def frame_fit(facts: dict[str, Any], limit: int | None = None) -> FrameFit:
    """How a model with these facts (``VideoProcessor.facts``, ``OnevisionVideoProcessor
    .facts``) resizes and counts a video's frames: Qwen2-VL's ``smart_resize`` within
    the frame bounds, its slices of ``rows x cols`` tokens; LLaVA-OneVision's square
    (``tokens_per_frame`` a frame and a newline)."""
    if "tokens_per_frame" in facts:
        side, per_frame = int(facts["size"]), int(facts["tokens_per_frame"])
        return FrameFit(lambda h, w: (side, side), lambda n, h, w: n * per_frame + 1, limit)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    f, tp = int(facts["factor"]), int(facts["temporal_patch_size"])

    def size(height: int, width: int) -> tuple[int, int]:
        return smart_resize(height, width, factor=f, min_pixels=facts["min_pixels"],
                            max_pixels=facts["max_pixels"])

    def tokens(count: int, height: int, width: int) -> int:
        h, w = size(height, width)
        return -(-count // tp) * (h // f) * (w // f)

    return FrameFit(size, tokens, limit)


def video_token_count(clip: VideoClip, facts: dict[str, Any]) -> int:
    """How many tokens a clip becomes: its slices times the tokens of one resized frame
    (Qwen2-VL), or its frames' pooled tokens and a newline (LLaVA-OneVision)."""
    return frame_fit(facts).tokens(len(clip.frames), clip.height, clip.width)
