"""``mm_processor_kwargs`` and Gemma 3's pan-and-scan without an engine: the options each
family's processor takes are checked by name; a picture's crop count, its pixels and
its prompt text equal Hugging Face's ``Gemma3Processor`` with ``do_pan_and_scan``;
Qwen2-VL's picture bounds move its grid as HF's processor moves it; the front end's
helpers group a picture's runs."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pagedserve.cluster.image_chat import affinity_images, image_chat_ids
from pagedserve.cluster.image_processor import ImageProcessor
from pagedserve.cluster.multimodal import expand_image_tokens
from pagedserve.cluster.processor_options import (
    MediaList,
    PanAndScan,
    check_processor_kwargs,
    crop_counts,
    options_of,
    pan_and_scan_inputs,
    request_info,
)
from tests.serving.test_multimodal_inputs import (
    BOI,
    EOI,
    IMAGE,
    SEQ_LEN,
    SIZE,
    bpe_tokenizer,
    hf_processor,
)

PAS = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 8}


@pytest.fixture
def tokenizer():
    return bpe_tokenizer()


def picture(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


# check_processor_kwargs


def test_each_family_takes_its_own_options_with_their_kinds() -> None:
    got = check_processor_kwargs({"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 64.0,
                                  "pan_and_scan_max_num_crops": 3,
                                  "pan_and_scan_min_ratio_to_activate": 2}, "gemma3")
    assert got == {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 64,
                   "pan_and_scan_max_num_crops": 3, "pan_and_scan_min_ratio_to_activate": 2.0}
    assert isinstance(got["pan_and_scan_min_crop_size"], int)
    for family in ("qwen2_vl", "qwen2_5_vl"):
        assert check_processor_kwargs({"min_pixels": 784, "max_pixels": 3136}, family) == {
            "min_pixels": 784, "max_pixels": 3136}
    assert check_processor_kwargs(None, "llama") == {}
    assert check_processor_kwargs({}, "llama") == {}


@pytest.mark.parametrize("kwargs, family, match", [
    ({"do_pan_and_scan": True}, "qwen2_vl", r"mm_processor_kwargs\.do_pan_and_scan: not an "
                                            r"option of qwen2_vl's processor \(it takes: fps, "
                                            r"max_frames, max_pixels, min_frames, min_pixels, "
                                            r"num_frames\)"),
    ({"fps": 1, "num_frames": 8}, "qwen2_5_vl", "fps and num_frames are mutually exclusive"),
    ({"min_frames": 9, "max_frames": 8}, "qwen2_vl", "min_frames 9 > max_frames 8"),
    ({"fps": -1}, "qwen2_vl", r"fps must be a number > 0"),
    ({"min_pixels": 784}, "gemma3", r"mm_processor_kwargs\.min_pixels: not an option"),
    ({"num_crops": 4}, "llava_next", r"it takes: none"),
    ({"do_pan_and_scan": True}, "llama", "model type 'llama' has no multimodal processor"),
    ({"do_pan_and_scan": True}, None, "model type None"),
    ({"do_pan_and_scan": 1}, "gemma3", r"do_pan_and_scan must be true or false, got 1"),
    ({"pan_and_scan_min_crop_size": True}, "gemma3", r"min_crop_size must be an integer"),
    ({"pan_and_scan_min_crop_size": 0}, "gemma3", r"min_crop_size must be an integer >= 1"),
    ({"pan_and_scan_max_num_crops": 2.5}, "gemma3", r"max_num_crops must be an integer"),
    ({"pan_and_scan_max_num_crops": "4"}, "gemma3", r"max_num_crops must be an integer"),
    ({"pan_and_scan_min_ratio_to_activate": 0}, "gemma3", r"must be a number > 0"),
    ({"pan_and_scan_min_ratio_to_activate": math.inf}, "gemma3", r"must be a number > 0"),
    ({"pan_and_scan_min_ratio_to_activate": math.nan}, "gemma3", r"must be a number > 0"),
    ({"min_pixels": 5000, "max_pixels": 4000}, "qwen2_vl", r"min_pixels 5000 > max_pixels"),
    ([("min_pixels", 1)], "qwen2_vl", "must be a JSON object"),
])
def test_a_bad_option_is_refused_by_name(kwargs, family, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_processor_kwargs(kwargs, family)


# crop counts: the processor's own arithmetic


def hf_crops(height: int, width: int, pas: PanAndScan) -> int:
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    return len(Gemma3ImageProcessorPil().pan_and_scan(
        np.zeros((3, height, width), np.uint8), pas.min_crop_size, pas.max_num_crops,
        pas.min_ratio_to_activate))


@pytest.mark.parametrize("pas", [PanAndScan(), PanAndScan(8, 4, 1.2), PanAndScan(30, 3, 1.5),
                                 PanAndScan(8, 1, 1.0), PanAndScan(100, 8, 2.0)],
                         ids=["defaults", "small", "three", "one-crop", "eight"])
def test_crop_count_is_the_processors_at_every_size(pas: PanAndScan) -> None:
    sides = (1, 7, 8, 9, 16, 20, 31, 64, 100, 255, 256, 257, 300, 512, 513, 768, 1024, 2000)
    for h, w in itertools.product(sides, sides):
        assert pas.crop_count(h, w) == hf_crops(h, w, pas), (h, w)


def test_crop_counts_read_the_front_ends_facts() -> None:
    facts = {"pan_and_scan": PanAndScan(8, 4, 1.2).facts(), "tokens_per_image": 4}
    pics = [picture(40, 10), picture(10, 40), picture(20, 20)]
    assert crop_counts(pics, facts) == [4, 4, 0]
    assert crop_counts(pics, {}) is None


def test_crops_past_the_context_are_refused_before_any_is_cut(tokenizer) -> None:
    """A long thin picture under tiny bounds (one request may set them) would be cut
    into thousands of crops: refused by its count, at the front a 400 on messages."""
    from pagedserve.cluster.protocol import APIError

    facts = {"family": "gemma3", "tokens_per_image": 256, "max_model_len": 4096,
             "pan_and_scan": PanAndScan(1, 10**6, 1.2).facts()}
    thin = picture(5000, 1)
    with pytest.raises(ValueError, match=r"into 5000 crops, the pictures take 1280256 "
                                         r"tokens, over the model's context of 4096"):
        crop_counts([thin], facts)
    assert crop_counts([picture(30, 10)], facts) == [3]  # 4 x 256 tokens fit
    vocab = tokenizer.get_vocab()
    info = {**facts, "marker_token_id": vocab[BOI], "image_token_id": vocab[IMAGE],
            "eoi_token_id": vocab[EOI]}
    tokenizer.chat_template = "{% for m in messages %}" + BOI + "{% endfor %}"
    with pytest.raises(APIError) as err:
        image_chat_ids(tokenizer, [{"role": "user", "content": [{"type": "image"}]}], info,
                       False, None, pictures=[thin])
    assert err.value.param == "messages" and "over the model's context" in str(err.value)


# pixels


def test_pan_and_scan_pixels_equal_the_processors(tmp_path: Path, tokenizer) -> None:
    ours = ImageProcessor.from_model_dir(tmp_path, {"vision_config": {"image_size": SIZE}},
                                         PAS)
    pics = [picture(60, 20, 1), picture(20, 20, 2), picture(15, 70, 3),
            picture(35, 25, 4).convert("RGBA")]
    want = hf_processor(tokenizer)(text=BOI * len(pics), images=pics, return_tensors="pt",
                                   **PAS)["pixel_values"]
    got = ours(pics)
    assert [tuple(p.shape) for p in got] == [(1 + n, 3, SIZE, SIZE) for n in (3, 0, 4, 2)]
    assert torch.equal(torch.cat(got), want)
    assert ours.pan_and_scan == PanAndScan(8, 4, 1.2)


def test_the_saved_config_turns_it_on_and_an_option_turns_it_off(tmp_path: Path) -> None:
    """A preprocessor config with ``do_pan_and_scan: true`` is served as the processor
    would call it (its own bounds); ``mm_processor_kwargs`` take precedence."""
    config = {"image_processor_type": "Gemma3ImageProcessor", "do_pan_and_scan": True,
              "pan_and_scan_min_crop_size": 10, "pan_and_scan_max_num_crops": 2,
              "size": {"height": SIZE, "width": SIZE}}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    saved = ImageProcessor.from_model_dir(tmp_path, {})
    assert saved.pan_and_scan == PanAndScan(10, 2, 1.2)
    assert [p.shape[0] for p in saved([picture(80, 20)])] == [3]
    off = ImageProcessor.from_model_dir(tmp_path, {}, {"do_pan_and_scan": False})
    assert off.pan_and_scan is None and off([picture(80, 20)]).shape == (1, 3, SIZE, SIZE)
    wider = ImageProcessor.from_model_dir(tmp_path, {}, {"pan_and_scan_max_num_crops": 4})
    assert wider.pan_and_scan == PanAndScan(10, 4, 1.2)


def test_qwen2_vl_picture_bounds_move_its_grid_as_the_processors() -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    cfg = {"model_type": "qwen2_vl", "vision_config": {}}
    bounds = {"min_pixels": 4 * 28 * 28, "max_pixels": 12 * 28 * 28}
    plain = ImageProcessor.from_model_dir("/nonexistent", cfg)
    bound = ImageProcessor.from_model_dir("/nonexistent", cfg, bounds)
    pic = picture(300, 200)
    want = Qwen2VLImageProcessorPil(**bounds)([pic], return_tensors="pt")["image_grid_thw"]
    grid = bound.grid(bound([pic])[0])  # in tokens: 2 x 2 patches each
    assert want[0].tolist() == [1, 2 * grid[0], 2 * grid[1]]
    assert grid != plain.grid(plain([pic])[0])
    assert bound.resize_facts() == {"factor": 28, **bounds}
    with pytest.raises(ValueError, match=r"min_pixels .* > max_pixels .* the processor's"):
        ImageProcessor.from_model_dir("/nonexistent", cfg, {"min_pixels": 10**9})


# prompts


def test_prompt_text_equals_the_processors(tokenizer) -> None:
    """Each marker becomes its picture's sentence, then tokenises as HF's processor
    tokenises its text (newlines and spaces around the runs included)."""
    pics = [picture(60, 20, 1), picture(20, 20, 2), picture(15, 70, 3)]
    text = f"describe{BOI}the image please\n\n{BOI} then {BOI}compare them"
    want = hf_processor(tokenizer)(text=text, images=pics, return_tensors="pt",
                                   **PAS)["input_ids"][0].tolist()
    expanded = expand_image_tokens(text, BOI, IMAGE, EOI, SEQ_LEN,
                                   crop_counts(pics, {"pan_and_scan": PanAndScan(8).facts()}))
    assert tokenizer.encode(expanded, add_special_tokens=False) == want
    assert "Here is the original image" in expanded
    with pytest.raises(ValueError, match=r"marks 3 images .* but 2 were given"):
        expand_image_tokens(text, BOI, IMAGE, EOI, SEQ_LEN, [1, 0])


def test_views_fill_the_runs_in_order() -> None:
    pixels = [torch.zeros(3, 3, 2, 2), torch.ones(1, 3, 2, 2)]
    runs = [(2, 6), (8, 12), (13, 17), (20, 24)]
    inputs = pan_and_scan_inputs(runs, pixels, ["a", "b"], 4)
    assert [(i.start, i.end, i.key, i.causal) for i in inputs] == [
        (2, 6, "a:0", False), (8, 12, "a:1", False), (13, 17, "a:2", False),
        (20, 24, "b:0", False)]
    assert torch.equal(inputs[3].pixels, pixels[1][0])
    with pytest.raises(ValueError, match="has 3 image runs, its 2 pictures take 4"):
        pan_and_scan_inputs(runs[:3], pixels, ["a", "b"], 4)
    with pytest.raises(ValueError, match="takes 4 placeholder tokens, the run at 20 has 3"):
        pan_and_scan_inputs([*runs[:3], (20, 23)], pixels, ["a", "b"], 4)


def test_the_front_writes_and_keys_a_pictures_runs(tokenizer) -> None:
    """The ingress counts crops from the decoded pictures: its ids are the processor's,
    and prefix affinity keys each picture over all its runs."""
    tokenizer.chat_template = ("{% for m in messages %}{% for p in m['content'] %}"
                               "{% if p['type'] == 'image' %}" + BOI + "{% else %}"
                               "{{ p['text'] }}{% endif %}{% endfor %}{% endfor %}")
    vocab = tokenizer.get_vocab()
    info = {"family": "gemma3", "marker_token_id": vocab[BOI], "image_token_id": vocab[IMAGE],
            "eoi_token_id": vocab[EOI], "tokens_per_image": SEQ_LEN,
            "pan_and_scan": PanAndScan(8).facts()}
    pics = [picture(60, 20, 1), picture(20, 20, 2)]
    content = [{"type": "text", "text": "describe"}, {"type": "image"},
               {"type": "text", "text": "then"}, {"type": "image"}]
    ids = image_chat_ids(tokenizer, [{"role": "user", "content": content}], info, False, None,
                         pictures=pics)
    want = hf_processor(tokenizer)(text=f"describe{BOI}then{BOI}", images=pics,
                                   return_tensors="pt", **PAS)["input_ids"][0].tolist()
    assert ids == want
    keys = affinity_images(ids, pics, info)
    runs = [i for i, t in enumerate(ids) if t == vocab[IMAGE]]
    assert [(k.start, k.end) for k in keys] == [(runs[0], runs[4 * SEQ_LEN - 1] + 1),
                                                (runs[4 * SEQ_LEN], runs[-1] + 1)]
    assert keys[0].key != keys[1].key


# one request's options


def test_a_requests_options_change_the_facts_the_front_counts_with() -> None:
    bounds = PanAndScan(10, 2, 1.2).facts()
    off = {"family": "gemma3", "tokens_per_image": 4, "pan_and_scan_bounds": bounds}
    on = {**off, "pan_and_scan": bounds}
    assert request_info(off, None) == off and request_info(on, {}) == on
    assert request_info(off, {"do_pan_and_scan": True})["pan_and_scan"] == bounds
    assert "pan_and_scan" not in request_info(on, {"do_pan_and_scan": False})
    moved = request_info(on, {"pan_and_scan_max_num_crops": 4})
    assert moved["pan_and_scan"] == {**bounds, "max_num_crops": 4}
    assert "pan_and_scan" not in request_info(off, {"pan_and_scan_max_num_crops": 4})
    qwen = {"family": "qwen2_vl", "resize": {"factor": 28, "min_pixels": 100,
                                             "max_pixels": 1000}}
    assert request_info(qwen, {"max_pixels": 500})["resize"] == {
        "factor": 28, "min_pixels": 100, "max_pixels": 500}
    with pytest.raises(ValueError, match=r"min_pixels 2000 > max_pixels 1000 \(the other"):
        request_info(qwen, {"min_pixels": 2000})
    with pytest.raises(ValueError, match=r"mm_processor_kwargs\.do_pan_and_scan"):
        request_info(qwen, {"do_pan_and_scan": True})


def test_a_requests_options_move_video_sampling_and_frame_bounds() -> None:
    """A rate replaces a count below it, a count wins over a rate (HF's precedence);
    the picture bounds move a video frame's too, each against its own saved bound."""
    video = {"factor": 28, "min_pixels": 500, "max_pixels": 5000, "temporal_patch_size": 2,
             "fps": 2.0, "min_frames": 4, "max_frames": 768, "num_frames": None}
    qwen = {"family": "qwen2_vl", "video": video,
            "resize": {"factor": 28, "min_pixels": 100, "max_pixels": 1000}}
    counted = request_info(qwen, {"num_frames": 8})["video"]
    assert counted == {**video, "num_frames": 8}
    assert request_info({**qwen, "video": counted}, {"fps": 1.0})["video"] == {
        **video, "fps": 1.0}
    moved = request_info(qwen, {"max_pixels": 800, "max_frames": 16})
    assert moved["resize"]["max_pixels"] == 800 and moved["video"]["max_pixels"] == 800
    assert moved["video"]["max_frames"] == 16
    with pytest.raises(ValueError, match=r"min_pixels 2000 > max_pixels 1000 \(the other "
                                         r"bound is the processor's\)"):
        request_info(qwen, {"min_pixels": 2000})
    with pytest.raises(ValueError, match="video processor's"):
        request_info({**qwen, "resize": None}, {"min_pixels": 6000})
    with pytest.raises(ValueError, match="min_frames / max_frames"):
        request_info(qwen, {"min_frames": 800})


def test_a_media_list_carries_its_options_through_pickling() -> None:
    import pickle

    items = MediaList(["a", "b"], {"max_pixels": 784})
    back = pickle.loads(pickle.dumps(items))
    assert back == ["a", "b"] and options_of(back) == {"max_pixels": 784}
    assert options_of(["a"]) == {} and options_of(MediaList(["a"])) == {}
