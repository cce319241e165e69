"""Multi-turn chat on a hybrid recurrent model: prefix caching with state snapshots
(``mamba_cache_mode="align"``, ``scheduler/state_cache.py``) vs none.

Two engines of one random Qwen3-Next-shaped checkpoint (``--kind qwen3_next``, or
Granite 4.0-H's ``granitemoehybrid``; ``bench/moe.py``'s shapes) in one process, the
same workload on each: ``--conversations`` conversations whose first prompt is a
``--system``-token context plus a question, then ``--turns - 1`` more turns, each
the whole history (prompts and answers so far) plus a ``--question``-token
question; every turn of every conversation is sent at once and answered with
``--out-len`` greedy tokens. Without the cache each turn recomputes its whole
history (these models' prefix caching is off by default: a cached prefix's KV
holds no recurrent state); with it, a turn resumes from the state its conversation
had at the last block boundary of the previous turn. Both engines' answers must
be equal; the wall time of each turn and the share of prompt tokens served from
the cache are printed, and the time ratio (none / align > 1: the cache is faster).

    python bench/hybrid_prefix_cache.py
    python bench/hybrid_prefix_cache.py --json bench/figures/hybrid_prefix_cache.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from moe import random_hybrid_checkpoint  # a sibling script: the MoE benchmark's shapes
from provenance import tree_commit

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def run(llm, conversations: list[list[int]], questions: list[list[list[int]]],
        out_len: int) -> tuple[list[list[list[int]]], list[float], int, int]:
    """Every turn of every conversation: the answers, each turn's seconds, and the
    prompt tokens sent and served from the cache."""
    from pagedserve.cluster import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    history = [list(c) for c in conversations]
    answers: list[list[list[int]]] = []
    seconds, sent, cached = [], 0, 0
    for turn, asked in enumerate(questions):
        prompts = [h + q for h, q in zip(history, asked, strict=True)] if turn else history
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - t0)
        sent += sum(len(p) for p in prompts)
        cached += sum(o.num_cached_tokens for o in outs)
        answers.append([o.outputs[0].token_ids for o in outs])
        history = [p + a for p, a in zip(prompts, answers[-1], strict=True)]
    return answers, seconds, sent, cached


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", choices=("qwen3_next", "granitemoehybrid"),
                    default="qwen3_next")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system", type=int, default=512, help="first prompt's context tokens")
    ap.add_argument("--question", type=int, default=32)
    ap.add_argument("--out-len", type=int, default=32)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--json", type=str, default=None)
    args = ap.parse_args()
    from pagedserve.cluster import LLM

    _scratch, path = random_hybrid_checkpoint(args.kind, args.hidden, args.layers,
                                              "hybrid_pc_bench_")
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 32000) for _ in range(n)]

    conversations = [tokens(args.system + args.question) for _ in range(args.conversations)]
    questions = [[tokens(args.question) for _ in conversations] for _ in range(args.turns)]
    results = {}
    for mode in ("none", "align"):
        llm = LLM(model=path, dtype="float32", block_size=16, mamba_cache_mode=mode,
                  max_num_seqs=args.conversations)
        try:
            results[mode] = run(llm, conversations, questions, args.out_len)
        finally:
            llm.shutdown()
        _, seconds, sent, cached = results[mode]
        print(f"{mode:>5}: turns {[round(s, 2) for s in seconds]} s, total "
              f"{sum(seconds):.2f} s; {cached} of {sent} prompt tokens from the cache",
              flush=True)
    if results["none"][0] != results["align"][0]:
        raise SystemExit("the engines' answers differ")
    none_s, align_s = sum(results["none"][1]), sum(results["align"][1])
    later = sum(results["none"][1][1:]) / max(sum(results["align"][1][1:]), 1e-9)
    print(f"\n{args.conversations} conversations x {args.turns} turns ({args.system}-token "
          f"context, {args.question}-token questions, {args.out_len} greedy tokens a turn); "
          f"random {args.kind}, {args.layers} layers, hidden {args.hidden}, fp32, "
          f"{torch.get_num_threads()} CPU threads")
    print(f"answers equal; none / align: {none_s / align_s:.2f}x the whole run, "
          f"{later:.2f}x the turns after the first")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seconds": {m: r[1] for m, r in results.items()},
                       "prompt_tokens": results["none"][2],
                       "cached_tokens": {m: r[3] for m, r in results.items()},
                       "ratio_total": none_s / align_s, "ratio_later_turns": later,
                       "args": vars(args), "machine": platform.processor() or platform.machine(),
                       "commit": tree_commit()}, f, indent=2)


if __name__ == "__main__":
    main()
