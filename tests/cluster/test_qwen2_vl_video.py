"""Qwen2-VL and Qwen2.5-VL with videos through the engine: greedy tokens equal Hugging
Face's ``generate`` on random checkpoints fed the same frames as ``pixel_values_videos``
(a video's temporal slices, its M-RoPE times: Qwen2.5-VL's scaled by seconds a slice and
``tokens_per_second``), alone, beside a picture, in chunks that cut the video, and as a
prefix-cache hit; an encoded MP4 / WebM is sampled at the processor's rate; the chat API
takes ``video_url`` parts; bad videos and mismatched runs are refused naming the field,
with every block back in the pool."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.cluster.video import VideoClip
from pagedserve.worker.testing import random_picture
from pagedserve.worker.testing_qwen_vl import write_random_qwen2_vl
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


def hf_video_inputs(model_dir: str, video: VideoClip) -> dict[str, torch.Tensor]:
    """HF's video inputs for ``video``: each frame as the image processor resizes it
    within the video bounds, patched as HF's video processor patches."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from pagedserve.worker.models.qwen2_vision_config import patches_to_images

    bounds = json.loads((Path(model_dir) / "video_preprocessor_config.json").read_text())["size"]
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


def hf_reference(model_dir: str, ids: list[int], video: VideoClip, picture=None
                 ) -> tuple[list[int], list[float]]:
    """HF's greedy tokens and each one's log-probability (of the raw logits)."""
    import transformers as tf
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    model = tf.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    x = torch.tensor([ids])
    kw = hf_video_inputs(model_dir, video)
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
