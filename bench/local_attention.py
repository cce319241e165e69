"""A local (sliding-window) encoder layer's attention: query chunks against the band
of keys each can reach, against SDPA over the full square with the band as a mask.

Same prompt, same q / k / v, one run (``worker.models.prompt_batch``): ModernBERT's
local layers see ``--window`` (64) positions each side; its base model has 12
heads of 64. Prints each way's time per call at each length, the ratio, and the
largest difference between their outputs.

    python bench/local_attention.py
    python bench/local_attention.py --lengths 1024 8192 --json bench/figures/local_attention.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from pagedserve.worker.models import prompt_batch


def _time(batch: prompt_batch.PromptBatch, qkv: tuple[torch.Tensor, ...], window: int,
          repeats: int) -> tuple[float, torch.Tensor]:
    out = batch.attend(*qkv, window)  # (builds the plan, as a step's first layer does)
    t0 = time.perf_counter()
    for _ in range(repeats):
        out = batch.attend(*qkv, window)
    return (time.perf_counter() - t0) / repeats, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    chunked_from = prompt_batch.CHUNKED_FROM
    for n in args.lengths:
        qkv = tuple(torch.randn(n, args.heads, args.head_dim) for _ in range(3))
        cpu = torch.device("cpu")
        try:
            prompt_batch.CHUNKED_FROM = 0  # every long group chunked
            chunked, a = _time(prompt_batch.PromptBatch.of_lengths([n], cpu), qkv,
                               args.window, args.repeats)
            prompt_batch.CHUNKED_FROM = 1 << 30  # never: the banded square
            square, b = _time(prompt_batch.PromptBatch.of_lengths([n], cpu), qkv,
                              args.window, args.repeats)
        finally:
            prompt_batch.CHUNKED_FROM = chunked_from
        diff = (a - b).abs().max().item()
        rows.append({"tokens": n, "chunked_s": chunked, "square_s": square,
                     "speedup": square / chunked, "max_abs_diff": diff})
        print(f"{n:6d} tokens: chunks {chunked * 1e3:8.1f} ms, masked square "
              f"{square * 1e3:8.1f} ms: chunks are {square / chunked:5.2f}x; "
              f"max |difference| {diff:.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": platform.machine(), "threads": torch.get_num_threads(),
                       "cores": os.cpu_count(), "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
