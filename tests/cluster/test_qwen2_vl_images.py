"""Qwen2-VL and Qwen2.5-VL with images through the engine: greedy tokens equal Hugging
Face's ``generate`` on random checkpoints (pictures of different sizes, so grids of
different shapes and M-RoPE positions off the token index), whole and in chunks (cut
inside a picture too: its tokens attend causally, and it is encoded once), as
prefix-cache hits, under recompute preemption, with n-gram drafts and beside text
prompts in one batch; a prompt's lone ``<|image_pad|>`` is written out to its picture's
run; bad runs are refused with the field named."""

from __future__ import annotations

import pytest
import torch

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.worker.testing import random_picture
from pagedserve.worker.testing_qwen_vl import write_random_qwen2_vl
from tests.cluster.test_engine_behaviour import assert_pool_at_baseline

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
START, END, PAD = 297, 298, 299
# Pictures (width, height) and their grids of LLM tokens (rows, cols) under the test
# processor (patch 7, 2x2 merge, 196 to 3,136 pixels).
SIZES = {1: ((40, 30), (2, 3)), 2: ((20, 50), (4, 1)), 3: ((64, 64), (4, 4)),
         4: ((40, 30), (2, 3))}


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def qwen_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_random_qwen2_vl(tmp_path_factory.mktemp(request.param), request.param)


def picture(seed: int):
    return random_picture(seed, SIZES[seed][0])


def run(seed: int) -> list[int]:
    rows, cols = SIZES[seed][1]
    return [START] + [PAD] * (rows * cols) + [END]


def cases() -> list[tuple[list[int], list]]:
    return [
        ([5, 6, 7, *run(1), 8, 9], [picture(1)]),
        ([*run(2), 10, *run(3), 11, 12, 13], [picture(2), picture(3)]),
        ([20, 21, 22, 23, 24], []),
        ([5, 6, 7, *run(4), 8, 9], [picture(4)]),  # same text, another picture
    ]


def hf_reference(model_dir: str, prompts: list[tuple[list[int], list]], max_new: int,
                 size: dict[str, int] | None = None) -> list[list[int]]:
    """Hugging Face's greedy tokens, one prompt at a time, with the processor's patches,
    grids and token types (its M-RoPE positions); ``size``: the processor's picture
    bounds for the call."""
    import transformers as tf
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    model = tf.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    proc = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    outs = []
    with torch.inference_mode():
        for ids, images in prompts:
            x = torch.tensor([ids])
            kw = {}
            if images:
                px = proc(images, return_tensors="pt", **({"size": size} if size else {}))
                kw = dict(pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"],
                          mm_token_type_ids=(x == PAD).int())
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                               max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=0,
                               **kw)
            outs.append(y[0, len(ids):].tolist())
    return outs


@pytest.fixture(scope="module")
def reference(qwen_dir: str) -> list[list[int]]:
    return hf_reference(qwen_dir, cases(), GREEDY.max_tokens)


def generate(llm: LLM, prompts: list[tuple[list[int], list]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": imgs}}
                         if imgs else ids for ids, imgs in prompts], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


def test_the_processor_grids_are_the_ones_the_cases_assume(qwen_dir: str) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    proc = Qwen2VLImageProcessorPil.from_pretrained(qwen_dir)
    for seed, (_, (rows, cols)) in SIZES.items():
        grid = proc([picture(seed)], return_tensors="pt")["image_grid_thw"][0].tolist()
        assert grid == [1, 2 * rows, 2 * cols]


@pytest.mark.parametrize("kw", [
    dict(),
    dict(max_num_batched_tokens=20, max_num_seqs=4),
    dict(max_num_batched_tokens=5, max_num_seqs=4),  # images cut across steps
    dict(attention_backend="torch"),
    dict(num_gpu_blocks=12, preemption_mode="recompute", block_size=4),
    dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
], ids=["whole", "chunked", "split-images", "torch-backend", "recompute", "ngram"])
def test_images_equal_hugging_face(qwen_dir: str, reference: list[list[int]],
                                   kw: dict) -> None:
    llm = LLM(model=qwen_dir, **{"num_gpu_blocks": 128, **kw})
    try:
        assert generate(llm, cases()) == reference
        if "preemption_mode" in kw:
            assert llm.engine.scheduler.num_preemptions[kw["preemption_mode"]] > 0
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_a_picture_cut_across_steps_is_encoded_once(qwen_dir: str,
                                                   reference: list[list[int]]) -> None:
    """A 4 x 4 picture under a 5-token step budget runs in four chunks: the encoder
    runs once for it (its output kept between the steps) and the tokens are HF's."""
    llm = LLM(model=qwen_dir, num_gpu_blocks=128, max_num_batched_tokens=5, max_num_seqs=1)
    try:
        vision = llm.engine.executor.worker.model.vision
        encoded: list[int] = []
        forward = vision.forward
        vision.forward = lambda px: encoded.append(1) or forward(px)
        assert generate(llm, [cases()[1]]) == [reference[1]]
        assert len(encoded) == 2  # its two pictures
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_the_same_picture_hits_the_prefix_cache_and_another_does_not(
        qwen_dir: str, reference: list[list[int]]) -> None:
    llm = LLM(model=qwen_dir, num_gpu_blocks=128, block_size=4)
    try:
        ids, imgs = cases()[0]
        assert generate(llm, [(ids, imgs)]) == [reference[0]]
        again = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": imgs}},
                             GREEDY)[0]
        assert again.outputs[0].token_ids == reference[0]
        assert again.num_cached_tokens == (len(ids) - 1) // 4 * 4
        other_ids, other = cases()[3]
        out = llm.generate({"prompt_token_ids": other_ids,
                            "multi_modal_data": {"image": other}}, GREEDY)[0]
        assert out.outputs[0].token_ids == reference[3]
        assert out.num_cached_tokens == 4  # only the block before the picture
    finally:
        llm.shutdown()


def test_a_lone_image_pad_and_a_chat_are_written_out(qwen_dir: str,
                                                     reference: list[list[int]]) -> None:
    llm = LLM(model=qwen_dir, num_gpu_blocks=128)
    try:
        ids, imgs = cases()[1]
        lone = llm.generate({"prompt_token_ids": [START, PAD, END, 10, START, PAD, END,
                                                  11, 12, 13],
                             "multi_modal_data": {"image": imgs}}, GREEDY)[0]
        assert lone.prompt_token_ids == ids and lone.outputs[0].token_ids == reference[1]
        chat = llm.chat([{"role": "user", "content": [
            {"type": "image", "image": picture(1)}, {"type": "text", "text": "t5 t6"}]}],
            GREEDY)[0]
        assert chat.prompt_token_ids == [293, 295, *run(1), 5, 6, 294, 293, 296]
        text = llm.generate({"prompt": "t5 <|vision_start|><|image_pad|><|vision_end|> t9",
                             "multi_modal_data": {"image": picture(2)}}, GREEDY)[0]
        assert text.prompt_token_ids == [5, *run(2), 9]
    finally:
        llm.shutdown()


def test_picture_bounds_from_mm_processor_kwargs_equal_hugging_face(qwen_dir: str) -> None:
    """``max_pixels`` shrinks a picture's grid as HF's processor does with that bound,
    set for the engine or for one request (beside a request under the saved bounds);
    a key Qwen2-VL's processor does not take is refused by name."""
    bounds = {"min_pixels": 196, "max_pixels": 8 * 196}
    lone = [5, START, PAD, END, 8]
    shrunk = [5, START, *[PAD] * 4, END, 8]  # picture 3, 64 x 64: 2 x 2 tokens, not 4 x 4
    want = hf_reference(qwen_dir, [(shrunk, [picture(3)])], GREEDY.max_tokens,
                        {"shortest_edge": 196, "longest_edge": 8 * 196})[0]
    plain = hf_reference(qwen_dir, [([5, *run(3), 8], [picture(3)])], GREEDY.max_tokens)[0]
    engine = LLM(model=qwen_dir, num_gpu_blocks=128, mm_processor_kwargs=bounds)
    try:
        out = engine.generate({"prompt_token_ids": lone,
                               "multi_modal_data": {"image": picture(3)}}, GREEDY)[0]
        assert out.prompt_token_ids == shrunk and out.outputs[0].token_ids == want
    finally:
        engine.shutdown()
    llm = LLM(model=qwen_dir, num_gpu_blocks=128)
    try:
        outs = llm.generate([{"prompt_token_ids": lone, "multi_modal_data": {"image": p},
                              "mm_processor_kwargs": kw}
                             for p, kw in ((picture(3), bounds), (picture(3), None))], GREEDY)
        assert [o.prompt_token_ids for o in outs] == [shrunk, [5, *run(3), 8]]
        assert [o.outputs[0].token_ids for o in outs] == [want, plain]
        with pytest.raises(ValueError, match=r"mm_processor_kwargs\.do_pan_and_scan: not an"):
            llm.generate({"prompt_token_ids": lone, "multi_modal_data": {"image": picture(3)},
                          "mm_processor_kwargs": {"do_pan_and_scan": True}}, GREEDY)
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_bad_runs_are_refused_naming_the_field(qwen_dir: str) -> None:
    llm = LLM(model=qwen_dir, num_gpu_blocks=64)
    try:
        bad = [
            ({"prompt_token_ids": [5, START, PAD, PAD, END],
              "multi_modal_data": {"image": picture(1)}}, "takes 6 placeholder tokens"),
            ({"prompt_token_ids": [5, START, PAD, END],
              "multi_modal_data": {"image": [picture(1)] * 2}}, "marks 1 images"),
            ({"prompt_token_ids": [5, PAD, 6]}, "without an image"),
        ]
        for prompt, match in bad:
            with pytest.raises(ValueError, match=match):
                llm.generate(prompt, GREEDY)
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_shipped_prompt_kv_decodes_at_the_shifted_positions(qwen_dir: str,
                                                            reference: list[list[int]]) -> None:
    """Disaggregated prefill: the prefill engine's K/V (rotated on the pictures' grids)
    ships whole, and a decode engine that hits all of it, encoding nothing, turns its
    new tokens by ``rope_delta`` as HF does."""
    from pagedserve.cluster.kv_transfer import import_prompt_kv

    pre, dec = (LLM(model=qwen_dir, num_gpu_blocks=128, block_size=4) for _ in range(2))
    try:
        for i in (0, 1):
            ids, imgs = cases()[i]
            pre.engine.add_request(ids, SamplingParams(max_tokens=1), f"pf-{i}",
                                   export_kv=True, images=imgs)
            payload = None
            while pre.engine.has_unfinished_requests():
                for out in pre.engine.step():
                    payload = out.kv_transfer if out.finished else payload
            assert import_prompt_kv(dec.engine, payload) == len(ids) // 4
        vision = dec.engine.executor.worker.model.vision
        encoded: list[int] = []
        forward = vision.forward
        vision.forward = lambda px: encoded.append(1) or forward(px)
        outs = dec.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": imgs}}
                             for ids, imgs in cases()[:2]], GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == reference[:2] and not encoded
        assert [o.num_cached_tokens for o in outs] == [
            (len(ids) - 1) // 4 * 4 for ids, _ in cases()[:2]]
        for llm in (pre, dec):
            assert_pool_at_baseline(llm)
    finally:
        pre.shutdown()
        dec.shutdown()
