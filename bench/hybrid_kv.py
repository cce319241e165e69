"""Hybrid models under a KV budget: one block table per KV cache group against one
table for every layer, same bytes, same requests, in one run.

A random Gemma 3 (every sixth layer full, the rest sliding over ``--window`` tokens)
is written to a temporary directory and served twice with the same
``kv_cache_memory_bytes`` (by default what ``--fit`` requests of the workload hold
with one table): ``--requests`` prompts of ``--prompt-len`` tokens, ``--max-tokens``
new ones each, greedy, through ``LLM.generate``. Printed per engine: the pool in
blocks (a block is one group's layers with groups, every layer without), wall time,
output tokens/s, the most requests running at once, and preemptions; then
groups / one table. Both engines must give the same tokens.

    python bench/hybrid_kv.py
    python bench/hybrid_kv.py --json bench/figures/hybrid_kv.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from provenance import tree_commit  # a sibling script

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.worker.loaders import resolve_model
from pagedserve.worker.testing import write_random_checkpoint


def run(path: str, budget: int, prompts: list[list[int]], max_tokens: int,
        hybrid: bool, max_num_seqs: int) -> dict:
    llm = LLM(model=path, kv_cache_memory_bytes=budget, max_num_seqs=max_num_seqs,
              disable_hybrid_kv_cache_manager=not hybrid, max_num_batched_tokens=2048)
    try:
        engine = llm.engine
        sched = engine.scheduler
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(p, params, f"r{i}")
        peak = steps = 0
        tokens: dict[str, list[int]] = {}
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.request_id] = out.outputs[0].token_ids
            peak = max(peak, len(sched.running))
            steps += 1
        wall = time.perf_counter() - t0
        return {"groups": len(sched.kv.group_windows), "pool_blocks": sched.kv.pool.num_blocks,
                "bytes_per_block": int(engine.model_info["bytes_per_block"]),
                "wall_s": wall, "tok_per_s": len(prompts) * max_tokens / wall,
                "peak_running": peak, "steps": steps,
                "preemptions": sum(sched.num_preemptions.values()),
                "tokens": [tokens[f"r{i}"] for i in range(len(prompts))]}
    finally:
        llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--fit", type=int, default=4,
                    help="the KV budget holds this many requests with one table")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                   for i in range(args.layers)]
    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_checkpoint(
            tmp, "gemma3_text", resolve_model(None).path, num_hidden_layers=args.layers,
            hidden_size=args.hidden, intermediate_size=2 * args.hidden,
            num_attention_heads=4, num_key_value_heads=2, head_dim=args.hidden // 4,
            query_pre_attn_scalar=args.hidden // 4, sliding_window=args.window,
            layer_types=layer_types, max_position_embeddings=8192)
        per_token_layer = 2 * 2 * (args.hidden // 4) * 4  # K and V, 2 KV heads, fp32
        blocks = -(-(args.prompt_len + args.max_tokens) // 16)
        budget = args.fit * blocks * 16 * per_token_layer * args.layers
        prompts = [[100 + (37 * i + 11 * j) % 4000 for j in range(args.prompt_len)]
                   for i in range(args.requests)]
        res = {}
        for hybrid in (True, False):  # (a warm-up of the process's first engine too)
            run(path, budget, prompts[:2], 4, hybrid, args.max_num_seqs)
        for hybrid in (True, False):
            res["groups" if hybrid else "one_table"] = run(
                path, budget, prompts, args.max_tokens, hybrid, args.max_num_seqs)
    same = res["groups"].pop("tokens") == res["one_table"].pop("tokens")
    print(f"{args.layers} layers ({sum(t == 'full_attention' for t in layer_types)} full, "
          f"window {args.window}), {args.requests} requests of {args.prompt_len} + "
          f"{args.max_tokens} tokens, KV budget {budget / 2**20:.1f} MiB "
          f"({args.fit} requests with one table)")
    print(f"{'engine':<12} {'blocks':>7} {'wall s':>8} {'tok/s':>8} {'running':>8} "
          f"{'preempt':>8}")
    for name, r in res.items():
        print(f"{name:<12} {r['pool_blocks']:>7} {r['wall_s']:>8.2f} {r['tok_per_s']:>8.1f} "
              f"{r['peak_running']:>8} {r['preemptions']:>8}")
    ratio = res["groups"]["tok_per_s"] / res["one_table"]["tok_per_s"]
    print(f"groups / one table: {ratio:.2f}x tokens/s; same tokens: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "budget_bytes": budget, "results": res,
                       "ratio": ratio, "same_tokens": same, "commit": tree_commit(),
                       "machine": platform.processor() or platform.machine(),
                       "cpus": os.cpu_count()}, f, indent=1)


if __name__ == "__main__":
    main()
