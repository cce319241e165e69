"""Pipeline parallelism: one plan per stage in flight vs one plan through the stages.

A random checkpoint of SmolLM2-135M's exact shape (30 layers, fp32) is cut into
``--stages`` pipeline stages, each one Ray actor with ``--threads`` threads. The same
greedy requests (random token-id prompts of 10-75 tokens, ``--max-tokens`` outputs,
``ignore_eos``) run through ``LLM.generate`` in three engines, one after another, in one
run:

- ``overlap``: pagedserve's default, ``max_concurrent_batches`` = stages: while one stage
  computes a micro-batch the others compute theirs;
- ``serial``: ``max_concurrent_batches=1``: one plan crosses the stages at a time, so
  every stage but one idles (what pagedserve did before);
- ``single``: one rank in-process holding every layer with ``stages x threads`` threads
  (the same cores without a pipeline), for scale.

It prints output tokens/s of each (the best of ``--repeat`` runs, the prefix cache
emptied before each), the ratio overlap / serial, and whether every engine gave the
same tokens (greedy, fp32: they must).

    python bench/pipeline.py --json bench/figures/pipeline.json
    python bench/pipeline.py --partition 18,12 --json bench/figures/pipeline_18_12.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from typing import Any


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(10, 75))] for _ in range(n)]


def _run(name: str, path: str, prompts: list[list[int]], max_tokens: int, repeat: int,
         **engine: Any) -> dict[str, Any]:
    from pagedserve.cluster import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm = LLM(model=path, **engine)
    try:
        llm.generate(prompts[:4], SamplingParams(max_tokens=2, temperature=0.0),
                     use_tqdm=False)  # warm-up: first-call costs are not the pipeline's
        best, tokens = float("inf"), None
        for _ in range(repeat):
            llm.reset_prefix_cache()  # every run computes its prompts
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            best = min(best, time.perf_counter() - t0)
            tokens = [o.outputs[0].token_ids for o in outs]
        stats = llm.engine.get_stats()
    finally:
        llm.shutdown()
    n_out = sum(len(t) for t in tokens or [])
    row = {"engine": name, "seconds": round(best, 3), "output_tokens": n_out,
           "tokens_per_s": round(n_out / best, 1),
           "pipelined_steps": int(stats.get("pipelined_steps", 0)), "steps": int(stats["steps"])}
    print(f"{name:>8}: {row['tokens_per_s']:8.1f} tok/s  ({best:.2f} s, {row['steps']} steps, "
          f"{row['pipelined_steps']} started with another in flight)", flush=True)
    return {**row, "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="threads per stage")
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--partition", default=None,
                    help="layers per stage, e.g. 19,11 (pipeline_layer_partition; "
                         "default: even)")
    ap.add_argument("--num-layers", type=int, default=None,
                    help="fewer layers than SmolLM2's 30 (a quicker run)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import ray

    from pagedserve.worker.testing import SMOLLM2_135M, write_random_checkpoint

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=args.stages + 1, include_dashboard=False,
             log_to_driver=False, _node_ip_address="127.0.0.1")
    shape = dict(SMOLLM2_135M)
    if args.num_layers:
        shape["num_hidden_layers"] = args.num_layers
    with tempfile.TemporaryDirectory(prefix="pp_bench_") as scratch:
        path = write_random_checkpoint(scratch, weight_scale=1.0, **shape)
        prompts = _prompts(args.num_prompts, int(shape.get("vocab_size", 49152)), seed=0)
        common = dict(num_gpu_blocks=1024, max_num_batched_tokens=4096)
        staged = dict(pipeline_parallel_size=args.stages, num_threads=args.threads,
                      pipeline_layer_partition=args.partition, **common)
        rows = [
            _run("overlap", path, prompts, args.max_tokens, args.repeat, **staged),
            _run("serial", path, prompts, args.max_tokens, args.repeat,
                 max_concurrent_batches=1, **staged),
            _run("single", path, prompts, args.max_tokens, args.repeat,
                 num_threads=args.stages * args.threads, **common),
        ]
    ray.shutdown()
    same = all(r["tokens"] == rows[0]["tokens"] for r in rows)
    by = {r["engine"]: r for r in rows}
    ratio = by["overlap"]["tokens_per_s"] / by["serial"]["tokens_per_s"]
    print(f"overlap / serial: {ratio:.2f}x; overlap / single: "
          f"{by['overlap']['tokens_per_s'] / by['single']['tokens_per_s']:.2f}x; "
          f"same tokens everywhere: {same}")
    if args.json:
        result = {"args": vars(args), "same_tokens": same, "overlap_over_serial": round(ratio, 3),
                  "rows": [{k: v for k, v in r.items() if k != "tokens"} for r in rows]}
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
