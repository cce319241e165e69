"""``long_prefill_token_threshold``: short prompts that arrive behind a long one.

Two engines of the default model (SmolLM2-135M, fp32 on CPU) in one process, one
without the per-prompt cap and one with ``--cap`` tokens, run the same arrival
alternately (``--repeats`` each, medians): one ``--long-len``-token prompt, then in the
same instant ``--shorts`` prompts of ``--short-len`` tokens (chunks of CPython's pydoc
topics), each generating ``--out-len`` tokens greedily. Without the cap the long
prompt takes each step's whole ``max_num_batched_tokens`` budget until it is done and
the short ones wait; with it they start in the first step. Printed: time to first
token of the short prompts (median over them) and of the long one, and the time until
all are done, each as cap / no cap (< 1: the cap is faster).

    python bench/long_prefill.py
    python bench/long_prefill.py --json bench/figures/long_prefill.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from provenance import machine, tree_commit, write_figures
from quant import text_chunks  # CPython's pydoc topics, tokenised in chunks

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def arrival(engine: Any, long: list[int], shorts: list[list[int]], params: Any
            ) -> dict[str, Any]:
    """Add the long prompt, then the short ones, and step to the end: seconds from
    the arrival to each first token and to the last one, and every output's tokens."""
    t0 = time.perf_counter()
    ids = [engine.add_request(p, params) for p in [long, *shorts]]
    first: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - t0
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    total = time.perf_counter() - t0
    return {"ttft_long_s": first[ids[0]],
            "ttft_short_s": statistics.median(first[i] for i in ids[1:]),
            "total_s": total, "tokens": [tokens[i] for i in ids]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--long-len", type=int, default=4096)
    ap.add_argument("--shorts", type=int, default=8)
    ap.add_argument("--short-len", type=int, default=64)
    ap.add_argument("--out-len", type=int, default=16)
    ap.add_argument("--cap", type=int, default=512)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()

    from pagedserve.cluster import LLM, SamplingParams

    llms = {name: LLM(num_gpu_blocks=1024, enable_prefix_caching=False,
                      max_num_batched_tokens=args.max_num_batched_tokens,
                      long_prefill_token_threshold=cap)
            for name, cap in (("no cap", 0), (f"cap {args.cap}", args.cap))}
    first = next(iter(llms.values()))
    need = args.long_len + args.shorts * args.short_len
    ids = [t for c in text_chunks(first.get_tokenizer(), "pydoc", -(-need // 512) + 1)
           for t in c]
    long, rest = ids[:args.long_len], ids[args.long_len:]
    shorts = [rest[i * args.short_len:(i + 1) * args.short_len] for i in range(args.shorts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.out_len, ignore_eos=True)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in llms}
    for _ in range(args.repeats):
        for name, llm in llms.items():
            runs[name].append(arrival(llm.engine, long, shorts, params))
    tokens = {name: r[0].pop("tokens") for name, r in runs.items()}
    for r in runs.values():
        for row in r[1:]:
            row.pop("tokens")
    same = len({json.dumps(t) for t in tokens.values()}) == 1
    med = {name: {k: statistics.median(row[k] for row in r) for k in r[0]}
           for name, r in runs.items()}
    base, capped = med["no cap"], med[f"cap {args.cap}"]
    print(f"one {args.long_len}-token prompt, then {args.shorts} of {args.short_len} "
          f"tokens at once; {args.out_len} tokens each, budget "
          f"{args.max_num_batched_tokens} tokens a step; medians of {args.repeats}")
    print(f"  {'':<26} {'no cap':>9} {f'cap {args.cap}':>9} {'cap / no cap':>13}")
    ratios = {}
    for label, key in (("first token, short (s)", "ttft_short_s"),
                       ("first token, long (s)", "ttft_long_s"),
                       ("all done (s)", "total_s")):
        ratios[key] = capped[key] / base[key]
        print(f"  {label:<26} {base[key]:>9.3f} {capped[key]:>9.3f} {ratios[key]:>12.2f}x")
    print(f"  same tokens with and without the cap: {same}")
    commit = tree_commit()
    print(f"machine: {machine()}; tree {commit}")
    for llm in llms.values():
        llm.shutdown()
    if args.json:
        write_figures(args.json, args, commit, medians=med, cap_over_no_cap=ratios,
                      same_tokens=same)


if __name__ == "__main__":
    main()
