"""Prefill attention on CPU: the native kernel's runs of rows vs rows alone vs SDPA.

The "cpu" backend runs a prefill as native decode rows (each query row attends to
the keys up to its own position). Rows alone re-read the sequence's K/V once per
row; runs of ``cpu_native.ROWS_PER_CHUNK`` rows read each K/V tile once for the
whole run (each row's arithmetic unchanged, so batch-invariant mode keeps its
bits). This times, side by side in one process (calls interleaved, best of
``--reps``), one layer's prefill attention of each case on:

- ``runs``: ``CpuNativeBackend`` with every prefill on native rows, in runs;
- ``alone``: the same with ``rows_per_chunk = 1`` (one row per task);
- ``sdpa``: the torch backend (padded, masked SDPA per group of sequences).

and prints runs/alone and runs/sdpa (< 1: runs faster). The backend sends prefills
of up to ``cpu_backend.ROWS_MAX_KEYS`` keys to native rows and longer ones to SDPA;
batch-invariant mode sends all of them to native rows.

``--window W`` times the same under a sliding window of ``W`` keys (Gemma 3's local
layers, Mistral v0.1): each row of a run then starts at its own key, and a run reads
the union of its rows' windows once.

    python bench/prefill_rows.py
    python bench/prefill_rows.py --json bench/figures/prefill_rows.json
    python bench/prefill_rows.py --shapes gemma3-4b --window 1024 \
        --json bench/figures/prefill_rows_window.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from pagedserve.kernels import build_varlen_metadata, cpu_backend, cpu_native
from pagedserve.kernels.cpu_backend import CpuNativeBackend
from pagedserve.kernels.testing import make_paged_batch
from pagedserve.kernels.torch_ref import TorchBackend

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from provenance import tree_commit  # a sibling script

# query heads, KV heads, head dim
SHAPES = {"smollm2": (9, 3, 64), "llama-8b": (32, 8, 128), "gemma3-4b": (8, 4, 256)}
CASES = [(1, 128), (1, 512), (4, 512), (1, 1024), (1, 2048), (1, 4096)]  # prompts x tokens


def backends() -> dict[str, Any]:
    runs, alone = CpuNativeBackend(), CpuNativeBackend()
    runs.rows_max_keys = alone.rows_max_keys = math.inf
    alone.rows_per_chunk = 1
    return {"runs": runs, "alone": alone, "sdpa": TorchBackend()}


def time_case(shape: tuple[int, int, int], n: int, tokens: int, reps: int,
              window: int | None = None) -> dict[str, float]:
    """Best-of-reps seconds per backend for n prompts of ``tokens`` tokens, no context,
    under a sliding ``window`` if given."""
    hq, hkv, d = shape
    lens = [tokens] * n
    b = make_paged_batch(lens, lens, hq, hkv, d, 16, extra_blocks=0, garbage=1.0)
    md = build_varlen_metadata(lens, lens)
    fns = {name: (lambda be=be: be.varlen_attention(b.q, b.key_cache, b.value_cache,
                                                    b.block_table, md, d ** -0.5,
                                                    window=window))
           for name, be in backends().items()}
    outs = {name: fn() for name, fn in fns.items()}  # warm-up, and the results agree
    if not torch.equal(outs["runs"], outs["alone"]):
        raise AssertionError("runs of rows changed a row's bits")
    err = (outs["runs"] - outs["sdpa"]).abs().max().item()
    if err > 1e-4:
        raise AssertionError(f"native rows and SDPA differ by {err}")
    return best_interleaved(fns, reps)


def best_interleaved(fns: dict[str, Callable[[], Any]], reps: int) -> dict[str, float]:
    """Best-of-``reps`` seconds per call of each function, calls interleaved, so that
    background load on a shared, noisy machine slows every candidate alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: min(v) for name, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch threads")
    ap.add_argument("--window", type=int, default=None, help="sliding window (keys)")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    if cpu_native.load() is None:
        raise SystemExit("the native CPU kernels did not build (no C compiler?)")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{torch.get_num_threads()} threads, rows per run {cpu_native.ROWS_PER_CHUNK}, "
          f"default-mode native limit {cpu_backend.ROWS_MAX_KEYS} keys, "
          f"window {args.window or 'none'}")
    print(f"{'shape':9s} {'case':>8s} {'runs ms':>9s} {'alone ms':>9s} {'sdpa ms':>9s} "
          f"{'runs/alone':>10s} {'runs/sdpa':>9s}")
    rows = []
    for shape_name in args.shapes:
        for n, tokens in CASES:
            reps = args.reps if tokens <= 1024 else max(3, args.reps // 2)
            t = time_case(SHAPES[shape_name], n, tokens, reps, args.window)
            row = {"shape": shape_name, "prompts": n, "tokens": tokens,
                   **{f"{k}_ms": v * 1e3 for k, v in t.items()},
                   "runs_over_alone": t["runs"] / t["alone"],
                   "runs_over_sdpa": t["runs"] / t["sdpa"]}
            rows.append(row)
            print(f"{shape_name:9s} {f'{n}x{tokens}':>8s} {row['runs_ms']:9.2f} "
                  f"{row['alone_ms']:9.2f} {row['sdpa_ms']:9.2f} "
                  f"{row['runs_over_alone']:10.2f} {row['runs_over_sdpa']:9.2f}")
    if args.json:
        meta = {"machine": platform.processor() or platform.machine(),
                "threads": torch.get_num_threads(), "commit": tree_commit(),
                "rows_per_chunk": cpu_native.ROWS_PER_CHUNK,
                "rows_max_keys": cpu_backend.ROWS_MAX_KEYS, "window": args.window}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
