"""Qwen2-VL video prompts: the engine against Hugging Face's batched ``generate`` on the
same random checkpoint, in one run.

A random Qwen2-VL (``--kind qwen2_5_vl``: Qwen2.5-VL's) is written to a temporary
directory, as ``qwen_vl.py`` writes it, with the video processor's pixel bounds set to
``--size`` pixels square. ``--requests`` prompts, each some text, one video of
``--frames`` random frames of ``--size`` pixels (``frames / 2`` slices of ``(size /
28)^2`` tokens) and more text, all the same length, get ``--max-tokens`` greedy tokens:
through ``LLM.generate`` (each video processed, encoded slice by slice in the step that
prefills it, M-RoPE times from its rate) and through transformers' ``generate`` on the
whole batch at once with the same frames as ``pixel_values_videos`` (the prompts are the
same length, so no padding: its best case). fp32. Printed: wall time and output
tokens/s each, the ratio, and how many requests got the same tokens from both.

    python bench/qwen_vl_video.py
    python bench/qwen_vl_video.py --kind qwen2_5_vl --requests 16 --size 224 \
        --json bench/figures/qwen_vl_video_qwen2_5_vl.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from images import ours_warmed, report  # sibling scripts
from qwen_vl import VOCAB, model_flags, prompt, write_bench_model

from pagedserve.cluster.video import VideoClip
from pagedserve.cluster.video_processor import VideoProcessor
from pagedserve.worker.testing import random_picture


def clip(seed: int, frames: int, size: int) -> VideoClip:
    return VideoClip(tuple(random_picture(seed * 1000 + f, (size, size))
                           for f in range(frames)), 2.0)


def hf_inputs(path: str, kind: str, videos: list[VideoClip]) -> dict[str, torch.Tensor]:
    """The batch's ``pixel_values_videos`` (HF's video patch order), grids and seconds a
    slice, from the frames our processor gives (so both run on the same pixels)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    proc = VideoProcessor.from_model_dir(path, Qwen2VLImageProcessorPil.from_pretrained(path),
                                         None)
    p, m, tp = proc.patch, proc.merge, proc.temporal_patch_size
    rows, grids = [], []
    for v in videos:
        x = proc(v).frames
        t, c, h, w = x.shape
        x = x.reshape(t // tp, tp, c, h // p // m, m, p, w // p // m, m, p)
        rows.append(x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(-1, c * tp * p * p))
        grids.append([t // tp, h // p, w // p])
    out = {"pixel_values_videos": torch.cat(rows), "video_grid_thw": torch.tensor(grids)}
    if kind == "qwen2_5_vl":
        out["second_per_grid_ts"] = torch.tensor([tp / v.fps for v in videos])
    return out


def hugging_face(path: str, kind: str, prompts: list[list[int]], videos: list[VideoClip],
                 max_tokens: int, video_token: int) -> tuple[float, list[list[int]]]:
    import transformers as tf

    model = tf.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    x = torch.tensor(prompts)

    def kwargs(n: int | None) -> dict:
        rows = slice(None) if n is None else slice(0, n)
        return dict(attention_mask=torch.ones_like(x[rows]),
                    mm_token_type_ids=2 * (x[rows] == video_token).int(),
                    do_sample=False, pad_token_id=0, **hf_inputs(path, kind, videos[rows]))

    with torch.inference_mode():
        model.generate(x[:2], **kwargs(2), max_new_tokens=2)  # warm-up
        t0 = time.perf_counter()
        y = model.generate(x, **kwargs(None), max_new_tokens=max_tokens,
                           min_new_tokens=max_tokens)
        wall = time.perf_counter() - t0
    return wall, y[:, x.shape[1]:].tolist()


def main() -> None:
    ap = argparse.ArgumentParser()
    model_flags(ap)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--text", type=int, default=32, help="text tokens each side of the video")
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--size", type=int, default=112)
    args = ap.parse_args()
    if args.size % 28 or args.frames % 2:
        ap.error("--size must be a multiple of 28 (patch 14 x merge 2), --frames even")
    vocab = VOCAB
    with tempfile.TemporaryDirectory() as tmp:
        # Qwen2.5-VL at one token a second: the slices' times stay within the grid.
        path = write_bench_model(tmp, args, tokens_per_second=1)
        bounds = Path(path) / "video_preprocessor_config.json"
        config = json.loads(bounds.read_text())
        config["size"] = {"shortest_edge": 28 * 28, "longest_edge": args.size ** 2}
        config["max_frames"] = max(args.frames, 2)
        bounds.write_text(json.dumps(config))
        tokens = args.frames // 2 * (args.size // 28) ** 2
        prompts = [prompt(i, vocab, tokens, args.text, 8) for i in range(args.requests)]
        videos = [clip(i, args.frames, args.size) for i in range(args.requests)]
        warm = [clip(1000 + i, args.frames, args.size) for i in (0, 1)]
        ours_run = ours_warmed(path, prompts, videos, warm, args.max_tokens, kind="video")
        hf_run = hugging_face(path, args.kind, prompts, videos, args.max_tokens, vocab - 8)
    report(args, f"{args.kind}: {args.requests} prompts of {len(prompts[0])} tokens (one "
                 f"{args.frames}-frame {args.size}px video, {tokens} tokens) + "
                 f"{args.max_tokens} new", ours_run, hf_run)


if __name__ == "__main__":
    main()
