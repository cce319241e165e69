"""Qwen2-VL and Qwen2.5-VL with videos through the engine: greedy tokens equal Hugging
Face's ``generate`` on random checkpoints fed the same frames as ``pixel_values_videos``
(a video's temporal slices, its M-RoPE times: Qwen2.5-VL's scaled by seconds a slice and
``tokens_per_second``), alone, beside a picture, in chunks that cut the video, and as a
prefix-cache hit; an encoded MP4 / WebM is sampled at the processor's rate; the chat API
takes ``video_url`` parts; bad videos and mismatched runs are refused naming the field,
with every block back in the pool."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest
import torch

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.cluster.video import VideoClip, VideoSource
from pagedserve.worker.testing import random_picture
from pagedserve.worker.testing_qwen_vl import video_bytes, write_random_qwen2_vl
from tests.cluster.test_engine_behaviour import assert_pool_at_baseline

pytest.importorskip("av")

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
START, END, PAD, VPAD = 297, 298, 299, 292
P, M, TP = 7, 2, 2


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def qwen_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Qwen2.5-VL at 7 tokens a second: a clip at 4 frames a second spans 0.5 s a slice,
    so its slices sit at times 0, 3, 7 (HF's truncation of 0, 3.5, 7)."""
    vision = {"tokens_per_second": 7} if request.param == "qwen2_5_vl" else None
    return write_random_qwen2_vl(tmp_path_factory.mktemp(request.param), request.param,
                                 vision_config=vision)


def clip(seed: int, frames: int = 6, size: tuple[int, int] = (112, 112)) -> VideoClip:
    """Random frames, taken at 4 a second (112 x 112: 8 x 8 tokens a slice)."""
    return VideoClip(tuple(random_picture(seed + i, size) for i in range(frames)), 4.0)


def hf_video_inputs(model_dir: str, video: VideoClip, size: dict | None = None
                    ) -> dict[str, torch.Tensor]:
    """HF's video inputs for ``video``: each frame as the image processor resizes it
    within the video bounds (``size``: other bounds), patched as HF's video processor
    patches."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from pagedserve.worker.models.qwen2_vision_config import patches_to_images

    bounds = size or json.loads(
        (Path(model_dir) / "video_preprocessor_config.json").read_text())["size"]
    proc = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    frames = list(video.frames) + [video.frames[-1]] * (len(video.frames) % TP)
    out = proc(frames, size=bounds, return_tensors="pt")
    x = torch.stack(patches_to_images(out["pixel_values"], out["image_grid_thw"], P, TP, M))
    t, c, h, w = x.shape
    x = x.reshape(1, t // TP, TP, c, h // P // M, M, P, w // P // M, M, P)
    x = x.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9).reshape(-1, c * TP * P * P)
    return {"pixel_values_videos": x,
            "video_grid_thw": torch.tensor([[t // TP, h // P, w // P]]),
            "second_per_grid_ts": torch.tensor([TP / video.fps])}


def hf_reference(model_dir: str, ids: list[int], video: VideoClip, picture=None,
                 size: dict | None = None) -> tuple[list[int], list[float]]:
    """HF's greedy tokens and each one's log-probability (of the raw logits)."""
    import transformers as tf
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    model = tf.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    x = torch.tensor([ids])
    kw = hf_video_inputs(model_dir, video, size)
    if "qwen2_5" not in model.config.model_type:
        kw.pop("second_per_grid_ts")
    if picture is not None:
        px = Qwen2VLImageProcessorPil.from_pretrained(model_dir)([picture], return_tensors="pt")
        kw.update(pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"])
    types = (x == PAD).int() + 2 * (x == VPAD).int()
    with torch.inference_mode():
        y = model.eval().generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                  max_new_tokens=GREEDY.max_tokens,
                                  min_new_tokens=GREEDY.max_tokens, pad_token_id=0,
                                  mm_token_type_ids=types, output_logits=True,
                                  return_dict_in_generate=True, **kw)
    out = y.sequences[0, len(ids):].tolist()
    return out, [float(torch.log_softmax(step[0].float(), -1)[t])
                 for step, t in zip(y.logits, out, strict=True)]


def video_run(slices: int, rows: int = 8, cols: int = 8) -> list[int]:
    return [START] + [VPAD] * (slices * rows * cols) + [END]


def tokens(llm: LLM, ids: list[int], **media) -> tuple[list[int], list[float]]:
    out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": media}, GREEDY)
    seq = out[0].outputs[0]
    return seq.token_ids, [lp[t] for lp, t in zip(seq.logprobs, seq.token_ids, strict=True)]


def assert_same(got: tuple[list[int], list[float]], want: tuple[list[int], list[float]]
                ) -> None:
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=2e-4)


@pytest.mark.parametrize("kw", [dict(), dict(max_num_batched_tokens=16, max_num_seqs=2)],
                         ids=["whole", "chunked"])
def test_a_video_equals_hugging_face(qwen_dir: str, kw: dict) -> None:
    video = clip(1)
    ids = [5, 6, *video_run(3), 8, 9, 10]
    want = hf_reference(qwen_dir, ids, video)
    llm = LLM(model=qwen_dir, num_gpu_blocks=64, **kw)
    try:
        assert_same(tokens(llm, ids, video=video), want)
        lone = [5, 6, START, VPAD, END, 8, 9, 10]  # a lone placeholder is written out
        assert_same(tokens(llm, lone, video=video), want)
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_a_video_beside_a_picture_equals_hugging_face(qwen_dir: str) -> None:
    """A picture (2 x 3 tokens) then a video in one prompt: each fills its own kind's
    run whatever order they are given in."""
    video, pic = clip(7), random_picture(8, (40, 30))
    ids = [5, START, *[PAD] * 6, END, 6, *video_run(3), 8, 9]
    want = hf_reference(qwen_dir, ids, video, pic)
    llm = LLM(model=qwen_dir, num_gpu_blocks=64, max_num_batched_tokens=40)
    try:
        assert_same(tokens(llm, ids, image=pic, video=video), want)
        lone = [5, START, PAD, END, 6, START, VPAD, END, 8, 9]
        out = llm.generate({"prompt_token_ids": lone,
                            "multi_modal_data": {"video": video, "image": [pic]}}, GREEDY)[0]
        assert out.prompt_token_ids == ids and out.outputs[0].token_ids == want[0]
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_the_same_video_hits_the_prefix_cache_and_is_encoded_once(qwen_dir: str) -> None:
    """The same clip again: every whole block is a hit and the encoder does not run;
    the same frames at another rate (other times on Qwen2.5-VL) or other frames miss."""
    llm = LLM(model=qwen_dir, num_gpu_blocks=128, block_size=4)
    try:
        vision = llm.engine.executor.worker.model.vision
        encoded: list[int] = []
        encode = vision.encode_video
        vision.encode_video = lambda f: encoded.append(1) or encode(f)
        ids = [5, 6, *video_run(3), 8]
        first = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"video": clip(1)}},
                             GREEDY)[0]
        again = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"video": clip(1)}},
                             GREEDY)[0]
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        assert again.num_cached_tokens == (len(ids) - 1) // 4 * 4 and encoded == [1]
        other = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"video": clip(2)}},
                             GREEDY)[0]
        assert other.num_cached_tokens == 0 and encoded == [1, 1]  # block 0 holds the video
        slower = VideoClip(clip(1).frames, 2.0)
        out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"video": slower}},
                           GREEDY)[0]
        rescaled = "qwen2_5" in qwen_dir
        assert out.num_cached_tokens == (0 if rescaled else (len(ids) - 1) // 4 * 4)
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("container", ["mp4", "webm"])
def test_an_encoded_video_is_sampled_at_the_processor_rate(qwen_dir: str,
                                                           container: str) -> None:
    """15 frames at 5 a second (3 s) sampled at 2 a second: frames 0, 2, 5, 7, 10, 12
    (HF's ``sample_frames``), so three slices a second apart; the bytes, a data URL in a
    chat and the decoded clip give the same tokens."""
    import av

    from pagedserve.cluster.video import VideoSampling, load_video

    data = video_bytes(4, frames=15, fps=5, size=(112, 112), container=container)
    sampling = VideoSampling(fps=2.0, min_frames=2, max_frames=16)
    decoded = load_video(data, sampling)
    assert decoded.fps == pytest.approx(2.0) and len(decoded.frames) == 6
    with av.open(io.BytesIO(data)) as c:
        every = [f.to_image() for f in c.decode(video=0)]
    assert [f.tobytes() for f in decoded.frames] == \
        [every[i].tobytes() for i in (0, 2, 5, 7, 10, 12)]
    llm = LLM(model=qwen_dir, num_gpu_blocks=64)
    try:
        ids = [5, *video_run(3), 8]
        want = tokens(llm, ids, video=decoded)
        assert_same(tokens(llm, ids, video=data), want)
        url = f"data:video/{container};base64," + base64.b64encode(data).decode()
        chat = llm.chat([{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": url}},
            {"type": "text", "text": "t5 t6"}]}], GREEDY)[0]
        assert chat.prompt_token_ids == [293, 295, *video_run(3), 5, 6, 294, 293, 296]
        if "qwen2_5" not in qwen_dir:  # HF's positions after a video longer than its grid
            assert_same(tokens(llm, ids, video=data), hf_reference(qwen_dir, ids, decoded))
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_sampling_and_frame_bounds_from_mm_processor_kwargs(qwen_dir: str) -> None:
    """vLLM's ``mm_processor_kwargs`` for videos, for the engine or one request: 15
    frames at 5 a second give frames 0, 3, 7, 11 under ``num_frames: 4`` (HF's
    ``sample_frames``) and 0, 7 under ``fps: 1``; a request's rate replaces the
    engine's count; ``max_pixels`` shrinks every frame (8 x 8 tokens to 4 x 4). Each
    equals the same frames given as a clip (and HF's tokens for the shrunk one)."""
    import av

    data = video_bytes(4, frames=15, fps=5, size=(112, 112))
    with av.open(io.BytesIO(data)) as c:
        every = [f.to_image() for f in c.decode(video=0)]

    def picked(*frames: int) -> VideoClip:
        return VideoClip(tuple(every[i] for i in frames), len(frames) / 15 * 5)

    lone = [5, START, VPAD, END, 8]
    small = {"max_pixels": 56 * 56}

    def run(llm: LLM, options: dict | None, video=data) -> tuple[list[int], tuple]:
        out = llm.generate({"prompt_token_ids": lone, "multi_modal_data": {"video": video},
                            "mm_processor_kwargs": options}, GREEDY)[0]
        seq = out.outputs[0]
        return out.prompt_token_ids, (seq.token_ids, [lp[t] for lp, t in zip(
            seq.logprobs, seq.token_ids, strict=True)])

    llm = LLM(model=qwen_dir, num_gpu_blocks=64)
    try:
        ids, got = run(llm, {"num_frames": 4})
        assert ids == [5, *video_run(2), 8]
        assert_same(got, tokens(llm, ids, video=picked(0, 3, 7, 11)))
        ids, got = run(llm, {"fps": 1.0})
        assert ids == [5, *video_run(1), 8]
        assert_same(got, tokens(llm, ids, video=picked(0, 7)))
        ids, got = run(llm, small)
        assert ids == [5, *video_run(3, 4, 4), 8]
        clip6 = picked(0, 2, 5, 7, 10, 12)
        assert_same(got, run(llm, small, clip6)[1])
        if "qwen2_5" not in qwen_dir:
            assert_same(got, hf_reference(qwen_dir, ids, clip6, size={
                "shortest_edge": 14 * 14, "longest_edge": 56 * 56}))
        with pytest.raises(ValueError, match="num_frames 40 is 40 frames"):
            run(llm, {"num_frames": 40})
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()
    counted = LLM(model=qwen_dir, num_gpu_blocks=64, mm_processor_kwargs={"num_frames": 4})
    try:
        assert run(counted, None)[0] == [5, *video_run(2), 8]
        assert run(counted, {"fps": 2.0})[0] == [5, *video_run(3), 8]
    finally:
        counted.shutdown()


def test_bad_videos_are_refused_naming_the_field(qwen_dir: str, tmp_path: Path) -> None:
    llm = LLM(model=qwen_dir, num_gpu_blocks=64, limit_mm_per_prompt={"video": 1})
    try:
        ids = [5, START, VPAD, END]
        bad = [
            ({"prompt_token_ids": ids, "multi_modal_data": {"video": b"not a video"}},
             "video_url: not a decodable video"),
            ({"prompt_token_ids": ids, "multi_modal_data": {"video": "data:video/mp4,xx"}},
             "video_url: data URL must be base64"),
            ({"prompt_token_ids": ids, "multi_modal_data": {"video": str(tmp_path / "a.mp4")}},
             "video_url: local files are refused"),
            ({"prompt_token_ids": ids, "multi_modal_data": {"video": [clip(1), clip(2)]}},
             "at most 1 videos"),
            ({"prompt_token_ids": [5, START, VPAD, VPAD, END],
              "multi_modal_data": {"video": clip(1)}}, "video at 2 takes 192"),
            ({"prompt_token_ids": [5, START, PAD, END], "multi_modal_data": {"video": clip(1)}},
             "marks 1 images .* but 0 were given"),
            ({"prompt_token_ids": [5, START, VPAD, END], "multi_modal_data": {"image": clip(1).frames[0]}},
             "marks 0 images"),
            ({"prompt_token_ids": [5, VPAD, 6]}, "without a video"),
            ({"prompt_token_ids": ids, "multi_modal_data": {"video": torch.zeros(2, 8, 8)}},
             r"frames must be uint8 \[T, H, W, 3\]"),
            ({"prompt_token_ids": ids, "multi_modal_data": {"audio": b""}}, "multi_modal_data"),
        ]
        for prompt, match in bad:
            with pytest.raises(ValueError, match=match):
                llm.generate(prompt, GREEDY)
        with pytest.raises(ValueError, match="at most 1 videos"):  # before decoding any
            llm.engine.images.prepare([VideoSource(b"x"), VideoSource(b"y")])
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()
    off = LLM(model=qwen_dir, num_gpu_blocks=64, limit_mm_per_prompt={"video": 0})
    try:
        with pytest.raises(ValueError, match=r"takes no videos \(limit_mm_per_prompt"):
            off.generate({"prompt_token_ids": ids, "multi_modal_data": {"video": clip(1)}})
    finally:
        off.shutdown()


def test_a_model_without_videos_refuses_one(tmp_path: Path) -> None:
    from pagedserve.worker.testing import write_random_llava

    llm = LLM(model=write_random_llava(tmp_path / "llava"), num_gpu_blocks=32)
    try:
        with pytest.raises(ValueError, match="videos: this model takes no videos"):
            llm.generate({"prompt_token_ids": [5, 6], "multi_modal_data": {"video": clip(1)}})
        with pytest.raises(ValueError, match="videos: this model takes no videos"):
            llm.engine.images.prepare([VideoSource(b"")])  # the async engine's first call
    finally:
        llm.shutdown()
