"""LLaVA-OneVision with images through the engine: LLaVA-NeXT's anyres behind a SigLIP
tower, a grid past ``anyres_max_N`` crops shrunk bilinearly, and several pictures in
one prompt each encoded whole only. A picture's token count is Hugging Face's
processor's (alone and beside others), the encoder's features equal transformers'
exactly, and a random ``LlavaOnevisionForConditionalGeneration`` gives HF's greedy
tokens for one- and two-picture prompts, whole and in chunks, and from a chat."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.worker.anyres import anyres_token_count
from pagedserve.worker.testing import random_picture, write_random_llava
from tests.cluster.test_engine_behaviour import assert_pool_at_baseline

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
IMG = 299
PINPOINTS = [[28, 28], [28, 56], [56, 28], [56, 56]]
SIZES = [(40, 70), (90, 30), (28, 28), (100, 100), (20, 90), (61, 59)]


def count(size: tuple[int, int], patch: int, single: bool = True) -> int:
    return anyres_token_count(*size, [tuple(p) for p in PINPOINTS], 28, patch, 1, single)


@pytest.fixture(scope="module")
def ov_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """2 x 2 features a crop (short runs: the pictures decide the random answers); at
    most one crop's worth of grid, so a 2 x 2 canvas is shrunk."""
    return write_random_llava(tmp_path_factory.mktemp("onevision"), seed=13, patch_size=14,
                              pinpoints=PINPOINTS, onevision_max_crops=1)


@pytest.fixture(scope="module")
def fine_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_random_llava(tmp_path_factory.mktemp("onevision_fine"), pinpoints=PINPOINTS,
                              onevision_max_crops=1)


def test_token_counts_equal_hugging_faces_processor(ov_dir: str) -> None:
    """HF's ``LlavaOnevisionProcessor`` counting (built bare: its video processor needs
    torchvision) over its image processor's outputs."""
    from transformers import AutoImageProcessor, LlavaOnevisionProcessor

    proc = object.__new__(LlavaOnevisionProcessor)
    proc.image_processor = AutoImageProcessor.from_pretrained(ov_dir, backend="pil")
    proc.num_image_tokens, proc.image_token = 4, "<image>"
    proc.vision_feature_select_strategy, proc.vision_aspect_ratio = "full", "anyres_max_1"

    def hf_counts(pics: list) -> list[int]:
        inputs = proc.image_processor([pics], return_tensors="pt")
        return [len(proc.replace_image_token(inputs, i)) // len("<image>")
                for i in range(len(pics))]

    for h, w in SIZES:
        assert hf_counts([random_picture(1, (w, h))]) == [count((h, w), 14)], (h, w)
    two = [random_picture(1, (30, 40)), random_picture(2, (90, 20))]
    assert hf_counts(two) == [count((40, 30), 14, single=False)] * 2 == [4 + 1] * 2


def test_the_encoder_equals_transformers_features(fine_dir: str) -> None:
    from safetensors.torch import load_file
    from transformers import AutoImageProcessor, LlavaOnevisionForConditionalGeneration

    from pagedserve.cluster.image_processor import ImageProcessor
    from pagedserve.worker.models.llava_next_vision import LlavaNextVisionEncoder

    cfg = json.loads((Path(fine_dir) / "config.json").read_text())
    model = LlavaOnevisionForConditionalGeneration.from_pretrained(
        fine_dir, dtype=torch.float32).eval()
    enc = LlavaNextVisionEncoder.from_hf_config(cfg, torch.float32, torch.device("cpu"))
    enc.load_weights(load_file(str(Path(fine_dir) / "model.safetensors")).items())
    ours = ImageProcessor.from_model_dir(fine_dir, cfg)
    ours.check_model(cfg)
    hf = AutoImageProcessor.from_pretrained(fine_dir, backend="pil")
    kw = dict(vision_feature_layer=-1, vision_feature_select_strategy="full",
              vision_aspect_ratio="anyres_max_1")
    groups = [[random_picture(3, (w, h))] for h, w in SIZES]
    groups.append([random_picture(4, (30, 40)), random_picture(5, (20, 70))])
    for pics in groups:
        mine = ours(pics)
        ref = hf([pics], return_tensors="pt")
        with torch.inference_mode():
            want = model.model.get_image_features(
                pixel_values=ref["pixel_values"], image_sizes=ref["image_sizes"],
                batch_num_images=ref["batch_num_images"], **kw).pooler_output
            for px, w in zip(mine, want, strict=True):
                got = enc.encode_anyres(px.crops, px.height, px.width, px.single)
                assert got.shape[0] == ours.token_count(px)
                torch.testing.assert_close(got, w, rtol=0, atol=1e-5)
    assert [ours.token_count(px) for px in ours(groups[3])] == [count((100, 100), 7)] == [36]


def cases() -> list[tuple[list[int], list]]:
    a, b, c = random_picture(1, (30, 40)), random_picture(2, (90, 20)), random_picture(4, (30, 40))
    return [
        ([1, 5, 6, *[IMG] * count((40, 30), 14), 7, 8], [a]),
        ([1, *[IMG] * 5, 9, *[IMG] * 5, 10, 11], [a, b]),
        ([1, 20, 21, 22], []),
        ([1, 5, 6, *[IMG] * count((40, 30), 14), 7, 8], [c]),
        ([1, 5, *[IMG] * count((20, 90), 14), 7], [b]),
    ]


def hf_generate(model_dir: str, ids: list[int], images: list) -> list[int]:
    """HF's greedy tokens for one prompt (its pictures processed as one prompt's)."""
    from transformers import AutoImageProcessor, LlavaOnevisionForConditionalGeneration

    model = LlavaOnevisionForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32).eval()
    proc = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    with torch.inference_mode():
        x = torch.tensor([ids])
        kw = dict(proc([images], return_tensors="pt")) if images else {}
        y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                           max_new_tokens=GREEDY.max_tokens,
                           min_new_tokens=GREEDY.max_tokens, pad_token_id=0, **kw)
    return y[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def reference(ov_dir: str) -> list[list[int]]:
    return [hf_generate(ov_dir, ids, images) for ids, images in cases()]


@pytest.mark.parametrize("kw", [dict(), dict(max_num_batched_tokens=5, max_num_seqs=4)],
                         ids=["whole", "split-images"])
def test_llava_onevision_images_equal_hugging_face(ov_dir: str, reference: list[list[int]],
                                                   kw: dict) -> None:
    llm = LLM(model=ov_dir, num_gpu_blocks=128, **kw)
    try:
        assert llm.engine.model_info["image"]["family"] == "llava_onevision"
        outs = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": imgs}}
                             if imgs else ids for ids, imgs in cases()], GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == reference
        assert reference[0] != reference[3]  # the picture decides the answer
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_chats_write_out_each_pictures_run(ov_dir: str, reference: list[list[int]]) -> None:
    from pagedserve.cluster.image_chat import written_out  # (the HTTP front: pydantic)

    llm = LLM(model=ov_dir, num_gpu_blocks=128)
    try:
        ids, imgs = cases()[1]
        lone = llm.generate({"prompt_token_ids": [1, IMG, 9, IMG, 10, 11],
                             "multi_modal_data": {"image": imgs}}, GREEDY)[0]
        assert lone.prompt_token_ids == ids and lone.outputs[0].token_ids == reference[1]
        one = [{"role": "user", "content": [
            {"type": "image", "image": imgs[0]}, {"type": "text", "text": "t5 t6"}]}]
        chat = llm.chat(one, GREEDY)[0]
        assert chat.prompt_token_ids == [1, 297, *[IMG] * count((40, 30), 14), 5, 6, 298]
        # Two pictures side by side in a chat: the template writes two lone markers the
        # word-level tokenizer puts next to each other; each is written out to its run.
        two = [{"role": "user", "content": [
            *({"type": "image", "image": img} for img in imgs), {"type": "text", "text": "t5"}]}]
        chat2 = llm.chat(two, GREEDY)[0]
        assert chat2.prompt_token_ids == [1, 297, *[IMG] * 10, 5, 298]
        assert chat2.outputs[0].token_ids == hf_generate(ov_dir, chat2.prompt_token_ids, imgs)
        image = llm.engine.images.info  # type: ignore[union-attr]
        assert written_out([1, IMG, 9, IMG, 10, 11], imgs, image) == ids
        assert written_out([1, IMG, 7], imgs[1:], image) == [1, *[IMG] * count((20, 90), 14),
                                                            7]
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("change,field", [
    ({"vision_feature_select_strategy": "default"}, "vision_feature_select_strategy"),
    ({"vision_aspect_ratio": "anyres"}, "vision_aspect_ratio"),
])
def test_bad_llava_onevision_files_name_the_field(ov_dir: str, tmp_path: Path, change: dict,
                                                  field: str) -> None:
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(ov_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ValueError, match=field):
        LLM(model=str(bad), num_gpu_blocks=16)


def test_runs_side_by_side_split_into_pictures() -> None:
    """Lone markers a template writes side by side, or whole runs the HTTP front wrote
    out side by side: each picture gets its own span."""
    from pagedserve.cluster.media_runs import split_runs

    assert split_runs([(1, 3)], [5, 5]) == [(1, 2), (2, 3)]  # two lone markers
    assert split_runs([(1, 11)], [5, 5]) == [(1, 6), (6, 11)]  # two written runs
    assert split_runs([(1, 6)], [5]) == [(1, 6)]
    assert split_runs([(0, 1), (2, 9)], [5, 4, 3]) == [(0, 1), (2, 6), (6, 9)]
    assert split_runs([(1, 6)], [4, 4]) == [(1, 6)]  # accounts for neither: as it is
    assert split_runs([(1, 4)], [5, 5]) == [(1, 4)]
