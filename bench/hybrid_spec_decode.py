"""Speculative decoding on a hybrid recurrent model: what verifying guesses costs and
gains when each layer's state must be kept after every guess and rolled back after
a rejection (``worker/mamba_state.py``), against plain decoding.

One random Qwen3-Next-shaped checkpoint (``--kind qwen3_next``, or Granite 4.0-H's
``granitemoehybrid``; ``bench/moe.py``'s shapes), fp32, in one process (``--kind
qwen3_moe``, attention only, runs the same steps with no state to keep). Plain greedy
decoding of ``--batch`` prompts of ``--prompt-len`` random tokens gives the answers;
then the same prompts run with ``--k`` guesses a step from a proposer that knows those
answers and gets them right up to a chosen point: every guess right (the most
drafting can gain), one wrong at a position that cycles through the guesses (about
half kept), and the first always wrong (every step rolls back to its first token:
the least). Random models do not repeat themselves, so an n-gram proposer would
guess nothing here; the fixed acceptance rates stand in for a workload's. Every run's
answers must equal the plain run's. Printed: each run's output tokens a second and
its ratio to plain decoding (> 1: faster).

    python bench/hybrid_spec_decode.py
    python bench/hybrid_spec_decode.py --json bench/figures/hybrid_spec_decode.json
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

POLICIES = ("all right", "one wrong", "first wrong")


class KnownAnswers:
    """Guesses the plain run's answer for each prompt, wrong where ``policy`` says."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]], k: int, policy: str) -> None:
        self.answers, self.k, self.policy, self.calls = answers, k, policy, 0

    def propose(self, req, max_tokens: int) -> tuple[int, ...]:
        answer = self.answers[tuple(req.prompt_token_ids)]
        done = len(req.all_token_ids) - req.num_prompt_tokens
        guesses = answer[done:done + min(self.k, max_tokens)]
        wrong = {"all right": None, "first wrong": 0,
                 "one wrong": self.calls % self.k}[self.policy]
        self.calls += 1
        if wrong is not None and wrong < len(guesses):
            guesses[wrong] = (guesses[wrong] + 1) % 32000
        return tuple(guesses)


def timed(llm, prompts: list[list[int]], out_len: int) -> tuple[list[list[int]], float]:
    from pagedserve.cluster import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # (warm-up)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", choices=("qwen3_next", "granitemoehybrid", "qwen3_moe"),
                    default="qwen3_next", help="qwen3_moe: attention only, no state to "
                    "keep (the same verify steps' cost without it)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--out-len", type=int, default=64)
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--json", type=str, default=None)
    args = ap.parse_args()
    from pagedserve.cluster import LLM

    _scratch, path = random_hybrid_checkpoint(args.kind, args.hidden, args.layers,
                                              "hybrid_spec_bench_")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 32000) for _ in range(args.prompt_len)]
               for _ in range(args.batch)]
    common = dict(model=path, dtype="float32", block_size=16, max_num_seqs=args.batch)
    llm = LLM(**common)
    try:
        want, plain_s = timed(llm, prompts, args.out_len)
    finally:
        llm.shutdown()
    tokens = args.batch * args.out_len
    print(f"      plain: {tokens / plain_s:7.1f} tok/s", flush=True)
    answers = {tuple(p): a for p, a in zip(prompts, want, strict=True)}
    results = {"plain": {"seconds": plain_s}}
    spec = {"method": "ngram", "num_speculative_tokens": args.k}
    for policy in POLICIES:
        llm = LLM(**common, speculative_config=spec)
        try:
            llm.engine.scheduler.drafter.proposer = KnownAnswers(answers, args.k, policy)
            got, seconds = timed(llm, prompts, args.out_len)
            stats = llm.engine.get_stats()["spec_decode"]
        finally:
            llm.shutdown()
        if got != want:
            raise SystemExit(f"{policy}: the answers differ from plain decoding's")
        kept = stats["num_accepted_tokens"] / max(stats["num_drafts"], 1)
        results[policy] = {"seconds": seconds, "kept_per_draft": kept,
                           "ratio": plain_s / seconds}
        print(f"{policy:>11}: {tokens / seconds:7.1f} tok/s, {kept:.2f} of {args.k} guesses "
              f"kept a step, {plain_s / seconds:.2f}x plain", flush=True)
    print(f"\n{args.batch} prompts of {args.prompt_len} tokens, {args.out_len} greedy tokens "
          f"each, k = {args.k}; random {args.kind}, {args.layers} layers, hidden "
          f"{args.hidden}, fp32, {torch.get_num_threads()} CPU threads; answers equal")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "args": vars(args),
                       "machine": platform.processor() or platform.machine(),
                       "commit": tree_commit()}, f, indent=2)


if __name__ == "__main__":
    main()
