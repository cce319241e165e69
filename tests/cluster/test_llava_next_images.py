"""LLaVA-NeXT ("anyres") with images through the engine: a picture's token count is
Hugging Face's processor's for any size, the encoder's packed features (crops laid
out, padding cut off, a newline closing each row) equal transformers' exactly, and a
random ``LlavaNextForConditionalGeneration`` gives HF's greedy tokens for prompts of
pictures of different shapes, whole, in chunks and split across chunks, as prefix
hits, from a lone ``<image>`` id and from a chat; bad files and runs are
``ValueError``s naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.worker.anyres import anyres_token_count, best_resolution, facts_token_count
from pagedserve.worker.testing import random_picture, write_random_llava
from tests.cluster.test_engine_behaviour import assert_pool_at_baseline

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
IMG = 299
PINPOINTS = [[28, 56], [56, 28], [56, 56], [28, 84]]
SIZES = [(40, 30), (30, 40), (50, 20), (20, 90), (28, 28), (100, 100), (7, 200), (61, 59)]


@pytest.fixture(scope="module")
def next_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """2 x 2 features a crop: short runs, so the pictures decide the random answers."""
    return write_random_llava(tmp_path_factory.mktemp("llava_next"), seed=13, patch_size=14,
                              pinpoints=PINPOINTS)


@pytest.fixture(scope="module")
def fine_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """4 x 4 features a crop: finer unpadding, for the encoder's comparison."""
    return write_random_llava(tmp_path_factory.mktemp("llava_next_fine"), pinpoints=PINPOINTS)


def run(n: int) -> list[int]:
    return [IMG] * n


def count(size: tuple[int, int], patch: int = 14) -> int:
    return anyres_token_count(*size, [tuple(p) for p in PINPOINTS], 28, patch)


def test_token_counts_equal_hugging_faces_processor(next_dir: str) -> None:
    from transformers import AutoImageProcessor, AutoTokenizer, LlavaNextProcessor

    proc = LlavaNextProcessor(
        image_processor=AutoImageProcessor.from_pretrained(next_dir, backend="pil"),
        tokenizer=AutoTokenizer.from_pretrained(next_dir), patch_size=14,
        vision_feature_select_strategy="default", num_additional_image_tokens=1)
    for h, w in SIZES:
        ids = proc(text="USER: <image>", images=[random_picture(1, (w, h))])["input_ids"][0]
        assert list(ids).count(IMG) == count((h, w)), (h, w)
    # The canvas that keeps most pixels, then wastes least.
    assert best_resolution(40, 30, [(28, 56), (56, 28), (56, 56)]) == (56, 56)
    assert best_resolution(10, 100, [(28, 56), (56, 28), (28, 84)]) == (28, 84)


def test_the_encoder_equals_transformers_packed_features(fine_dir: str) -> None:
    from safetensors.torch import load_file
    from transformers import AutoImageProcessor, LlavaNextForConditionalGeneration

    from pagedserve.cluster.image_processor import ImageProcessor
    from pagedserve.worker.models.llava_next_vision import LlavaNextVisionEncoder

    cfg = json.loads((Path(fine_dir) / "config.json").read_text())
    model = LlavaNextForConditionalGeneration.from_pretrained(fine_dir,
                                                              dtype=torch.float32).eval()
    enc = LlavaNextVisionEncoder.from_hf_config(cfg, torch.float32, torch.device("cpu"))
    enc.load_weights(load_file(str(Path(fine_dir) / "model.safetensors")).items())
    ours = ImageProcessor.from_model_dir(fine_dir, cfg)
    ours.check_model(cfg)
    hf = AutoImageProcessor.from_pretrained(fine_dir, backend="pil")
    for h, w in SIZES:
        pic = random_picture(3, (w, h))
        px = ours([pic])[0]
        ref = hf([pic], return_tensors="pt")
        assert torch.equal(px.crops, ref["pixel_values"][0]) and (px.height, px.width) == (h, w)
        with torch.inference_mode():
            want = model.model.get_image_features(
                pixel_values=ref["pixel_values"], image_sizes=ref["image_sizes"],
                vision_feature_layer=-2, vision_feature_select_strategy="default"
            ).pooler_output[0]
            got = enc.encode_anyres(px.crops, px.height, px.width)
        assert got.shape == want.shape == (count((h, w), 7), 64)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="crops"):
        enc.encode_anyres(px.crops[:2], px.height, px.width)


def cases() -> list[tuple[list[int], list]]:
    a, b, c = random_picture(1, (30, 40)), random_picture(2, (90, 20)), random_picture(4, (30, 40))
    return [
        ([1, 5, 6, *run(count((40, 30))), 7, 8], [a]),
        ([1, *run(count((40, 30))), 9, *run(count((20, 90))), 10, 11], [a, b]),
        ([1, 20, 21, 22], []),
        ([1, 5, 6, *run(count((40, 30))), 7, 8], [c]),
    ]


def hf_reference(model_dir: str, prompts: list[tuple[list[int], list]]) -> list[list[int]]:
    from transformers import AutoImageProcessor, LlavaNextForConditionalGeneration

    model = LlavaNextForConditionalGeneration.from_pretrained(model_dir,
                                                              dtype=torch.float32).eval()
    proc = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    outs = []
    with torch.inference_mode():
        for ids, images in prompts:
            x = torch.tensor([ids])
            kw = dict(proc(images, return_tensors="pt")) if images else {}
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                               max_new_tokens=GREEDY.max_tokens,
                               min_new_tokens=GREEDY.max_tokens, pad_token_id=0, **kw)
            outs.append(y[0, len(ids):].tolist())
    return outs


@pytest.fixture(scope="module")
def reference(next_dir: str) -> list[list[int]]:
    return hf_reference(next_dir, cases())


def generate(llm: LLM, prompts: list[tuple[list[int], list]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": imgs}}
                         if imgs else ids for ids, imgs in prompts], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kw", [dict(), dict(max_num_batched_tokens=12, max_num_seqs=4),
                                dict(max_num_batched_tokens=5, max_num_seqs=4)],
                         ids=["whole", "chunked", "split-images"])
def test_llava_next_images_equal_hugging_face(next_dir: str, reference: list[list[int]],
                                              kw: dict) -> None:
    llm = LLM(model=next_dir, num_gpu_blocks=128, **kw)
    try:
        info = llm.engine.model_info["image"]
        assert (info["family"], info["tokens_per_image"]) == ("llava_next", 0)
        assert generate(llm, cases()) == reference
        assert reference[0] != reference[3]  # the picture decides the answer
        again = llm.generate({"prompt_token_ids": cases()[0][0],
                              "multi_modal_data": {"image": cases()[0][1]}}, GREEDY)[0]
        assert again.outputs[0].token_ids == reference[0] and again.num_cached_tokens > 0
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_lone_image_tokens_and_chats_are_written_out(next_dir: str,
                                                     reference: list[list[int]]) -> None:
    from pagedserve.cluster.image_chat import written_out  # (the HTTP front: pydantic)

    llm = LLM(model=next_dir, num_gpu_blocks=128)
    try:
        ids, imgs = cases()[1]
        lone = llm.generate({"prompt_token_ids": [1, IMG, 9, IMG, 10, 11],
                             "multi_modal_data": {"image": imgs}}, GREEDY)[0]
        assert lone.prompt_token_ids == ids and lone.outputs[0].token_ids == reference[1]
        chat = llm.chat([{"role": "user", "content": [
            {"type": "image", "image": imgs[0]}, {"type": "text", "text": "t5 t6"}]}],
            GREEDY)[0]
        assert chat.prompt_token_ids == [1, 297, *run(count((40, 30))), 5, 6, 298]
        # The HTTP front counts the same runs from the decoded pictures.
        image = llm.engine.images.info  # type: ignore[union-attr]
        assert written_out([1, IMG, 9, IMG, 10, 11], imgs, image) == ids
        assert facts_token_count(90, 20, image["anyres"]) == count((90, 20))
        with pytest.raises(ValueError, match="placeholder tokens"):
            llm.generate({"prompt_token_ids": [1, *run(5), 7],
                          "multi_modal_data": {"image": imgs[:1]}}, GREEDY)
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("change,field", [
    ({"vision_feature_select_strategy": "full"}, "vision_feature_select_strategy"),
    ({"image_grid_pinpoints": [[28, 50]]}, "image_grid_pinpoints"),
    ({"image_grid_pinpoints": []}, "image_grid_pinpoints"),
])
def test_bad_llava_next_files_name_the_field(next_dir: str, tmp_path: Path, change: dict,
                                             field: str) -> None:
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(next_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ValueError, match=field):
        LLM(model=str(bad), num_gpu_blocks=16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_llava_next_on_cuda_equals_hugging_face_on_cuda(next_dir: str) -> None:
    """On the GPU: the crops through the tower, packing and decode in CUDA graphs;
    HF ``generate`` on the same device."""
    from transformers import AutoImageProcessor, LlavaNextForConditionalGeneration

    model = LlavaNextForConditionalGeneration.from_pretrained(
        next_dir, dtype=torch.float32).to("cuda").eval()
    proc = AutoImageProcessor.from_pretrained(next_dir, backend="pil")
    ref = []
    with torch.inference_mode():
        for ids, images in cases():
            x = torch.tensor([ids], device="cuda")
            kw = {k: v.to("cuda") for k, v in proc(images, return_tensors="pt").items()} \
                if images else {}
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                               max_new_tokens=GREEDY.max_tokens,
                               min_new_tokens=GREEDY.max_tokens, pad_token_id=0, **kw)
            ref.append(y[0, len(ids):].tolist())
    llm = LLM(model=next_dir, device="cuda", num_gpu_blocks=128, max_num_batched_tokens=12,
              max_num_seqs=4)
    try:
        assert generate(llm, cases()) == ref
    finally:
        llm.shutdown()
