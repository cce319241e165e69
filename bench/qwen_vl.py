"""Qwen2-VL image prompts: the engine against Hugging Face's batched ``generate`` on the
same random checkpoint, in one run.

A random ``Qwen2VLForConditionalGeneration`` (``--kind qwen2_5_vl``: Qwen2.5-VL's, with
window attention) is written to a temporary directory: a tower of ``--vision-layers``
layers with 14-pixel patches and a 2x2 merge, a Qwen2 decoder of ``--layers`` layers
with M-RoPE. ``--requests`` prompts, each some text, one picture of
``--image-size`` pixels square (its own random pixels; ``(size / 28)^2`` tokens) and
more text, all the same length, get ``--max-tokens`` greedy tokens: through
``LLM.generate`` (continuous batching, each picture encoded in the step that prefills
it, M-RoPE positions from its grid) and through transformers' ``generate`` on the whole
batch at once (the prompts are the same length, so no padding: its best case). Both
use fp32 and the processor's pixels. Printed: wall time and output tokens/s each, the
ratio, and how many requests got the same tokens from both.

    python bench/qwen_vl.py
    python bench/qwen_vl.py --json bench/figures/qwen_vl.json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from images import ours_warmed, report  # sibling scripts

from pagedserve.worker.testing import random_picture
from pagedserve.worker.testing_qwen_vl import write_random_qwen2_vl


def prompt(i: int, vocab: int, tokens_per_image: int, text: int,
           pad_offset: int = 1) -> list[int]:
    """``text`` words, a run of the placeholder (``vocab - pad_offset``: the image's;
    8, the video's) framed by the vision tokens, ``text`` more words."""
    start, end, pad = vocab - 3, vocab - 2, vocab - pad_offset
    words = [10 + (37 * i + 11 * j) % (vocab - 20) for j in range(2 * text)]
    return [*words[:text], start, *[pad] * tokens_per_image, end, *words[text:]]


VOCAB = 1024


def model_flags(ap: argparse.ArgumentParser) -> None:
    """The flags ``write_bench_model`` reads (and ``--json``), shared by both benches."""
    ap.add_argument("--kind", default="qwen2_vl", choices=("qwen2_vl", "qwen2_5_vl"))
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vision-layers", type=int, default=4)
    ap.add_argument("--json", default=None)


def write_bench_model(dest: str, args: argparse.Namespace, max_pixels: int = 56 * 56,
                      tokens_per_second: float | None = None) -> str:
    """The random ``args.kind`` checkpoint both Qwen-VL benches run: a tower of
    ``args.vision_layers`` layers (width 256, 14-pixel patches; Qwen2.5-VL's with
    112-pixel windows, a last full-attention layer and, if given, ``tokens_per_second``)
    and a decoder of ``args.layers`` layers of width ``args.hidden`` with M-RoPE sections
    2/8, 3/8, 3/8 of a half head; pictures up to ``max_pixels``."""
    heads = 4
    eighth = args.hidden // heads // 16
    vision = dict(depth=args.vision_layers, embed_dim=256, num_heads=4, patch_size=14)
    if args.kind == "qwen2_5_vl":
        vision.update(hidden_size=256, intermediate_size=512, window_size=112,
                      fullatt_block_indexes=[args.vision_layers - 1])
        if tokens_per_second is not None:
            vision["tokens_per_second"] = tokens_per_second
    return write_random_qwen2_vl(
        dest, args.kind, vocab_size=VOCAB, vision_config=vision, max_pixels=max_pixels,
        hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "mrope_section": [2 * eighth, 3 * eighth, 3 * eighth]})


def hugging_face(path: str, prompts: list[list[int]], images: list, max_tokens: int,
                 image_token: int) -> tuple[float, list[list[int]]]:
    import transformers as tf
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    model = tf.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    proc = Qwen2VLImageProcessorPil.from_pretrained(path)
    x = torch.tensor(prompts)

    def kwargs(rows: slice) -> dict:
        px = proc(images[rows], return_tensors="pt")
        return dict(attention_mask=torch.ones_like(x[rows]),
                    mm_token_type_ids=(x[rows] == image_token).int(),
                    pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"],
                    do_sample=False, pad_token_id=0)

    with torch.inference_mode():
        model.generate(x[:2], **kwargs(slice(0, 2)), max_new_tokens=2)  # warm-up
        t0 = time.perf_counter()
        y = model.generate(x, **kwargs(slice(None)), max_new_tokens=max_tokens,
                           min_new_tokens=max_tokens)
        wall = time.perf_counter() - t0
    return wall, y[:, x.shape[1]:].tolist()


def main() -> None:
    ap = argparse.ArgumentParser()
    model_flags(ap)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--text", type=int, default=48, help="text tokens each side of the image")
    ap.add_argument("--image-size", type=int, default=224)
    args = ap.parse_args()
    if args.image_size % 28:
        ap.error("--image-size must be a multiple of 28 (patch 14 x merge 2)")
    vocab = VOCAB
    with tempfile.TemporaryDirectory() as tmp:
        path = write_bench_model(tmp, args, max_pixels=args.image_size ** 2)
        tokens_per_image = (args.image_size // 28) ** 2
        prompts = [prompt(i, vocab, tokens_per_image, args.text)
                   for i in range(args.requests)]
        images = [random_picture(i, (args.image_size, args.image_size))
                  for i in range(args.requests)]
        warm = [random_picture(1000 + i, (args.image_size, args.image_size)) for i in (0, 1)]
        ours_run = ours_warmed(path, prompts, images, warm, args.max_tokens)
        hf_run = hugging_face(path, prompts, images, args.max_tokens, vocab - 1)
    report(args, f"{args.kind}: {args.requests} prompts of {len(prompts[0])} tokens (one "
                 f"{args.image_size}px picture, {tokens_per_image} tokens) + "
                 f"{args.max_tokens} new", ours_run, hf_run)

if __name__ == "__main__":
    main()
