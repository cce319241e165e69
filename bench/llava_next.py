"""LLaVA-NeXT (or ``--kind llava_onevision``) image prompts: the engine against Hugging
Face's batched ``generate`` on the same random checkpoint, in one run.

A random ``LlavaNextForConditionalGeneration`` is written to a temporary directory: a
2-layer CLIP tower over ``--crop``-pixel crops with 14-pixel patches, canvases of 1 x 2,
2 x 1 and 2 x 2 crops, a Llama decoder of ``--layers`` layers (LLaVA-OneVision: a
SigLIP tower, grids shrunk past ``anyres_max_4``). ``--requests`` prompts,
each some text, one ``--width`` x ``--height`` picture (its own random pixels: the
whole picture and its canvas's crops, unpadded, with a newline closing each row) and
more text, all the same length, get ``--max-tokens`` greedy tokens: through
``LLM.generate`` (continuous batching, each picture's crops encoded in the step that
prefills it) and through transformers' ``generate`` on the whole batch at once (the
prompts are the same length, so no padding: its best case). Both use fp32 and the
processor's pixels. Printed: wall time and output tokens/s each, the ratio, and how
many requests got the same tokens from both.

    python bench/llava_next.py --json bench/figures/llava_next.json
    python bench/llava_next.py --kind llava_onevision --json bench/figures/llava_onevision.json
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

from pagedserve.worker.anyres import anyres_token_count
from pagedserve.worker.testing import random_picture, write_random_llava


def prompt(i: int, vocab: int, tokens_per_image: int, text: int) -> list[int]:
    words = [3 + (37 * i + 11 * j) % (vocab - 10) for j in range(2 * text)]
    return [1, *words[:text], *[vocab - 1] * tokens_per_image, *words[text:]]


def hugging_face(path: str, prompts: list[list[int]], images: list, max_tokens: int
                 ) -> tuple[float, list[list[int]]]:
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    proc = AutoImageProcessor.from_pretrained(path, backend="pil")
    x = torch.tensor(prompts)

    def kwargs(rows: slice) -> dict:
        return dict(attention_mask=torch.ones_like(x[rows]), do_sample=False, pad_token_id=0,
                    **proc(images[rows], return_tensors="pt"))

    with torch.inference_mode():
        model.generate(x[:2], **kwargs(slice(0, 2)), max_new_tokens=2)  # warm-up
        t0 = time.perf_counter()
        y = model.generate(x, **kwargs(slice(None)), max_new_tokens=max_tokens,
                           min_new_tokens=max_tokens)
        wall = time.perf_counter() - t0
    return wall, y[:, x.shape[1]:].tolist()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", default="llava_next", choices=("llava_next", "llava_onevision"))
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--text", type=int, default=48, help="text tokens each side of the image")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--crop", type=int, default=112, help="the tower's square input")
    ap.add_argument("--width", type=int, default=200)
    ap.add_argument("--height", type=int, default=150)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.crop % 14:
        ap.error("--crop must be a multiple of 14 (the patch)")
    vocab, c = 1024, args.crop
    pinpoints = [[c, 2 * c], [2 * c, c], [2 * c, 2 * c]]
    with tempfile.TemporaryDirectory() as tmp:
        max_crops = 4 if args.kind == "llava_onevision" else None
        path = write_random_llava(
            tmp, vocab_size=vocab, image_size=c, patch_size=14, pinpoints=pinpoints,
            onevision_max_crops=max_crops, hidden_size=args.hidden,
            intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
            num_attention_heads=4, num_key_value_heads=2)
        tokens_per_image = anyres_token_count(args.height, args.width,
                                              [tuple(p) for p in pinpoints], c, 14, max_crops)
        prompts = [prompt(i, vocab, tokens_per_image, args.text)
                   for i in range(args.requests)]
        size = (args.width, args.height)
        images = [random_picture(i, size) for i in range(args.requests)]
        warm = [random_picture(1000 + i, size) for i in (0, 1)]
        ours_run = ours_warmed(path, prompts, images, warm, args.max_tokens,
                               num_gpu_blocks=4096)
        hf_run = hugging_face(path, prompts, images, args.max_tokens)
    report(args, f"{args.kind}: {args.requests} prompts of {len(prompts[0])} tokens (one "
                 f"{args.width}x{args.height} picture, {tokens_per_image} tokens) + "
                 f"{args.max_tokens} new", ours_run, hf_run)


if __name__ == "__main__":
    main()
