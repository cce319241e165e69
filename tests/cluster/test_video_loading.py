"""Reading videos: frame sampling as Hugging Face's Qwen2-VL ``sample_frames`` with
``fps``, PyAV decoding of MP4 (frame count in the container) and WebM (counted by
demuxing), frames given directly, and refusals that name ``video_url``."""

from __future__ import annotations

import io

import pytest
import torch

from pagedserve.cluster.video import VideoClip, VideoSampling, decode_video, load_video
from pagedserve.worker.testing import random_picture

av = pytest.importorskip("av")


def hf_sample_frames(total: int, video_fps: float, fps: float, min_frames: int,
                     max_frames: int, tp: int) -> list[int]:
    """transformers 5's ``Qwen2VLVideoProcessor.sample_frames`` with ``fps`` (its module
    needs torchvision to import; these are its lines)."""
    import math

    max_frames = math.floor(min(max_frames, total) / tp) * tp
    num_frames = total / video_fps * fps
    num_frames = min(max(num_frames, min_frames), max_frames, total)
    num_frames = math.floor(num_frames / tp) * tp
    return torch.arange(0, total, total / num_frames).int().tolist()


@pytest.mark.parametrize("total, rate, fps, lo, hi", [
    (15, 5.0, 2.0, 4, 768, ), (300, 30.0, 2.0, 4, 768), (300, 30.0, 2.0, 4, 8),
    (9, 30.0, 2.0, 4, 768), (1000, 24.0, 1.0, 4, 16), (7, 7.0, 0.5, 2, 768)])
def test_sampling_equals_hugging_faces(total: int, rate: float, fps: float, lo: int,
                                       hi: int) -> None:
    got = VideoSampling(fps=fps, min_frames=lo, max_frames=hi).indices(total, rate)
    assert got == hf_sample_frames(total, rate, fps, lo, hi, 2)
    assert len(got) % 2 == 0 and len(got) <= hi


def hf_sample_count(total: int, num_frames: int, tp: int) -> list[int]:
    """``sample_frames`` with ``num_frames`` (its lines, as above)."""
    num_frames = round(num_frames / tp) * tp
    return torch.arange(0, total, total / num_frames).int().tolist()


@pytest.mark.parametrize("total, count", [(15, 4), (15, 5), (15, 3), (300, 16), (8, 8),
                                          (9, 7), (1000, 768)])
def test_a_frame_count_samples_as_hugging_faces(total: int, count: int) -> None:
    """``num_frames`` rounds to whole temporal patches (Python's rounding, as HF's) and
    wins over the rate and frame bounds, as in HF."""
    got = VideoSampling(fps=0.1, max_frames=4, num_frames=count).indices(total, 30.0)
    assert got == hf_sample_count(total, count, 2) and len(got) % 2 == 0


@pytest.mark.parametrize("count, match", [(1, "num_frames 1 is 0 frames"),
                                          (11, r"num_frames 11 is 12 frames .* the video has 8")])
def test_a_frame_count_the_video_cannot_give_is_refused(count: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        VideoSampling(num_frames=count).indices(8, 30.0)
    with pytest.raises(ValueError, match="num_frames must be positive"):
        VideoSampling(num_frames=0)


def test_a_frame_cap_keeps_a_shorter_video_whole() -> None:
    """LLaVA-OneVision's default: at most 32 frames; a shorter video keeps them all."""
    cap = VideoSampling(num_frames=32, temporal_patch_size=1, cap_frames=True)
    assert cap.indices(10, 30.0) == list(range(10))
    assert cap.indices(40, 30.0) == hf_sample_count(40, 32, 1)


def test_a_video_shorter_than_a_temporal_patch_keeps_its_frame() -> None:
    assert VideoSampling().indices(1, 30.0) == [0]


@pytest.mark.parametrize("container", ["mp4", "webm"])
def test_decoding_keeps_only_the_sampled_frames(container: str) -> None:
    from pagedserve.worker.testing_qwen_vl import video_bytes

    data = video_bytes(3, frames=30, fps=10, size=(48, 32), container=container)
    clip = decode_video(data, VideoSampling(fps=2.0))
    with av.open(io.BytesIO(data)) as c:
        every = [f.to_image() for f in c.decode(video=0)]
    want = hf_sample_frames(30, 10.0, 2.0, 4, 768, 2)
    assert [f.tobytes() for f in clip.frames] == [every[i].tobytes() for i in want]
    assert clip.fps == pytest.approx(len(want) / 30 * 10) and (clip.width, clip.height) == (48, 32)


def test_frames_given_directly_are_taken_as_sampled() -> None:
    frames = torch.randint(0, 256, (3, 8, 10, 3), dtype=torch.uint8)
    clip = load_video(frames, VideoSampling(fps=1.5))
    assert len(clip.frames) == 3 and clip.fps == 1.5 and clip.frames[0].size == (10, 8)
    assert torch.equal(torch.as_tensor(list(clip.frames[1].getdata())).view(8, 10, 3),
                       frames[1])
    pictures = [random_picture(i, (12, 6)) for i in range(2)]
    assert load_video(pictures, VideoSampling()).frames[1].tobytes() == pictures[1].tobytes()


@pytest.mark.parametrize("source, match", [
    (b"\x00" * 64, "video_url: not a decodable video"),
    ("ftp://x/y.mp4", "video_url: unsupported URL scheme"),
    ("file:///etc/passwd", "video_url: local files are refused"),
    (torch.zeros(2, 4, 4), r"video_url: frames must be uint8 \[T, H, W, 3\]"),
    (torch.zeros(0, 4, 4, 3, dtype=torch.uint8), "frames must be uint8"),
    (3.5, "video_url: expected a URL, bytes, PIL frames"),
])
def test_bad_videos_name_video_url(source: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_video(source, VideoSampling())


def test_an_audio_only_file_and_mixed_frame_sizes_are_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    buf = io.BytesIO()
    with av.open(buf, "w", format="wav") as out:
        stream = out.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(torch.zeros(1, 800, dtype=torch.int16).numpy(),
                                           format="s16", layout="mono")
        frame.sample_rate = 8000
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    with pytest.raises(ValueError, match="video_url: the file holds no video stream"):
        decode_video(buf.getvalue(), VideoSampling())
    with pytest.raises(ValueError, match="frames of several sizes"):
        VideoClip((random_picture(1, (8, 8)), random_picture(2, (8, 6))), 2.0)
    with pytest.raises(ValueError, match="video fps must be positive"):
        VideoSampling(fps=0)
    from pagedserve.worker.testing_qwen_vl import video_bytes

    with pytest.raises(ValueError, match=r"frames of 48 x 32 pixels, over the 100-pixel"):
        monkeypatch.setattr("pagedserve.cluster.video.MAX_FRAME_PIXELS", 100)
        decode_video(video_bytes(1, frames=2, fps=2, size=(48, 32)), VideoSampling())
    with pytest.raises(ValueError, match="over the 10-byte limit"):
        load_video(b"x" * 11, VideoSampling(), max_bytes=10)


def test_frames_resized_as_decoded_process_to_the_same_pixels() -> None:
    """A frame resized at decode to the size its processor picks (Qwen2-VL's
    ``smart_resize`` within the bounds) gives the processor's own pixels (its resize
    is then the identity); a run past the fit's limit is refused before decoding."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from pagedserve.cluster.video_processor import VideoProcessor, frame_fit
    from pagedserve.worker.testing_qwen_vl import video_bytes

    data = video_bytes(3, frames=6, fps=3, size=(200, 150))
    proc = VideoProcessor(Qwen2VLImageProcessorPil(patch_size=7, merge_size=2),
                          {"size": {"shortest_edge": 196, "longest_edge": 112 * 112}}, None)
    sampling = VideoSampling(fps=3.0, min_frames=2, max_frames=16)
    full = decode_video(data, sampling)
    small = decode_video(data, sampling, frame_fit(proc.facts()))
    assert full.frames[0].size == (200, 150) and small.frames[0].size == (126, 84)
    a, b = proc(full), proc(small)
    assert torch.equal(a.frames, b.frames) and a.times == b.times
    with pytest.raises(ValueError, match=r"6 frames of 200 x 150 make 162 tokens, over the "
                                         r"model's context of 100"):
        decode_video(data, sampling, frame_fit(proc.facts(), 100))
