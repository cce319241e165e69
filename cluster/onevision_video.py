"""LLaVA-OneVision's video processor: a sampled clip as the frames its tower takes.

Hugging Face's ``LlavaOnevisionVideoProcessor`` resizes every frame to the tower's
square (bicubic), rescales it by 1/255 and normalises it with CLIP's mean and std; the
model pools each frame's ``P x P`` features to ``ceil(P / 2)`` a side and closes the
video with one newline (``LlavaNextVisionEncoder.encode_video``), so a video of ``F``
frames is ``F * ceil(P / 2)^2 + 1`` tokens. HF's processor takes every frame it is
given; an encoded video is sampled here to at most 32 frames spread evenly (vLLM's
default for its video loader), which ``mm_processor_kwargs`` (``num_frames``, or
``fps`` with ``min_frames`` / ``max_frames``) change. Frames are resized by PIL, as
pictures are: HF's video processor resizes with torchvision, which is not a
dependency here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedserve.cluster.processor_options import VIDEO_SAMPLING_KEYS, with_options
from pagedserve.cluster.video import VideoClip, VideoSampling
from pagedserve.worker.video_pixels import VideoPixels

DEFAULT_FRAMES = 32


class OnevisionVideoProcessor:
    """Frames of a ``VideoClip`` -> ``VideoPixels`` (``[F, 3, S, S]``) for a
    LLaVA-OneVision model; ``config``: the video processor's saved fields (may be
    empty), ``image_size`` / ``patch_size``: the tower's."""

    def __init__(self, config: dict[str, Any], image_size: int, patch_size: int) -> None:
        from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

        self._config, self._tower = dict(config), (image_size, patch_size)
        size = config.get("size") or {}
        self.height = int(size.get("height") or image_size)
        self.width = int(size.get("width") or image_size)
        if (self.height, self.width) != (image_size, image_size):
            raise ValueError(f"video_preprocessor_config: size {self.height} x {self.width} "
                             f"is not the tower's {image_size} x {image_size}")
        self.mean = np.asarray(config.get("image_mean") or OPENAI_CLIP_MEAN, dtype=np.float32)
        self.std = np.asarray(config.get("image_std") or OPENAI_CLIP_STD, dtype=np.float32)
        side = -(-(image_size // patch_size) // 2)
        self.tokens_per_frame = side * side
        frames = config.get("num_frames", DEFAULT_FRAMES)
        self.sampling = VideoSampling(
            fps=float(config.get("fps") or 2.0), min_frames=int(config.get("min_frames") or 1),
            max_frames=int(config.get("max_frames") or DEFAULT_FRAMES), temporal_patch_size=1,
            num_frames=None if frames is None else int(frames), cap_frames=True)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, hf_config: dict[str, Any],
                       options: dict[str, Any] | None = None) -> OnevisionVideoProcessor:
        """The saved video processor (``video_preprocessor_config.json``, or HF's
        defaults at the tower's size) under checked ``options``."""
        path = Path(model_dir) / "video_preprocessor_config.json"
        config = json.loads(path.read_text()) if path.is_file() else {}
        if not isinstance(config, dict):
            raise ValueError(f"{path.name} is not a JSON object")
        config = {k: v for k, v in config.items() if v is not None}  # null: the default
        vision = hf_config.get("vision_config") or {}
        return cls(config, int(vision.get("image_size", 384)),
                   int(vision.get("patch_size", 14))).variant(options or {})

    def variant(self, options: dict[str, Any]) -> OnevisionVideoProcessor:
        """This processor under checked options: the sampling moves; itself where none
        of its keys is given."""
        taken = {k: v for k, v in options.items() if k in VIDEO_SAMPLING_KEYS}
        if not taken:
            return self
        return OnevisionVideoProcessor(with_options(self._config, taken), *self._tower)

    def facts(self) -> dict[str, Any]:
        """What a front end needs to sample a video and count its run
        (``video_processor.sampling_of``, ``video_token_count``)."""
        s = self.sampling
        return {"tokens_per_frame": self.tokens_per_frame, "size": self.height,
                "temporal_patch_size": 1,
                "fps": s.fps, "min_frames": s.min_frames, "max_frames": s.max_frames,
                "num_frames": s.num_frames, "cap_frames": True}

    def token_count(self, pixels: VideoPixels) -> int:
        return int(pixels.frames.shape[0]) * self.tokens_per_frame + 1

    def __call__(self, clip: VideoClip) -> VideoPixels:
        """Each frame resized to the tower's square (bicubic), rescaled and normalised
        as HF's processors do (rescale in float64, then float32)."""
        from PIL import Image

        frames = []
        for frame in clip.frames:
            pixels = np.asarray(frame.resize((self.width, self.height),
                                             Image.Resampling.BICUBIC))
            x = (pixels.astype(np.float64) * (1 / 255)).astype(np.float32)
            frames.append(torch.from_numpy(((x - self.mean) / self.std).transpose(2, 0, 1)))
        return VideoPixels(torch.stack(frames), (0,))
