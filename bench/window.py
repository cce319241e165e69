"""Sliding-window decode: does its cost follow the window, not the context?

One layer's decode attention at Mistral-7B's shape (32 query heads, 8 KV heads, head
size 128, bf16 cache), for each backend on this machine, timed side by side in one
process (calls interleaved, best of ``--reps``):

- ``full@L``: every key of an ``L``-token context;
- ``win@L``: the same context through a ``--window``-token sliding window;
- ``full@W``: a context only as long as the window (the work ``win@L`` should cost).

Printed: win@L / full@L (how much the window saves) and win@L / full@W (1.0: the
window costs what a context of its own length costs, whatever ``L`` is). On a GPU the
Triton backend is timed too.

    python bench/window.py
    python bench/window.py --json bench/figures/window.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch

from pagedserve.kernels import available_backends, get_backend
from pagedserve.kernels.testing import make_paged_batch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from prefill_rows import best_interleaved  # a sibling script
from provenance import tree_commit  # a sibling script

HQ, HKV, D = 32, 8, 128  # Mistral-7B


def time_backend(name: str, device: str, seqs: int, context: int, window: int,
                 reps: int) -> dict[str, float]:
    """Seconds per call of full@L, win@L and full@W for one backend."""
    be = get_backend(name, device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    long = make_paged_batch([1] * seqs, [context] * seqs, HQ, HKV, D, 16, dtype=dtype,
                            device=device, extra_blocks=0, garbage=1.0,
                            kv_dtype=torch.bfloat16)
    short = make_paged_batch([1] * seqs, [window] * seqs, HQ, HKV, D, 16, dtype=dtype,
                             device=device, extra_blocks=0, garbage=1.0, seed=1,
                             kv_dtype=torch.bfloat16)
    lens_long = torch.full((seqs,), context, dtype=torch.int32, device=device)
    lens_short = torch.full((seqs,), window, dtype=torch.int32, device=device)
    scale = D ** -0.5

    def call(b, lens, w):
        return lambda: be.decode_attention(b.q, b.key_cache, b.value_cache, b.block_table,
                                           lens, scale, window=w)

    fns = {"full@L": call(long, lens_long, None), "win@L": call(long, lens_long, window),
           "full@W": call(short, lens_short, None)}
    if device == "cuda":
        from triton.testing import do_bench

        return {k: do_bench(fn, warmup=5, rep=10 * reps, return_mode="median") / 1e3
                for k, fn in fns.items()}
    return best_interleaved(fns, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--context", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    names = [n for n in available_backends(device) if n != "flash"]
    rows = []
    print(f"decode, {args.seqs} sequences, Mistral-7B heads ({HQ}q/{HKV}kv x {D}), bf16 "
          f"cache, window {args.window}, {device} ({platform.processor() or platform.machine()})")
    for context in args.context:
        for name in names:
            t = time_backend(name, device, args.seqs, context, args.window, args.reps)
            row = {"backend": name, "context": context, "window": args.window,
                   **{k: round(v * 1e3, 3) for k, v in t.items()},
                   "win_over_full": round(t["win@L"] / t["full@L"], 3),
                   "win_over_window_context": round(t["win@L"] / t["full@W"], 3)}
            rows.append(row)
            print(f"  {name:6s} L={context:6d}: full@L {row['full@L']:8.3f} ms  win@L "
                  f"{row['win@L']:8.3f} ms  full@W {row['full@W']:8.3f} ms   "
                  f"win/full {row['win_over_full']:.3f}  win/full@W "
                  f"{row['win_over_window_context']:.3f}")
    if args.json:
        out = {"commit": tree_commit(), "device": device, "machine": platform.machine(),
               "cpus": os.cpu_count(), "seqs": args.seqs, "rows": rows}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
