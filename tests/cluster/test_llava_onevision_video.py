"""LLaVA-OneVision with videos through the engine: each frame through the SigLIP tower and
projector, pooled 2 x 2 bilinearly, one newline after the last frame, as transformers'
``get_video_features`` (exactly, fp32); greedy tokens equal Hugging Face's ``generate``
fed the same frames as ``pixel_values_videos``, alone, beside a picture and in chunks;
an encoded video is sampled to at most 32 frames spread evenly (fewer frames: all of
them) unless ``mm_processor_kwargs`` says otherwise; chats take ``video_url`` parts."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest
import torch

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.cluster.onevision_video import OnevisionVideoProcessor
from pagedserve.cluster.video import VideoClip
from pagedserve.worker.testing import random_picture, write_random_llava
from tests.cluster.test_engine_behaviour import assert_pool_at_baseline
from tests.cluster.test_llava_onevision_images import PINPOINTS, count

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
IMG, VID = 299, 296
PER_FRAME = 4  # 28-pixel tower, 7-pixel patches: 4 x 4 features pooled to 2 x 2


@pytest.fixture(scope="module")
def ov_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_random_llava(tmp_path_factory.mktemp("onevision_video"), seed=17,
                              pinpoints=PINPOINTS, onevision_max_crops=1)


def clip(seed: int, frames: int = 3, size: tuple[int, int] = (40, 30)) -> VideoClip:
    return VideoClip(tuple(random_picture(seed + i, size) for i in range(frames)), 2.0)


def run(frames: int) -> list[int]:
    return [VID] * (frames * PER_FRAME + 1)


def frames_of(model_dir: str, video: VideoClip) -> torch.Tensor:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return OnevisionVideoProcessor.from_model_dir(model_dir, cfg)(video).frames


def hf_generate(model_dir: str, ids: list[int], video: VideoClip, pictures=()) -> list[int]:
    """HF's greedy tokens with our frames as ``pixel_values_videos`` (its video processor
    needs torchvision) and its image processor's pictures."""
    from transformers import AutoImageProcessor, LlavaOnevisionForConditionalGeneration

    model = LlavaOnevisionForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32).eval()
    kw = {"pixel_values_videos": frames_of(model_dir, video)[None]}
    if pictures:
        proc = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
        kw.update(proc([list(pictures)], return_tensors="pt"))
    x = torch.tensor([ids])
    with torch.inference_mode():
        y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                           max_new_tokens=GREEDY.max_tokens,
                           min_new_tokens=GREEDY.max_tokens, pad_token_id=0, **kw)
    return y[0, len(ids):].tolist()


def test_the_encoder_equals_transformers_video_features(ov_dir: str) -> None:
    from safetensors.torch import load_file
    from transformers import LlavaOnevisionForConditionalGeneration

    from pagedserve.worker.models.llava_next_vision import LlavaNextVisionEncoder

    cfg = json.loads((Path(ov_dir) / "config.json").read_text())
    model = LlavaOnevisionForConditionalGeneration.from_pretrained(
        ov_dir, dtype=torch.float32).eval()
    enc = LlavaNextVisionEncoder.from_hf_config(cfg, torch.float32, torch.device("cpu"))
    enc.load_weights(load_file(str(Path(ov_dir) / "model.safetensors")).items())
    frames = frames_of(ov_dir, clip(1, frames=5))
    with torch.inference_mode():
        want = model.model.get_video_features(
            frames[None], vision_feature_layer=-1,
            vision_feature_select_strategy="full").pooler_output[0]
        got = enc.encode_video(frames)
    assert got.shape == (5 * PER_FRAME + 1, 64)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_frames_are_processed_as_the_image_processor_does_a_square_picture(
        ov_dir: str) -> None:
    """A frame at the tower's size: the image processor's whole-picture crop (PIL,
    bicubic, CLIP's mean and std), the processing HF's video processor does with
    torchvision."""
    from transformers import AutoImageProcessor

    pic = random_picture(3, (28, 28))
    hf = AutoImageProcessor.from_pretrained(ov_dir, backend="pil")([[pic]], return_tensors="pt")
    got = frames_of(ov_dir, VideoClip((pic,), 1.0))[0]
    torch.testing.assert_close(got, hf["pixel_values"][0][0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("kw", [dict(), dict(max_num_batched_tokens=6, max_num_seqs=2)],
                         ids=["whole", "chunked"])
def test_videos_equal_hugging_face(ov_dir: str, kw: dict) -> None:
    """A video alone (its lone ``<video>`` written out to 3 frames' run), another beside
    a picture, a text prompt; the video decides the answer."""
    a, b, pic = clip(1), clip(7, frames=2), random_picture(20, (30, 40))
    alone = [1, 5, *run(3), 6]
    mixed = [1, *[IMG] * count((40, 30), 7), 9, *run(2), 10]  # one picture: anyres
    llm = LLM(model=ov_dir, num_gpu_blocks=128, **kw)
    try:
        outs = llm.generate([
            {"prompt_token_ids": [1, 5, VID, 6], "multi_modal_data": {"video": a}},
            {"prompt_token_ids": [1, IMG, 9, VID, 10],
             "multi_modal_data": {"image": pic, "video": b}},
            [1, 20, 21],
            {"prompt_token_ids": alone, "multi_modal_data": {"video": clip(30)}}], GREEDY)
        assert [o.prompt_token_ids for o in outs[:2]] == [alone, mixed]
        assert outs[0].outputs[0].token_ids == hf_generate(ov_dir, alone, a)
        assert outs[1].outputs[0].token_ids == hf_generate(ov_dir, mixed, b, [pic])
        assert outs[0].outputs[0].token_ids != outs[3].outputs[0].token_ids
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_encoded_videos_are_sampled_to_32_frames_or_as_asked(ov_dir: str) -> None:
    """40 frames keep 32 spread evenly (HF's ``arange`` spacing), 10 keep all 10, and
    ``mm_processor_kwargs`` ``num_frames`` / ``fps`` pick others; a chat's
    ``video_url`` part is the same video."""
    import av

    from pagedserve.worker.testing_qwen_vl import video_bytes

    long, short = (video_bytes(s, frames=n, fps=10, size=(32, 24)) for s, n in ((2, 40),
                                                                                  (3, 10)))
    with av.open(io.BytesIO(long)) as c:
        every = [f.to_image() for f in c.decode(video=0)]

    def picked(*frames: int) -> VideoClip:
        return VideoClip(tuple(every[i] for i in frames), 1.0)

    llm = LLM(model=ov_dir, num_gpu_blocks=256)
    try:
        def tokens(video, options=None) -> tuple[list[int], list[int]]:
            out = llm.generate({"prompt_token_ids": [1, 5, VID, 6],
                                "multi_modal_data": {"video": video},
                                "mm_processor_kwargs": options}, GREEDY)[0]
            return out.prompt_token_ids, out.outputs[0].token_ids

        spread = torch.arange(0, 40, 40 / 32).int().tolist()
        assert tokens(long) == tokens(picked(*spread))
        assert tokens(short)[0] == [1, 5, *run(10), 6]
        assert tokens(long, {"num_frames": 4}) == tokens(picked(0, 10, 20, 30))
        assert tokens(long, {"fps": 1.0})[0] == [1, 5, *run(4), 6]  # 4 s at 1 a second
        url = "data:video/mp4;base64," + base64.b64encode(long).decode()
        chat = llm.chat([{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": url}},
            {"type": "text", "text": "t5"}]}], GREEDY, mm_processor_kwargs={"num_frames": 4})
        assert chat[0].prompt_token_ids == [1, 297, *run(4), 5, 298]
        with pytest.raises(ValueError, match=r"mm_processor_kwargs\.max_pixels: not an option "
                                             r"of llava_onevision's processor"):
            tokens(long, {"max_pixels": 100})
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_a_saved_video_config_with_nulls_keeps_the_32_frame_default(ov_dir: str,
                                                                     tmp_path: Path) -> None:
    """transformers saves a video processor's unset fields as null: those are the
    defaults, not "no cap"; a set ``num_frames`` is taken."""
    cfg = json.loads((Path(ov_dir) / "config.json").read_text())
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(
        {"num_frames": None, "fps": None, "max_frames": None, "size": {"height": 28,
                                                                       "width": 28}}))
    saved = OnevisionVideoProcessor.from_model_dir(tmp_path, cfg)
    assert (saved.sampling.num_frames, saved.sampling.cap_frames) == (32, True)
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({"num_frames": 8}))
    assert OnevisionVideoProcessor.from_model_dir(tmp_path, cfg).sampling.num_frames == 8
    assert OnevisionVideoProcessor.from_model_dir(
        tmp_path, cfg, {"fps": 1.0}).sampling.num_frames is None
