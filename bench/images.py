"""Image prompts: the engine against Hugging Face's batched ``generate`` on the same
random multimodal Gemma 3, in one run.

A random ``Gemma3ForConditionalGeneration`` (a SigLIP tower of ``--vision-layers``
layers over ``--image-size`` pixels, a Gemma 3 decoder whose layers slide over
``--window`` tokens but every sixth) is written to a temporary directory.
``--requests`` prompts, each some text, one image (its own random picture) and more
text, all the same length, get ``--max-tokens`` greedy tokens: through
``LLM.generate`` (continuous batching, the images encoded in the steps that
prefill them) and through transformers' ``generate`` on the whole batch at once (no
padding is needed: the prompts are the same length, its best case). Both use fp32
and the processor's pixels. Printed: wall time and output tokens/s each, the ratio,
and how many requests got the same tokens from both.

    python bench/images.py
    python bench/images.py --json bench/figures/images.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from provenance import machine, tree_commit  # a sibling script

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.worker.testing import random_picture, write_random_gemma3_multimodal


def prompt(i: int, vocab: int, tokens_per_image: int, text: int) -> list[int]:
    boi, img, eoi = vocab - 3, vocab - 1, vocab - 2
    words = [10 + (37 * i + 11 * j) % (vocab - 20) for j in range(2 * text)]
    return [1, *words[:text], boi, *[img] * tokens_per_image, eoi, *words[text:]]


def ours(path: str, prompts: list[list[int]], images: list, max_tokens: int
         ) -> tuple[float, list[list[int]]]:
    llm = LLM(model=path, num_gpu_blocks=2048)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        batch = [{"prompt_token_ids": p, "multi_modal_data": {"image": img}}
                 for p, img in zip(prompts, images, strict=True)]
        llm.generate(batch[:2], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = llm.generate(batch, params)
        return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()


def ours_warmed(path: str, prompts: list[list[int]], images: list, warm: list,
                max_tokens: int, num_gpu_blocks: int = 2048,
                kind: str = "image") -> tuple[float, list[list[int]]]:
    """The engine's run of ``prompts``, timed after a warm-up on two other pictures
    (neither the prefix cache nor the encoder cache holds the timed ones);
    ``qwen_vl.py``, ``qwen_vl_video.py`` (``kind`` "video") and ``llava_next.py``."""
    llm = LLM(model=path, num_gpu_blocks=num_gpu_blocks)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p, "multi_modal_data": {kind: img}}
                      for p, img in zip(prompts[:2], warm, strict=True)],
                     SamplingParams(temperature=0.0, max_tokens=2))
        llm.reset_prefix_cache()
        batch = [{"prompt_token_ids": p, "multi_modal_data": {kind: img}}
                 for p, img in zip(prompts, images, strict=True)]
        t0 = time.perf_counter()
        outs = llm.generate(batch, params)
        return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()


def hugging_face(path: str, prompts: list[list[int]], images: list, max_tokens: int,
                 image_token: int) -> tuple[float, list[list[int]]]:
    from transformers import AutoImageProcessor, Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    proc = AutoImageProcessor.from_pretrained(path, backend="pil")
    x = torch.tensor(prompts)
    kw = dict(attention_mask=torch.ones_like(x), token_type_ids=(x == image_token).long(),
              pixel_values=proc(images, return_tensors="pt")["pixel_values"],
              do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(x[:2], **{**kw, "attention_mask": kw["attention_mask"][:2],
                                 "token_type_ids": kw["token_type_ids"][:2],
                                 "pixel_values": kw["pixel_values"][:2]},
                       max_new_tokens=2)  # warm-up
        t0 = time.perf_counter()
        y = model.generate(x, **kw, max_new_tokens=max_tokens, min_new_tokens=max_tokens)
        wall = time.perf_counter() - t0
    return wall, y[:, x.shape[1]:].tolist()


def report(args: argparse.Namespace, title: str, ours_run: tuple[float, list[list[int]]],
           hf_run: tuple[float, list[list[int]]]) -> None:
    """Print both runs' wall time and output tokens/s (``args.requests`` x
    ``args.max_tokens`` tokens each), their ratio and how many requests got the same
    tokens; with ``--json``, write them with the tree and machine (``qwen_vl.py`` too)."""
    n_out = args.requests * args.max_tokens
    (ours_s, ours_tokens), (hf_s, hf_tokens) = ours_run, hf_run
    same = sum(a == b for a, b in zip(ours_tokens, hf_tokens, strict=True))
    res = {"pagedserve": {"wall_s": ours_s, "tok_per_s": n_out / ours_s},
           "hf_generate_batched": {"wall_s": hf_s, "tok_per_s": n_out / hf_s}}
    ratio = res["pagedserve"]["tok_per_s"] / res["hf_generate_batched"]["tok_per_s"]
    print(f"{title}; {machine()}")
    for name, r in res.items():
        print(f"{name:<22} {r['wall_s']:>8.2f} s {r['tok_per_s']:>8.1f} tok/s")
    print(f"pagedserve / HF batched generate: {ratio:.2f}x tokens/s; "
          f"same tokens: {same}/{args.requests}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": res, "ratio": ratio,
                       "same_tokens": same, "commit": tree_commit(), "machine": machine()},
                      f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--text", type=int, default=48, help="text tokens each side of the image")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--vision-layers", type=int, default=4)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--tokens-per-image", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    vocab = 1024
    layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                   for i in range(args.layers)]
    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_gemma3_multimodal(
            tmp, vocab_size=vocab, image_size=args.image_size, patch_size=14,
            tokens_per_image=args.tokens_per_image,
            vision_config=dict(hidden_size=256, intermediate_size=1024,
                               num_hidden_layers=args.vision_layers, num_attention_heads=4),
            hidden_size=args.hidden, intermediate_size=4 * args.hidden,
            num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
            head_dim=args.hidden // 4, query_pre_attn_scalar=args.hidden // 4,
            sliding_window=args.window, layer_types=layer_types)
        prompts = [prompt(i, vocab, args.tokens_per_image, args.text)
                   for i in range(args.requests)]
        images = [random_picture(i, (400, 300)) for i in range(args.requests)]
        ours_s, ours_tokens = ours(path, prompts, images, args.max_tokens)
        hf_s, hf_tokens = hugging_face(path, prompts, images, args.max_tokens, vocab - 1)
    report(args, f"{args.requests} prompts of {len(prompts[0])} tokens (one "
                 f"{args.image_size}px image, {args.tokens_per_image} tokens) + "
                 f"{args.max_tokens} new", (ours_s, ours_tokens), (hf_s, hf_tokens))

if __name__ == "__main__":
    main()
