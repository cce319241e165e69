"""Video inputs: what a user sends, read into the frames the model will see.

A video arrives as a ``video_url`` chat part (a base64 ``data:`` URL, an http(s) URL,
or a local file under ``--allowed-local-media-path``: ``multimodal.read_media``), as
encoded bytes, or offline as frames already chosen (a list of PIL images or a uint8
``[T, H, W, 3]`` array, vLLM's form). Encoded videos are decoded with PyAV (the
``video`` extra) and sampled as Hugging Face's Qwen2-VL video processor samples with
``fps`` set (``sample_frames``): ``fps`` frames a second of the video, at least
``min_frames``, at most ``max_frames``, a multiple of the temporal patch size, spread
evenly; only the chosen frames are converted to pictures, and decoding stops after
the last one. The clip keeps the rate its frames were sampled at, which Qwen2.5-VL's
M-RoPE turns into time (``worker.video_pixels``).
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pagedserve.cluster.multimodal import read_media

if TYPE_CHECKING:
    from PIL import Image

VIDEO_PART_TYPES = ("video_url", "input_video", "video")
DEFAULT_MAX_VIDEO_BYTES = 256 * 2**20
MAX_FRAME_PIXELS = 8192 * 8192  # a frame past this is refused before it is decoded


@dataclass(frozen=True)
class VideoSampling:
    """How frames are taken from an encoded video (HF's Qwen2-VL video processor's
    defaults, ``fps`` as Qwen's own preprocessing uses it); ``num_frames``, where set,
    takes that many instead, whatever the video's length (HF's precedence), or with
    ``cap_frames`` at most that many (a shorter video keeps every frame: LLaVA-OneVision's
    32, as vLLM loads videos for it)."""

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    temporal_patch_size: int = 2
    num_frames: int | None = None
    cap_frames: bool = False

    def __post_init__(self) -> None:
        if self.num_frames is not None and self.num_frames < 1:
            raise ValueError(f"video num_frames must be positive, got {self.num_frames}")
        if not self.fps > 0:
            raise ValueError(f"video fps must be positive, got {self.fps}")
        if not 1 <= self.min_frames <= self.max_frames:
            raise ValueError(f"video min_frames / max_frames must satisfy 1 <= min <= max, "
                             f"got {self.min_frames} / {self.max_frames}")
        if self.temporal_patch_size < 1:
            raise ValueError(f"temporal_patch_size must be positive, got "
                             f"{self.temporal_patch_size}")

    def indices(self, total: int, video_fps: float) -> list[int]:
        """The frames to keep of ``total`` at ``video_fps``: HF's ``sample_frames`` with
        ``fps`` (a video shorter than one temporal patch keeps every frame; its last is
        repeated when the frames are grouped); with ``num_frames``, that many rounded to
        whole temporal patches, spread evenly (``ValueError`` past the video's frames)."""
        tp = self.temporal_patch_size
        if self.num_frames is not None:
            count = round(self.num_frames / tp) * tp
            if self.cap_frames:
                count = min(count, total // tp * tp)
            if not 0 < count <= total:
                raise ValueError(f"video_url: num_frames {self.num_frames} is {count} frames "
                                 f"in whole temporal patches of {tp}; the video has {total}")
            return torch.arange(0, total, total / count).int().tolist()
        most = math.floor(min(self.max_frames, total) / tp) * tp
        wanted = min(max(total / video_fps * self.fps, self.min_frames), most, total)
        count = math.floor(wanted / tp) * tp
        if count <= 0:
            return list(range(total))
        return torch.arange(0, total, total / count).int().tolist()


@dataclass(frozen=True)
class FrameFit:
    """What the model makes of a video's frames, known from the stream's size before
    any frame is decoded: ``size`` maps a frame's ``(height, width)`` to the size its
    processor resizes it to (``resample``: PIL's filter, the processor's), and
    ``tokens`` the run ``(frames, height, width)`` becomes. Decoding resizes each kept
    frame at once, so a long high-resolution video never sits in memory at its own
    size (the processor's own resize is then the identity: the same pixels), and a
    video whose run passes ``limit`` tokens is refused before it is decoded."""

    size: Callable[[int, int], tuple[int, int]]
    tokens: Callable[[int, int, int], int]
    limit: int | None = None
    resample: int = 3  # PIL's BICUBIC, Qwen2-VL's and LLaVA-OneVision's


@dataclass(frozen=True)
class VideoClip:
    """A video's chosen frames (RGB PIL images, one size) and the rate, in frames per
    second of the original, that they were taken at."""

    frames: tuple[Image.Image, ...]
    fps: float

    def __post_init__(self) -> None:
        if not self.frames:
            raise ValueError("video_url: the video has no frames")
        sizes = {f.size for f in self.frames}
        if len(sizes) != 1:
            raise ValueError(f"video_url: frames of several sizes {sorted(sizes)}")
        if not self.fps > 0:
            raise ValueError(f"video fps must be positive, got {self.fps}")

    @property
    def width(self) -> int:
        return self.frames[0].size[0]

    @property
    def height(self) -> int:
        return self.frames[0].size[1]


@dataclass(frozen=True)
class VideoSource:
    """A video not yet read, among a prompt's images (``multi_modal_data["video"]``):
    whatever ``load_video`` takes."""

    source: Any


def is_video(item: Any) -> bool:
    """Whether an item of a prompt's media list is a video (a clip, a source, or its
    processed frames), not a picture."""
    from pagedserve.worker.video_pixels import VideoPixels

    return isinstance(item, VideoClip | VideoSource | VideoPixels)


def load_video(source: Any, sampling: VideoSampling, *,
               allowed_local_media_path: str | None = None, fetch_timeout_s: float = 30.0,
               max_bytes: int = DEFAULT_MAX_VIDEO_BYTES, fit: FrameFit | None = None
               ) -> VideoClip:
    """One user-supplied video as a ``VideoClip``: a clip as it is; frames (PIL images,
    or a uint8 ``[T, H, W, 3]`` array / tensor, taken as sampled already, at
    ``sampling.fps``); encoded bytes or a URL, decoded and sampled (its frames resized
    and its run bounded by ``fit``). Every failure is a ``ValueError`` naming
    ``video_url`` (a 400 at the HTTP front)."""
    if isinstance(source, VideoClip):
        return source
    if isinstance(source, str):
        source = read_media(source, "video_url", allowed_local_media_path=allowed_local_media_path,
                            fetch_timeout_s=fetch_timeout_s, max_bytes=max_bytes)
    if isinstance(source, bytes | bytearray | memoryview):
        if len(source) > max_bytes:
            raise ValueError(f"video_url: video is {len(source)} bytes, over the "
                             f"{max_bytes}-byte limit")
        return decode_video(bytes(source), sampling, fit)
    return VideoClip(_frames(source), sampling.fps)


def _frames(source: Any) -> tuple[Image.Image, ...]:
    """Frames given as PIL images or a uint8 ``[T, H, W, 3]`` array, as RGB pictures."""
    from PIL import Image

    from pagedserve.cluster.multimodal import load_image

    if isinstance(source, Sequence) and source and all(isinstance(f, Image.Image)
                                                        for f in source):
        return tuple(load_image(f) for f in source)
    try:
        if not hasattr(source, "__len__"):
            raise TypeError
        array = torch.as_tensor(source)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"video_url: expected a URL, bytes, PIL frames or a [T, H, W, 3] "
                         f"array, got {type(source).__name__}") from None
    if array.dim() != 4 or array.shape[-1] != 3 or array.dtype != torch.uint8 \
            or 0 in array.shape:
        raise ValueError(f"video_url: frames must be uint8 [T, H, W, 3], got "
                         f"{array.dtype} {tuple(array.shape)}")
    return tuple(Image.fromarray(f.numpy(), "RGB") for f in array.cpu())


def decode_video(data: bytes, sampling: VideoSampling, fit: FrameFit | None = None
                 ) -> VideoClip:
    """Decode and sample an encoded video (any container and codec FFmpeg reads); with
    ``fit``, each kept frame resized as its processor will, and a run past its limit
    refused before decoding."""
    try:
        import av
    except ImportError:
        raise ValueError("video_url: decoding videos needs PyAV (pip install "
                         "'pagedserve[video]')") from None
    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise ValueError("video_url: the file holds no video stream")
            stream = container.streams.video[0]
            if stream.width * stream.height > MAX_FRAME_PIXELS:
                raise ValueError(f"video_url: frames of {stream.width} x {stream.height} "
                                 f"pixels, over the {MAX_FRAME_PIXELS}-pixel limit")
            rate = float(stream.average_rate or stream.guessed_rate or 0) or 24.0
            total = stream.frames or _counted_frames(data)
            if total <= 0:
                raise ValueError("video_url: the video has no frames")
            wanted = sampling.indices(total, rate)
            target = _check_fit(fit, len(wanted), stream.height, stream.width)
            picked = set(wanted)
            frames: list[Image.Image] = []
            for i, frame in enumerate(container.decode(stream)):
                if i in picked:
                    image = frame.to_image().convert("RGB")
                    if fit is not None and image.size != target:
                        image = image.resize(target, resample=fit.resample)
                    frames.append(image)
                if i >= wanted[-1]:
                    break
    except av.FFmpegError as exc:  # (some are ValueErrors too: caught first)
        raise ValueError(f"video_url: not a decodable video ({type(exc).__name__}: "
                         f"{exc})") from None
    except ValueError:  # ours, naming video_url already
        raise
    except Exception as exc:  # a broken stream PyAV reports otherwise
        raise ValueError(f"video_url: not a decodable video ({type(exc).__name__}: "
                         f"{exc})") from None
    if not frames:
        raise ValueError("video_url: the video has no decodable frames")
    return VideoClip(tuple(frames), len(frames) / total * rate)


def _check_fit(fit: FrameFit | None, count: int, height: int, width: int
               ) -> tuple[int, int] | None:
    """The ``(width, height)`` each kept frame is resized to; ``ValueError`` where the
    video's run would pass the fit's limit."""
    if fit is None:
        return None
    run = fit.tokens(count, height, width)
    if fit.limit is not None and run > fit.limit:
        raise ValueError(f"video_url: {count} frames of {width} x {height} make {run} "
                         f"tokens, over the model's context of {fit.limit} (fewer frames: "
                         "mm_processor_kwargs num_frames or fps)")
    h, w = fit.size(height, width)
    return w, h


def _counted_frames(data: bytes) -> int:
    """A stream's frame count where the container does not record it: counted by
    demuxing (packets, not decoded pictures)."""
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        return sum(1 for p in container.demux(stream) if p.size)
