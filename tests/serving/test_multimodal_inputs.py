"""Gemma 3 image inputs (``cluster/multimodal.py``) against Hugging Face's own processor.

The oracle is a real ``Gemma3Processor`` built offline: the PIL Gemma 3 image processor and
a small byte-level BPE tokenizer trained here, carrying Gemma 3's three image tokens. Its
``pixel_values`` and ``input_ids`` are what ours must equal exactly. Reading the images
themselves: ``test_load_image.py``.
"""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pagedserve.cluster.image_processor import ImageProcessor
from pagedserve.cluster.multimodal import (
    count_image_placeholders,
    expand_image_tokens,
    image_hash,
    image_spans,
    load_image,
    split_chat_images,
)

BOI, IMAGE, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
SIZE = 28
SEQ_LEN = 4


def random_image(rng: np.random.Generator, mode: str = "RGB") -> Image.Image:
    h, w = (int(x) for x in rng.integers(5, 70, size=2))
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = rng.integers(0, 256, size=(h, w, channels), dtype=np.uint8)
    return Image.fromarray(pixels[..., 0] if mode == "L" else pixels, mode=mode)


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def same_pixels(a: Image.Image, b: Image.Image) -> bool:
    return a.mode == b.mode and a.size == b.size and np.array_equal(np.asarray(a), np.asarray(b))


@pytest.fixture(scope="module")
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture(scope="module")
def image() -> Image.Image:
    return random_image(np.random.default_rng(7))


@pytest.fixture(scope="module")
def tokenizer():
    return bpe_tokenizer()


def bpe_tokenizer():
    """A byte-level BPE tokenizer (spaces and newlines are tokens) with Gemma 3's image
    tokens as special tokens, as the processor needs them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<bos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(["describe the image please\n\nthen compare them"] * 8, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<bos>", pad_token="<pad>",
        extra_special_tokens={"boi_token": BOI, "image_token": IMAGE, "eoi_token": EOI})


def hf_processor(tokenizer, image_processor=None):
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    from transformers.models.gemma3.processing_gemma3 import Gemma3Processor

    if image_processor is None:
        image_processor = Gemma3ImageProcessorPil(size={"height": SIZE, "width": SIZE})
    return Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer,
                           image_seq_length=SEQ_LEN)


# ImageProcessor: exactly Gemma3Processor's pixel_values


def mixed_images(rng: np.random.Generator) -> list[Image.Image]:
    return [random_image(rng, mode) for mode in ("RGB", "RGB", "RGBA", "L", "RGB")]


def test_pixels_equal_hf_processor_with_gemma3_defaults(tmp_path: Path, tokenizer,
                                                        rng: np.random.Generator) -> None:
    ours = ImageProcessor.from_model_dir(tmp_path, {"vision_config": {"image_size": SIZE}})
    images = mixed_images(rng)
    expected = hf_processor(tokenizer)(text=BOI * len(images), images=images,
                                       return_tensors="pt")["pixel_values"]
    got = ours(images)
    assert got.dtype == torch.float32 and got.shape == (len(images), 3, SIZE, SIZE)
    assert torch.equal(got, expected)
    assert ours.image_size == SIZE
    assert torch.equal(ours([load_image(png_bytes(im)) for im in images]), expected)


def test_pixels_equal_hf_processor_with_saved_preprocessor_config(
        tmp_path: Path, tokenizer, rng: np.random.Generator) -> None:
    from transformers import AutoImageProcessor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    Gemma3ImageProcessorPil(size={"height": SIZE, "width": SIZE}, image_mean=[0.4, 0.5, 0.6],
                            image_std=[0.2, 0.3, 0.4], resample=3).save_pretrained(tmp_path)
    ours = ImageProcessor.from_model_dir(tmp_path, {"vision_config": {"image_size": 896}})
    assert ours.image_size == SIZE
    images = mixed_images(rng)
    reference = hf_processor(tokenizer, AutoImageProcessor.from_pretrained(tmp_path))
    expected = reference(text=BOI * len(images), images=images,
                         return_tensors="pt")["pixel_values"]
    assert torch.equal(ours(images), expected)
    assert not torch.equal(ImageProcessor.from_model_dir(tmp_path / "x", {
        "vision_config": {"image_size": SIZE}})(images), expected)


def test_hub_style_config_with_nulls_converts_rgba_as_the_processor_does(
        tmp_path: Path, tokenizer, rng: np.random.Generator) -> None:
    """google/gemma-3-4b-it's preprocessor_config.json (size shrunk): do_convert_rgb is null
    there, and only the processor's own images_kwargs turn RGBA into RGB."""
    from transformers import AutoImageProcessor

    config = {"do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": None,
              "do_rescale": True, "do_resize": True, "image_mean": [0.5, 0.5, 0.5],
              "image_processor_type": "Gemma3ImageProcessor", "image_seq_length": 256,
              "image_std": [0.5, 0.5, 0.5], "pan_and_scan_max_num_crops": None,
              "pan_and_scan_min_crop_size": None, "pan_and_scan_min_ratio_to_activate": None,
              "processor_class": "Gemma3Processor", "resample": 2,
              "rescale_factor": 0.00392156862745098, "size": {"height": SIZE, "width": SIZE}}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    images = mixed_images(rng)
    reference = hf_processor(tokenizer, AutoImageProcessor.from_pretrained(tmp_path))
    expected = reference(text=BOI * len(images), images=images,
                         return_tensors="pt")["pixel_values"]
    assert torch.equal(ImageProcessor.from_model_dir(tmp_path, {})(images), expected)


def test_processor_config_json_is_read_like_auto_image_processor(
        tmp_path: Path, tokenizer, rng: np.random.Generator) -> None:
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    proc = hf_processor(tokenizer, Gemma3ImageProcessorPil(size={"height": 14, "width": 14}))
    proc.save_pretrained(tmp_path)
    assert not (tmp_path / "preprocessor_config.json").exists()
    ours = ImageProcessor.from_model_dir(tmp_path, {})
    images = mixed_images(rng)
    assert ours.image_size == 14
    assert torch.equal(ours(images), proc(text=BOI * len(images), images=images,
                                          return_tensors="pt")["pixel_values"])


def test_default_size_is_896_and_no_images_give_an_empty_batch(tmp_path: Path) -> None:
    ours = ImageProcessor.from_model_dir(tmp_path, {"model_type": "gemma3"})
    assert ours.image_size == 896
    assert ours([]).shape == (0, 3, 896, 896)


# image_hash


def test_image_hash_is_stable_and_sensitive_to_one_pixel(tmp_path: Path,
                                                         image: Image.Image) -> None:
    ours = ImageProcessor.from_model_dir(tmp_path, {"vision_config": {"image_size": SIZE}})
    pixels = ours([image])[0]
    h = image_hash(pixels)
    assert len(h) == 32 and int(h, 16) >= 0
    assert image_hash(pixels.clone()) == h == image_hash(ours([image.copy()])[0])
    changed = pixels.clone()
    changed[1, 5, 7] += 1e-3
    assert image_hash(changed) != h
    assert image_hash(pixels.reshape(3, SIZE * SIZE)) != h
    assert image_hash(pixels.to(torch.bfloat16)) != image_hash(pixels.to(torch.float16))
    assert image_hash(pixels.t() if pixels.dim() == 2 else pixels.transpose(1, 2)) != h


# expand_image_tokens, count_image_placeholders, image_spans: the processor's text and ids


def test_expansion_equals_gemma3_processor_text_and_ids(tokenizer, rng: np.random.Generator
                                                        ) -> None:
    proc = hf_processor(tokenizer)
    text = f"<bos>describe {BOI} then\n{BOI}{BOI}compare them"
    images = [random_image(rng) for _ in range(3)]
    ids = proc(text=text, images=images)["input_ids"][0]
    expanded = expand_image_tokens(text, BOI, IMAGE, EOI, SEQ_LEN)
    assert tokenizer.decode(ids) == expanded
    assert tokenizer(expanded)["input_ids"] == ids
    assert proc.full_image_sequence == expand_image_tokens(BOI, BOI, IMAGE, EOI, SEQ_LEN)
    assert proc.full_image_sequence == f"\n\n{BOI}{IMAGE * SEQ_LEN}{EOI}\n\n"
    assert count_image_placeholders(text, BOI) == 3
    assert expand_image_tokens("no images", BOI, IMAGE, EOI, SEQ_LEN) == "no images"


def test_image_spans_group_like_hf_block_sequence_ids(tokenizer, rng: np.random.Generator
                                                      ) -> None:
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

    proc = hf_processor(tokenizer)
    out = proc(text=f"<bos>a {BOI}{BOI} b {BOI}", images=[random_image(rng) for _ in range(3)],
               return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    spans = image_spans(ids, tokenizer.image_token_id)
    assert len(spans) == 3 and all(end - start == SEQ_LEN for start, end in spans)
    groups = get_block_sequence_ids_for_mask(out["token_type_ids"])[0].tolist()
    expected = [-1] * len(ids)
    for n, (start, end) in enumerate(spans):
        expected[start:end] = [n] * (end - start)
    assert groups == expected


@pytest.mark.parametrize(("ids", "spans"), [
    ([], []),
    ([1, 2, 3], []),
    ([1, 9, 9, 9, 2], [(1, 4)]),
    ([9, 9, 1, 9, 9], [(0, 2), (3, 5)]),
    ([1, 9, 9, 2, 9, 9, 3], [(1, 3), (4, 6)]),
    ([9], [(0, 1)]),
])
def test_image_spans_cases(ids: list[int], spans: list[tuple[int, int]]) -> None:
    assert image_spans(ids, 9) == spans


def test_expansion_rejects_nonsense_arguments() -> None:
    with pytest.raises(ValueError, match="tokens_per_image"):
        expand_image_tokens(BOI, BOI, IMAGE, EOI, 0)
    with pytest.raises(ValueError, match="boi_token"):
        expand_image_tokens("x", "", IMAGE, EOI, 4)


# split_chat_images


def test_split_chat_images_replaces_every_image_part_in_order(image: Image.Image) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [
            {"type": "text", "text": "compare"},
            {"type": "image_url", "image_url": {"url": "https://a/1.png", "detail": "low"}},
            {"type": "image_url", "image_url": "data:image/png;base64,AAAA"},
            {"type": "text", "text": "and"},
        ]},
        {"role": "assistant", "content": None},
        {"role": "user", "content": [
            {"type": "input_image", "image_url": "https://b/2.png"},
            {"type": "input_image", "image_url": {"url": "https://b/3.png"}},
            {"type": "image", "image": image},
            {"type": "image", "image": b"\x89PNG"},
            {"type": "input_text", "text": "?"},
        ]},
    ]
    before = copy.deepcopy(messages)
    converted, sources = split_chat_images(messages)
    assert sources == ["https://a/1.png", "data:image/png;base64,AAAA", "https://b/2.png",
                       "https://b/3.png", image, b"\x89PNG"]
    assert converted == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "compare"}, {"type": "image"},
                                     {"type": "image"}, {"type": "text", "text": "and"}]},
        {"role": "assistant", "content": None},
        {"role": "user", "content": [{"type": "image"}] * 4 + [{"type": "input_text",
                                                                "text": "?"}]},
    ]
    assert messages == before
    converted[1]["content"][0]["text"] = "changed"
    assert messages == before


@pytest.mark.parametrize(("part", "why"), [
    ({"type": "image_url"}, "needs 'image_url'"),
    ({"type": "image_url", "image_url": {"uri": "https://a"}}, "needs 'image_url'"),
    ({"type": "image_url", "image_url": ""}, "needs 'image_url'"),
    ({"type": "input_image", "file_id": "file-1"}, "file_id is not supported"),
    ({"type": "image"}, "needs 'image'"),
    ({"type": "image", "image": 3}, "needs 'image'"),
    ("just a string", "must be an object"),
])
def test_malformed_image_parts_name_their_place(part: object, why: str) -> None:
    messages = [{"role": "user", "content": "hi"},
                {"role": "user", "content": [{"type": "text", "text": "x"}, part]}]
    with pytest.raises(ValueError, match=r"messages\[1\]\.content\[1\]") as info:
        split_chat_images(messages)
    assert why in str(info.value)


def test_router_affinity_keys_tell_images_apart() -> None:
    """The ingress's affinity hashes: two prompts that differ only in their picture share
    the blocks before the image and none from it on; the same picture hashes the same."""
    from PIL import Image

    from pagedserve.cluster.image_chat import affinity_images
    from pagedserve.scheduler.block_hash import hash_prompt_blocks

    image = {"image_token_id": 9}
    ids = [1, 2, 3, 4, 5, 9, 9, 9, 9, 6, 7, 8]
    red, blue = Image.new("RGB", (4, 4), "red"), Image.new("RGB", (4, 4), "blue")
    a = hash_prompt_blocks(ids, 4, images=affinity_images(ids, [red], image))
    b = hash_prompt_blocks(ids, 4, images=affinity_images(ids, [blue], image))
    again = hash_prompt_blocks(ids, 4, images=affinity_images(ids, [red.copy()], image))
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2] and a == again
    assert affinity_images(ids, [red, blue], image) == []  # runs and images disagree
