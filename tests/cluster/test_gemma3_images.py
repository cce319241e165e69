"""Gemma 3 with images through the engine: greedy tokens equal Hugging Face's
``Gemma3ForConditionalGeneration.generate`` on a random checkpoint (a SigLIP tower,
its projector, a decoder whose 8-token sliding window is shorter than an image's 16
tokens), whole and in chunks, as prefix-cache hits, under recompute preemption and
beside text prompts in one batch; bad image input is refused with the field named."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest
import torch

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.worker.testing import random_picture, write_random_gemma3_multimodal
from tests.cluster.test_engine_behaviour import assert_pool_at_baseline

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
BOI, EOI, IMG, N = 297, 298, 299, 16


@pytest.fixture(scope="module")
def mm_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_random_gemma3_multimodal(tmp_path_factory.mktemp("gemma3_images"))


picture = random_picture


def image_run() -> list[int]:
    return [BOI] + [IMG] * N + [EOI]


def prompt_ids(*parts: list[int] | str) -> list[int]:
    """Text words ``t<i>`` as ids and image runs, in order."""
    ids = [1]
    for p in parts:
        ids += image_run() if p == "image" else list(p)
    return ids


def hf_reference(model_dir: str, prompts: list[tuple[list[int], list]], max_new: int,
                 device: str = "cpu") -> list[list[int]]:
    """Hugging Face's greedy tokens, one prompt at a time, with the processor's pixels
    and token types (its bidirectional image mask)."""
    from transformers import AutoImageProcessor, Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    model.to(device).eval()
    proc = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    outs = []
    with torch.inference_mode():
        for ids, images in prompts:
            x = torch.tensor([ids], device=device)
            kw = {}
            if images:
                kw["pixel_values"] = proc(images, return_tensors="pt")["pixel_values"].to(device)
                kw["token_type_ids"] = (x == IMG).long()
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                               max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=0,
                               **kw)
            outs.append(y[0, len(ids):].tolist())
    return outs


def cases() -> list[tuple[list[int], list]]:
    return [
        (prompt_ids([5, 6, 7], "image", [8, 9]), [picture(1)]),
        (prompt_ids("image", [10], "image", [11, 12, 13]), [picture(2), picture(3, (64, 64))]),
        (prompt_ids([20, 21, 22, 23, 24]), []),
        (prompt_ids([5, 6, 7], "image", [8, 9]), [picture(4)]),  # same text, another image
    ]


@pytest.fixture(scope="module")
def reference(mm_dir: str) -> list[list[int]]:
    return hf_reference(mm_dir, cases(), GREEDY.max_tokens)


def generate(llm: LLM, prompts: list[tuple[list[int], list]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": imgs}}
                         if imgs else ids for ids, imgs in prompts], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kw", [
    dict(),
    dict(max_num_batched_tokens=24, max_num_seqs=4),  # chunks stop before an image
    dict(attention_backend="torch"),
    dict(num_gpu_blocks=20, preemption_mode="recompute", block_size=4,
         disable_hybrid_kv_cache_manager=True),
    dict(num_gpu_blocks=20, preemption_mode="swap", num_cpu_blocks=64, block_size=4,
         disable_hybrid_kv_cache_manager=True),
    dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
], ids=["whole", "chunked", "torch-backend", "recompute", "swap", "ngram"])
def test_images_equal_hugging_face(mm_dir: str, reference: list[list[int]], kw: dict) -> None:
    llm = LLM(model=mm_dir, **{"num_gpu_blocks": 128, **kw})
    try:
        assert generate(llm, cases()) == reference
        if "preemption_mode" in kw:
            assert llm.engine.scheduler.num_preemptions[kw["preemption_mode"]] > 0
        pool = llm.engine.scheduler.kv.pool
        assert pool.num_free_blocks == pool.num_blocks
    finally:
        llm.shutdown()


def test_the_same_image_hits_the_prefix_cache_and_another_does_not(
        mm_dir: str, reference: list[list[int]]) -> None:
    llm = LLM(model=mm_dir, num_gpu_blocks=128, block_size=4)
    try:
        first = cases()[0]
        out = llm.generate({"prompt_token_ids": first[0],
                            "multi_modal_data": {"image": first[1]}}, GREEDY)[0]
        assert out.outputs[0].token_ids == reference[0]
        again = llm.generate({"prompt_token_ids": first[0],
                              "multi_modal_data": {"image": [picture(1)]}}, GREEDY)[0]
        assert again.outputs[0].token_ids == reference[0]
        assert again.num_cached_tokens == (len(first[0]) - 1) // 4 * 4
        ids, imgs = cases()[3]
        other = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": imgs}},
                             GREEDY)[0]
        assert other.outputs[0].token_ids == reference[3]
        assert other.num_cached_tokens == 4  # only the block before the image
    finally:
        llm.shutdown()


def data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_chat_with_an_image_part_renders_and_expands_as_the_processor_does(
        mm_dir: str, tmp_path: Path) -> None:
    """An OpenAI image part (data URL, or a file under ``allowed_local_media_path``)
    becomes the template's begin-of-image token, written out to its run before
    tokenising; the tokens equal the same prompt given as ids."""
    img = picture(5)
    img.save(tmp_path / "cat.png")
    llm = LLM(model=mm_dir, num_gpu_blocks=128, allowed_local_media_path=str(tmp_path))
    try:
        message = {"role": "user", "content": [
            {"type": "text", "text": "t5 t6"},
            {"type": "image_url", "image_url": {"url": data_url(img)}},
            {"type": "text", "text": "t7"}]}
        chat = llm.chat([message], GREEDY)[0]
        want_ids = ([1, 293, 295, 5, 6, 297] + [IMG] * N + [298, 7, 294, 293, 296])
        assert chat.prompt_token_ids == want_ids
        by_ids = llm.generate({"prompt_token_ids": want_ids,
                               "multi_modal_data": {"image": [img]}}, GREEDY)[0]
        assert chat.outputs[0].token_ids == by_ids.outputs[0].token_ids
        message["content"][1] = {"type": "image_url",
                                 "image_url": {"url": (tmp_path / "cat.png").as_uri()}}
        from_file = llm.chat([message], GREEDY)[0]
        assert from_file.outputs[0].token_ids == by_ids.outputs[0].token_ids
        text = llm.generate({"prompt": "t5 <start_of_image> t9",
                             "multi_modal_data": {"image": img}}, GREEDY)[0]
        assert text.prompt_token_ids == [5, *image_run(), 9]  # (this tokenizer adds no BOS)
    finally:
        llm.shutdown()


def test_bad_image_input_is_refused_naming_the_field(mm_dir: str, tmp_path: Path) -> None:
    llm = LLM(model=mm_dir, num_gpu_blocks=64, limit_mm_per_prompt={"image": 1})
    try:
        ids = prompt_ids([5], "image")
        bad = [
            ({"prompt_token_ids": ids, "multi_modal_data": {"image": [picture(1)] * 2}},
             "at most 1 image"),
            ({"prompt_token_ids": prompt_ids([5]), "multi_modal_data": {"image": picture(1)}},
             "marks 0 images"),
            ({"prompt_token_ids": [*ids[:-3], EOI]}, "without an image"),
            ({"prompt_token_ids": ids, "multi_modal_data": {"image": b"not an image"}},
             "image_url"),
            ({"prompt_token_ids": ids, "multi_modal_data": {"video": b""}},
             "videos: this model takes no videos"),
            ({"prompt_token_ids": ids, "multi_modal_data": {"audio": b""}}, "multi_modal_data"),
            ({"prompt_token_ids": ids, "multi_modal_data": {
                "image": (tmp_path / "x.png").as_uri()}}, "image_url"),
        ]
        for prompt, match in bad:
            with pytest.raises(ValueError, match=match):
                llm.generate(prompt, GREEDY)
        cut = SamplingParams(max_tokens=2, truncate_prompt_tokens=4)
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": picture(1)}},
                         cut)
        pool = llm.engine.scheduler.kv.pool
        assert pool.num_free_blocks == pool.num_blocks and not llm.engine._groups
    finally:
        llm.shutdown()


def test_an_image_no_step_can_hold_is_refused(mm_dir: str) -> None:
    llm = LLM(model=mm_dir, num_gpu_blocks=64, max_num_batched_tokens=12, max_num_seqs=4)
    try:
        with pytest.raises(ValueError, match="max_num_batched_tokens"):
            llm.generate({"prompt_token_ids": prompt_ids([5], "image"),
                          "multi_modal_data": {"image": picture(1)}}, GREEDY)
    finally:
        llm.shutdown()


def test_images_off_serves_the_file_as_text(mm_dir: str) -> None:
    llm = LLM(model=mm_dir, num_gpu_blocks=64, limit_mm_per_prompt={"image": 0})
    try:
        assert llm.engine.images is None
        with pytest.raises(ValueError, match="takes no images"):
            llm.generate({"prompt_token_ids": prompt_ids([5], "image"),
                          "multi_modal_data": {"image": picture(1)}}, GREEDY)
        assert llm.generate([prompt_ids([5, 6])], GREEDY)[0].outputs[0].token_ids
    finally:
        llm.shutdown()


def hf_prompt_logprobs(model_dir: str, ids: list[int], images: list) -> list[float]:
    """Hugging Face's logprob of each prompt token after the first, from one forward
    with the image mask (image rows see their whole image)."""
    from transformers import AutoImageProcessor, Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    proc = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    x = torch.tensor([ids])
    with torch.inference_mode():
        logits = model(x, pixel_values=proc(images, return_tensors="pt")["pixel_values"],
                       token_type_ids=(x == IMG).long(), attention_mask=torch.ones_like(x)
                       ).logits[0]
    lp = torch.log_softmax(logits.float(), -1)
    return [lp[i, ids[i + 1]].item() for i in range(len(ids) - 1)]


@pytest.mark.parametrize("budget", [2048, 20], ids=["whole", "chunked"])
def test_every_prompt_positions_logprob_equals_hugging_faces(mm_dir: str, budget: int) -> None:
    """Rows inside an image see the whole image (the bidirectional mask, through the
    sliding layers' 8-token window too): each prompt logprob within 1e-4 of HF's."""
    ids, images = cases()[1]
    want = hf_prompt_logprobs(mm_dir, ids, images)
    llm = LLM(model=mm_dir, num_gpu_blocks=128, max_num_batched_tokens=budget, max_num_seqs=4)
    try:
        out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": images}},
                           SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        got = [lp[tok] for lp, tok in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]
        got = [g.logprob if hasattr(g, "logprob") else g for g in got]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4
    finally:
        llm.shutdown()


def test_batch_invariant_image_prompts_do_not_depend_on_the_batch(mm_dir: str) -> None:
    """``batch_invariant``: an image prompt's tokens and logprobs are bit-identical alone
    and beside other image and text prompts (each image is encoded on its own)."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    llm = LLM(model=mm_dir, num_gpu_blocks=128, batch_invariant=True,
              enable_prefix_caching=False)
    try:
        prompts = [{"prompt_token_ids": ids, "multi_modal_data": {"image": imgs}}
                   if imgs else ids for ids, imgs in cases()]
        alone = llm.generate(prompts[1], params)[0].outputs[0]
        together = llm.generate(prompts, params)[1].outputs[0]
        assert alone.token_ids == together.token_ids
        assert alone.logprobs == together.logprobs
    finally:
        llm.shutdown()


def _has_pillow() -> bool:
    try:
        import PIL  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(not _has_pillow(), reason="needs Pillow (images)")
def test_images_on_cuda_equal_hugging_face_on_cuda(mm_dir: str) -> None:
    """On the GPU: the encoder, the masked image op and the Triton (or flash) kernels
    beside it in prefill, decode in CUDA graphs; HF ``generate`` on the same device."""
    ref = hf_reference(mm_dir, cases(), GREEDY.max_tokens, device="cuda")
    llm = LLM(model=mm_dir, device="cuda", num_gpu_blocks=128, max_num_batched_tokens=24,
              max_num_seqs=4)
    try:
        assert generate(llm, cases()) == ref
    finally:
        llm.shutdown()


def test_aborting_image_requests_mid_prefill_and_mid_decode_frees_everything(
        mm_dir: str, reference: list[list[int]]) -> None:
    """One image request aborted after its first chunk (before its image), one after
    its first tokens; the request beside them still gets HF's tokens, and the pool
    and the engine's request maps return to their baseline."""
    llm = LLM(model=mm_dir, num_gpu_blocks=128, max_num_batched_tokens=20, max_num_seqs=4)
    engine = llm.engine
    try:
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        (ids0, imgs0), (ids1, imgs1) = cases()[:2]
        early = engine.add_request(ids1, params, images=imgs1)
        late = engine.add_request(ids0, params, images=imgs0)
        keep = engine.add_request(*cases()[3][:1], params, images=cases()[3][1])
        engine.step()
        assert engine.scheduler.requests[early].num_computed_tokens < len(ids1)
        engine.abort_request(early)
        while not engine.scheduler.requests[late].output_token_ids:
            engine.step()
        engine.abort_request(late)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        assert done == {keep: reference[3]}
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_n2_samples_fork_after_the_image(mm_dir: str, reference: list[list[int]]) -> None:
    """``n=2`` greedy: both samples share the prompt's blocks (image included) and each
    gets HF's tokens."""
    ids, imgs = cases()[0]
    llm = LLM(model=mm_dir, num_gpu_blocks=128)
    try:
        out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": imgs}},
                           SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                          n=2))[0]
        assert [o.token_ids for o in out.outputs] == [reference[0]] * 2
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_image_prompts_kv_ships_to_a_decode_engine(mm_dir: str, reference) -> None:
    """Disaggregated prefill with images: the prefill engine names its blocks over an
    image by the picture too, so a decode engine asked for the same picture hits them
    (image included: no encoder run there) and answers as HF does, while the same text
    with another picture hits only the blocks before its image."""
    from pagedserve.cluster.kv_transfer import import_prompt_kv

    def engine() -> LLM:  # (one table: every block of the prompt ships)
        return LLM(model=mm_dir, num_gpu_blocks=128, block_size=4,
                   disable_hybrid_kv_cache_manager=True)

    pre, dec = engine(), engine()
    try:
        payloads = []
        for i, (ids, imgs) in enumerate(cases()):
            pre.engine.add_request(ids, SamplingParams(max_tokens=1), f"pf-{i}",
                                   export_kv=True, images=imgs or None)
            done = None
            while pre.engine.has_unfinished_requests():
                for out in pre.engine.step():
                    done = out.kv_transfer if out.finished else done
            payloads.append(done)
        assert payloads[0].block_hashes[0] == payloads[3].block_hashes[0]  # text only
        assert payloads[0].block_hashes[-1] != payloads[3].block_hashes[-1]  # its picture
        for i in (0, 1):
            assert import_prompt_kv(dec.engine, payloads[i]) == len(cases()[i][0]) // 4
        encoded: list[int] = []
        vision = dec.engine.executor.worker.model.vision
        vision.forward = _counting(vision.forward, encoded)
        # Case 1's two images lie in shipped blocks: nothing is encoded here.
        (out1,) = dec.generate([{"prompt_token_ids": cases()[1][0],
                                 "multi_modal_data": {"image": cases()[1][1]}}], GREEDY)
        assert out1.outputs[0].token_ids == reference[1] and not encoded
        assert out1.num_cached_tokens == (len(cases()[1][0]) - 1) // 4 * 4
        # Case 0's text with case 3's picture hits only the block before the image.
        outs = dec.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": imgs}}
                             for ids, imgs in (cases()[0], cases()[3])], GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == [reference[0], reference[3]]
        assert [o.num_cached_tokens for o in outs] == [(len(cases()[0][0]) - 1) // 4 * 4, 4]
        for llm in (pre, dec):
            assert_pool_at_baseline(llm)
    finally:
        pre.shutdown()
        dec.shutdown()


def test_the_same_picture_is_encoded_once_across_requests(mm_dir: str, reference) -> None:
    """Another text before the same picture misses the prefix cache but not the encoder
    cache: the picture is encoded once, and both answers are HF's. An encoder cache of
    no rows encodes it every time, with the same tokens."""
    other_text = (prompt_ids([30, 31], "image", [8, 9]), [picture(1)])
    ref = hf_reference(mm_dir, [other_text], GREEDY.max_tokens)[0]
    for budget, encodes in ((None, 1), (0, 2)):
        llm = LLM(model=mm_dir, num_gpu_blocks=128, block_size=4)
        try:
            runner = llm.engine.executor.worker.runner
            if budget is not None:
                runner.encoder_cache.max_rows = budget
            vision = llm.engine.executor.worker.model.vision
            calls: list[int] = []
            vision.forward = _counting(vision.forward, calls)
            assert generate(llm, [cases()[0]]) == [reference[0]]
            assert generate(llm, [other_text]) == [ref]
            assert len(calls) == encodes
            assert_pool_at_baseline(llm)
        finally:
            llm.shutdown()


def _counting(fn, calls: list[int]):
    """``fn``, appending to ``calls`` on every call."""
    def wrapped(*a, **k):
        calls.append(1)
        return fn(*a, **k)
    return wrapped
