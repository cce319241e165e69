"""Decode attention over a shared prefix on CPU: cascade (``kernels/cpu_cascade.py``)
vs every row reading its whole context.

Rows whose block tables share their leading blocks (requests after one system
prompt, hit in the prefix cache; the samples of one prompt) are the case: the
cascade reads the shared prefix once per run of 16 rows. Each case is one layer's
decode attention of ``rows`` rows that share a ``prefix``-token prompt and then
hold ``own`` tokens each (ragged by up to 15), timed side by side in one process
(calls interleaved, best of ``--reps``):

- ``cascade``: ``CpuNativeBackend`` as the engine runs it (the split planned once
  per step, as for the step's first layer; the plan's own cost is printed too);
- ``plain``: the same backend with ``shared_prefix_min_tokens = 0``.

cascade/plain < 1: the cascade is faster. The last case shares nothing: the
planning's cost when there is nothing to split.

``--engine`` adds the whole step: two engines of the default model (SmolLM2 fp32)
in one process, the split on and off, each with a ``--system``-token system prompt
in its prefix cache, then ``--requests`` requests of that prompt plus a short
question of their own generating ``--out-len`` tokens greedily; the engines
alternate, ``--engine-reps`` each, and the decode throughput's ratio is printed.

    python bench/shared_prefix.py
    python bench/shared_prefix.py --engine --json bench/figures/shared_prefix.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any

import torch

from pagedserve.kernels import cpu_cascade, cpu_native
from pagedserve.kernels.cpu_backend import CpuNativeBackend

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from prefill_rows import best_interleaved  # a sibling script
from provenance import tree_commit

SHAPES = {"smollm2": (9, 3, 64), "llama-8b": (32, 8, 128)}
CASES = [  # rows, shared prefix tokens, own tokens
    (64, 2048, 128), (64, 512, 128), (16, 2048, 256), (8, 1024, 64), (64, 0, 2048)]
BLOCK = 16


def make_case(shape: tuple[int, int, int], rows: int, prefix: int, own: int,
              dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """q, caches, block table and lengths: every row's table starts with the same
    ``prefix // BLOCK`` blocks; the rest are its own, scattered over the pool."""
    hq, hkv, d = shape
    g = torch.Generator().manual_seed(0)
    lens = [prefix + own - (i % BLOCK) for i in range(rows)]
    shared = prefix // BLOCK
    own_blocks = [-(-n // BLOCK) - shared for n in lens]
    num_blocks = shared + sum(own_blocks) + 1
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(shared + b for b in own_blocks)
    table = torch.full((rows, width), -1, dtype=torch.int32)
    nxt = shared
    for r, b in enumerate(own_blocks):
        table[r, :shared + b] = torch.tensor(perm[:shared] + perm[nxt:nxt + b])
        nxt += b
    kc = torch.randn(num_blocks, BLOCK, hkv, d, generator=g).to(dtype)
    vc = torch.randn(num_blocks, BLOCK, hkv, d, generator=g).to(dtype)
    q = torch.randn(rows, hq, d, generator=g)
    return q, kc, vc, table, torch.tensor(lens)


def time_case(shape: tuple[int, int, int], rows: int, prefix: int, own: int, reps: int,
              dtype: torch.dtype) -> dict[str, float]:
    q, kc, vc, table, lens = make_case(shape, rows, prefix, own, dtype)
    lens_host = lens.tolist()
    scale = shape[2] ** -0.5
    cascade, plain = CpuNativeBackend(), CpuNativeBackend()
    plain.shared_prefix_min_tokens = 0
    fns = {name: (lambda be=be: be._decode(q, kc, vc, table, lens, lens_host, scale))
           for name, be in (("cascade", cascade), ("plain", plain))}
    outs = {name: fn() for name, fn in fns.items()}
    err = (outs["cascade"] - outs["plain"]).abs().max().item()
    if err > 1e-4:
        raise AssertionError(f"cascade and plain differ by {err}")
    best = best_interleaved(fns, reps)
    t0 = time.perf_counter()
    plan = cpu_cascade.plan_shared_prefixes(table, lens_host, BLOCK)
    plan_s = time.perf_counter() - t0
    return {**best, "plan": plan_s, "split": plan is not None, "max_abs_diff": err}


def engine_case(args: argparse.Namespace) -> dict[str, Any]:
    """Output tokens/s of the same shared-prompt workload, split on and off."""
    from pagedserve.cluster import LLM, SamplingParams

    llms = {"cascade": LLM(num_gpu_blocks=2048, max_num_seqs=args.requests)}
    plain = LLM(num_gpu_blocks=2048, max_num_seqs=args.requests)
    plain.engine.executor.worker.backend.shared_prefix_min_tokens = 0
    llms["plain"] = plain
    system = [(i * 41 + 7) % 20000 + 100 for i in range(args.system)]
    prompts = [{"prompt_token_ids": system + [(i * 13 + k * 977) % 20000 + 100
                                              for i in range(16)]}
               for k in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.out_len, ignore_eos=True)
    rates: dict[str, list[float]] = {name: [] for name in llms}
    tokens: dict[str, list[list[int]]] = {}
    for llm in llms.values():
        llm.generate([{"prompt_token_ids": system}], SamplingParams(max_tokens=1),
                     use_tqdm=False)
    for _ in range(args.engine_reps):
        for name, llm in llms.items():
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            rates[name].append(args.requests * args.out_len / (time.perf_counter() - t0))
            tokens[name] = [o.outputs[0].token_ids for o in outs]
    for llm in llms.values():
        llm.shutdown()
    best = {name: max(v) for name, v in rates.items()}
    same = sum(a == b for a, b in zip(tokens["cascade"], tokens["plain"], strict=True))
    return {"system": args.system, "requests": args.requests, "out_len": args.out_len,
            "tok_s": rates, "best_tok_s": best,
            "cascade_over_plain_time": best["plain"] / best["cascade"],
            "same_tokens": f"{same}/{args.requests}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--kv-dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=None, help="torch threads")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--engine", action="store_true", help="also time whole engines")
    ap.add_argument("--system", type=int, default=2048, help="shared prompt tokens")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--out-len", type=int, default=32)
    ap.add_argument("--engine-reps", type=int, default=3)
    args = ap.parse_args()
    if cpu_native.load() is None:
        raise SystemExit("the native CPU kernels did not build (no C compiler?)")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.kv_dtype)
    print(f"{torch.get_num_threads()} threads, {args.kv_dtype} KV, one layer's decode "
          f"attention, best of {args.reps}")
    print(f"{'shape':9s} {'rows':>4s} {'prefix':>6s} {'own':>5s} {'cascade ms':>10s} "
          f"{'plain ms':>9s} {'plan ms':>8s} {'cascade/plain':>13s}")
    rows = []
    for shape_name in args.shapes:
        for n, prefix, own in CASES:
            t = time_case(SHAPES[shape_name], n, prefix, own, args.reps, dtype)
            row = {"shape": shape_name, "rows": n, "prefix": prefix, "own": own,
                   "cascade_ms": t["cascade"] * 1e3, "plain_ms": t["plain"] * 1e3,
                   "plan_ms": t["plan"] * 1e3, "split": t["split"],
                   "cascade_over_plain": t["cascade"] / t["plain"],
                   "max_abs_diff": t["max_abs_diff"]}
            rows.append(row)
            print(f"{shape_name:9s} {n:4d} {prefix:6d} {own:5d} {row['cascade_ms']:10.2f} "
                  f"{row['plain_ms']:9.2f} {row['plan_ms']:8.2f} "
                  f"{row['cascade_over_plain']:13.2f}")
    engine = None
    if args.engine:
        engine = engine_case(args)
        print(f"engines: {args.requests} requests after a {args.system}-token system prompt, "
              f"{args.out_len} tokens each: cascade {engine['best_tok_s']['cascade']:.1f} "
              f"tok/s, plain {engine['best_tok_s']['plain']:.1f} tok/s (best of "
              f"{args.engine_reps}); cascade/plain time "
              f"{engine['cascade_over_plain_time']:.2f}; same tokens {engine['same_tokens']}")
    if args.json:
        meta = {"machine": platform.processor() or platform.machine(),
                "threads": torch.get_num_threads(), "commit": tree_commit(),
                "kv_dtype": args.kv_dtype, "min_prefix": cpu_cascade.MIN_PREFIX_TOKENS}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows, "engine": engine}, f, indent=1)


if __name__ == "__main__":
    main()
