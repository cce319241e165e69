"""LLaVA-1.5 with images through the engine: a random ``LlavaForConditionalGeneration``
(a CLIP tower whose second-to-last layer feeds LLaVA's projector, a Llama decoder)
gives Hugging Face's greedy tokens for prompts of one and two images beside a text
prompt, whole and in chunks, as prefix hits; a lone ``<image>`` id in a token prompt and
``<image>`` in a chat are written out to the processor's run; the image's tokens attend
causally, as in transformers."""

from __future__ import annotations

import pytest
import torch

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.worker.testing import random_picture, write_random_llava
from tests.cluster.test_engine_behaviour import assert_pool_at_baseline

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
IMG, N = 299, 16


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_random_llava(tmp_path_factory.mktemp("llava"))


def cases() -> list[tuple[list[int], list]]:
    return [
        ([1, 5, 6, *[IMG] * N, 7, 8], [random_picture(1)]),
        ([1, *[IMG] * N, 9, *[IMG] * N, 10, 11], [random_picture(2), random_picture(3, (50, 20))]),
        ([1, 20, 21, 22], []),
        ([1, 5, 6, *[IMG] * N, 7, 8], [random_picture(4)]),
    ]


def hf_reference(model_dir: str, prompts: list[tuple[list[int], list]], max_new: int
                 ) -> list[list[int]]:
    from transformers import AutoImageProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    proc = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    outs = []
    with torch.inference_mode():
        for ids, images in prompts:
            x = torch.tensor([ids])
            kw = {"pixel_values": proc(images, return_tensors="pt")["pixel_values"]} \
                if images else {}
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                               max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=0,
                               **kw)
            outs.append(y[0, len(ids):].tolist())
    return outs


@pytest.fixture(scope="module")
def reference(llava_dir: str) -> list[list[int]]:
    return hf_reference(llava_dir, cases(), GREEDY.max_tokens)


def generate(llm: LLM, prompts: list[tuple[list[int], list]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": imgs}}
                         if imgs else ids for ids, imgs in prompts], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kw", [dict(), dict(max_num_batched_tokens=20, max_num_seqs=4),
                                dict(max_num_batched_tokens=5, max_num_seqs=4)],
                         ids=["whole", "chunked", "split-images"])
def test_llava_images_equal_hugging_face(llava_dir: str, reference: list[list[int]],
                                         kw: dict) -> None:
    llm = LLM(model=llava_dir, num_gpu_blocks=128, **kw)
    try:
        assert llm.engine.model_info["model_type"] == "llama"
        assert llm.engine.model_info["image"]["family"] == "llava"
        assert generate(llm, cases()) == reference
        assert reference[0] != reference[3]  # the picture decides the answer
        again = llm.generate({"prompt_token_ids": cases()[0][0],
                              "multi_modal_data": {"image": cases()[0][1]}}, GREEDY)[0]
        assert again.outputs[0].token_ids == reference[0] and again.num_cached_tokens > 0
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_a_lone_image_token_and_a_chat_are_written_out(llava_dir: str,
                                                       reference: list[list[int]]) -> None:
    llm = LLM(model=llava_dir, num_gpu_blocks=128)
    try:
        ids, imgs = cases()[0]
        lone = llm.generate({"prompt_token_ids": [1, 5, 6, IMG, 7, 8],
                             "multi_modal_data": {"image": imgs}}, GREEDY)[0]
        assert lone.prompt_token_ids == ids and lone.outputs[0].token_ids == reference[0]
        chat = llm.chat([{"role": "user", "content": [
            {"type": "image", "image": imgs[0]}, {"type": "text", "text": "t5 t6"}]}],
            GREEDY)[0]
        assert chat.prompt_token_ids == [1, 297, *[IMG] * N, 5, 6, 298]
        with pytest.raises(ValueError, match="marks 2 images"):
            llm.generate({"prompt_token_ids": [1, IMG, 5, IMG],
                          "multi_modal_data": {"image": imgs}}, GREEDY)
    finally:
        llm.shutdown()
