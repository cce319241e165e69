"""Gemma 3 with pan-and-scan (``mm_processor_kwargs={"do_pan_and_scan": True}``) through
the engine: a wide or tall picture's crops each get their own run, and the prompt ids
and greedy tokens equal Hugging Face's ``Gemma3Processor`` + ``Gemma3ForConditionalGeneration``
on a random checkpoint, as a text prompt, as ids, in chunks, beside plain prompts, in a
chat; options the processor does not take are refused before any rank starts."""

from __future__ import annotations

import pytest
import torch

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.worker.testing import random_picture, write_random_gemma3_multimodal
from tests.cluster.test_engine_behaviour import assert_pool_at_baseline
from tests.cluster.test_gemma3_images import _has_pillow, data_url

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PAS = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 16}
IMG, N = 299, 16
TEXT = "t5 <start_of_image> t6 <start_of_image> t7 <start_of_image> t8"


@pytest.fixture(scope="module")
def mm_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_random_gemma3_multimodal(tmp_path_factory.mktemp("gemma3_pas"))


def pictures() -> list:
    """Wide (3 crops), tall (3 crops) and square (none) at a 16-pixel minimum crop."""
    return [random_picture(1, (120, 40)), random_picture(2, (30, 90)),
            random_picture(3, (40, 40))]


def hf_processor(model_dir: str):
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.models.gemma3.processing_gemma3 import Gemma3Processor

    tok = AutoTokenizer.from_pretrained(model_dir)
    for name, text in (("boi_token", "<start_of_image>"), ("eoi_token", "<end_of_image>"),
                       ("image_token", "<image_soft_token>")):
        setattr(tok, name, text)
        setattr(tok, f"{name}_id", tok.convert_tokens_to_ids(text))
    return Gemma3Processor(AutoImageProcessor.from_pretrained(model_dir, backend="pil"), tok,
                           image_seq_length=N)


def hf_generate(model_dir: str, prompts: list[tuple[str, list]], options: dict | None = None,
                device: str = "cpu") -> list[tuple[list, list]]:
    """Each prompt's ids as HF's processor writes them under pan-and-scan (or
    ``options``), and HF's greedy tokens for them (its token types give each crop's run
    its own block), on ``device``."""
    from transformers import Gemma3ForConditionalGeneration

    proc = hf_processor(model_dir)
    model = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    model.to(device)
    out = []
    with torch.inference_mode():
        for text, images in prompts:
            inputs = proc(text=[text], images=[images] if images else None,
                          return_tensors="pt", **(PAS if options is None else options))
            ids = inputs["input_ids"].to(device)
            kw = {k: inputs[k].to(device) for k in ("pixel_values", "token_type_ids")
                  if k in inputs}
            y = model.eval().generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=GREEDY.max_tokens,
                                      min_new_tokens=GREEDY.max_tokens, pad_token_id=0, **kw)
            out.append((ids[0].tolist(), y[0, ids.shape[1]:].tolist()))
    return out


def cases() -> list[tuple[str, list]]:
    return [(TEXT, pictures()),
            ("t9 t10", []),
            ("t11 <start_of_image> t12", [random_picture(4, (48, 44))]),  # square enough
            ("<start_of_image> t13", [random_picture(5, (200, 20))])]  # 4 crops (the most)


@pytest.fixture(scope="module")
def reference(mm_dir: str) -> list[tuple[list, list]]:
    return hf_generate(mm_dir, cases())


@pytest.mark.parametrize("kw", [
    dict(),
    dict(max_num_batched_tokens=40, max_num_seqs=4),  # chunks stop between the runs
    dict(num_gpu_blocks=56, block_size=4, preemption_mode="recompute",
         disable_hybrid_kv_cache_manager=True),
], ids=["whole", "chunked", "recompute"])
def test_text_and_id_prompts_equal_hugging_face(mm_dir: str, reference, kw: dict) -> None:
    llm = LLM(model=mm_dir, mm_processor_kwargs=PAS, **{"num_gpu_blocks": 256, **kw})
    try:
        by_text = llm.generate([{"prompt": text, "multi_modal_data": {"image": images}}
                                for text, images in cases()], GREEDY)
        assert [o.prompt_token_ids for o in by_text] == [ids for ids, _ in reference]
        assert [o.outputs[0].token_ids for o in by_text] == [toks for _, toks in reference]
        by_ids = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": images}}
                               for (ids, _), (_, images) in zip(reference, cases())], GREEDY)
        assert [o.outputs[0].token_ids for o in by_ids] == [toks for _, toks in reference]
        if "preemption_mode" in kw:
            assert llm.engine.scheduler.num_preemptions["recompute"] > 0
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(not _has_pillow(), reason="needs Pillow (images)")
def test_pan_and_scan_on_cuda_equals_hugging_face_on_cuda(mm_dir: str) -> None:
    """On the GPU: every crop's run through the encoder and the masked image op, in
    chunks, decode in CUDA graphs; HF's processor and ``generate`` on the same device."""
    want = hf_generate(mm_dir, cases(), device="cuda")
    llm = LLM(model=mm_dir, device="cuda", num_gpu_blocks=128, max_num_batched_tokens=40,
              max_num_seqs=4, mm_processor_kwargs=PAS)
    try:
        outs = llm.generate([{"prompt": text, "multi_modal_data": {"image": images}}
                             for text, images in cases()], GREEDY)
        assert [(o.prompt_token_ids, o.outputs[0].token_ids) for o in outs] == want
    finally:
        llm.shutdown()


def test_chat_counts_crops_and_the_cache_keys_each_view(mm_dir: str, reference) -> None:
    """``LLM.chat`` reads the pictures to count their crops before writing the runs;
    the same picture again is a prefix-cache hit through all its runs, another one
    of its size is not."""
    llm = LLM(model=mm_dir, mm_processor_kwargs=PAS, num_gpu_blocks=256, block_size=4)
    try:
        content = [{"type": "text", "text": "t5"}]
        for img, word in zip(pictures(), ("t6", "t7", "t8"), strict=True):
            content += [{"type": "image_url", "image_url": {"url": data_url(img)}},
                        {"type": "text", "text": word}]
        chat = llm.chat([{"role": "user", "content": content}], GREEDY)[0]
        parts = [p if p["type"] == "text" else {"type": "image"} for p in content]
        text = hf_processor(mm_dir).tokenizer.apply_chat_template(
            [{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True)
        (ids, toks), = hf_generate(mm_dir, [(text, pictures())])
        assert chat.prompt_token_ids == ids and chat.outputs[0].token_ids == toks
        again = llm.generate({"prompt": TEXT, "multi_modal_data": {"image": pictures()}},
                             GREEDY)[0]
        assert again.outputs[0].token_ids == reference[0][1]
        assert again.num_cached_tokens == 0  # (the chat's prompt began otherwise)
        repeat = llm.generate({"prompt": TEXT, "multi_modal_data": {"image": pictures()}},
                              GREEDY)[0]
        assert repeat.num_cached_tokens == (len(reference[0][0]) - 1) // 4 * 4
        other = [random_picture(9, (120, 40)), *pictures()[1:]]
        changed = llm.generate({"prompt": TEXT, "multi_modal_data": {"image": other}},
                               GREEDY)[0]
        first_run = reference[0][0].index(IMG)
        assert changed.num_cached_tokens == first_run // 4 * 4
    finally:
        llm.shutdown()


def test_a_request_switches_pan_and_scan_for_its_own_pictures(mm_dir: str, reference) -> None:
    """vLLM's per-request ``mm_processor_kwargs``: one request cuts its pictures
    beside one that does not (the same pictures, no cache hit between them), on an
    engine with it off; on an engine with it on, a request turns it off."""
    plain = hf_generate(mm_dir, [(TEXT, pictures())], {"do_pan_and_scan": False})[0]
    assert plain[0] != reference[0][0]
    llm = LLM(model=mm_dir, num_gpu_blocks=256, block_size=4)
    try:
        cut, whole = llm.generate([
            {"prompt": TEXT, "multi_modal_data": {"image": pictures()},
             "mm_processor_kwargs": PAS},
            {"prompt": TEXT, "multi_modal_data": {"image": pictures()}}], GREEDY)
        assert (cut.prompt_token_ids, cut.outputs[0].token_ids) == reference[0]
        assert (whole.prompt_token_ids, whole.outputs[0].token_ids) == plain
        again = llm.generate({"prompt": TEXT, "multi_modal_data": {"image": pictures()}},
                             GREEDY)[0]
        assert again.num_cached_tokens == (len(plain[0]) - 1) // 4 * 4
        content = [{"type": "image_url", "image_url": {"url": data_url(pictures()[0])}}]
        chat = llm.chat([{"role": "user", "content": content}], GREEDY,
                        mm_processor_kwargs=PAS)[0]
        assert chat.prompt_token_ids.count(IMG) == 4 * N  # the picture and its 3 crops
    finally:
        llm.shutdown()
    on = LLM(model=mm_dir, num_gpu_blocks=256, mm_processor_kwargs=PAS)
    try:
        off = on.generate({"prompt": TEXT, "multi_modal_data": {"image": pictures()},
                           "mm_processor_kwargs": {"do_pan_and_scan": False}}, GREEDY)[0]
        assert (off.prompt_token_ids, off.outputs[0].token_ids) == plain
        with pytest.raises(ValueError, match=r"mm_processor_kwargs\.max_pixels: not an"):
            on.generate({"prompt": TEXT, "multi_modal_data": {"image": pictures()},
                         "mm_processor_kwargs": {"max_pixels": 10}}, GREEDY)
        assert_pool_at_baseline(on)
    finally:
        on.shutdown()


def test_runs_that_do_not_fit_the_crops_and_foreign_options_are_refused(
        mm_dir: str, reference) -> None:
    llm = LLM(model=mm_dir, mm_processor_kwargs=PAS, num_gpu_blocks=64)
    try:
        plain = [1, 5, 297, *[IMG] * N, 298, 6]  # one run for a picture with 3 crops
        with pytest.raises(ValueError, match="has 1 image runs, its 1 pictures take 4"):
            llm.generate({"prompt_token_ids": plain,
                          "multi_modal_data": {"image": pictures()[:1]}}, GREEDY)
        with pytest.raises(ValueError, match=r"marks 3 images .* but 2 were given"):
            llm.generate({"prompt": TEXT, "multi_modal_data": {"image": pictures()[:2]}},
                         GREEDY)
        thin = random_picture(6, (20000, 1))  # 20,000 crops of 1 pixel: refused uncut
        with pytest.raises(ValueError, match="over the model's context of 1024"):
            llm.generate({"prompt": "<start_of_image>", "multi_modal_data": {"image": thin},
                          "mm_processor_kwargs": {"pan_and_scan_min_crop_size": 1,
                                                  "pan_and_scan_max_num_crops": 10**6}},
                         GREEDY)
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match=r"mm_processor_kwargs\.min_pixels: not an option "
                                         r"of gemma3's processor"):
        LLM(model=mm_dir, mm_processor_kwargs={"min_pixels": 784})
    with pytest.raises(ValueError, match="pan_and_scan_max_num_crops must be an integer"):
        LLM(model=mm_dir, mm_processor_kwargs={"pan_and_scan_max_num_crops": 0})
    with pytest.raises(ValueError, match="must be a JSON object"):
        LLM(model=mm_dir, mm_processor_kwargs="do_pan_and_scan")
