"""Batch-invariant mode (``--batch-invariant``): what it buys and what it costs.

Two engines of the default model (SmolLM2-135M, fp32 on CPU) in one process, the
default mode and ``batch_invariant=True``, run side by side on the same inputs:

- Determinism. A probe request (``--probe-len`` tokens of CPython's pydoc topics;
  greedy with its top-1 logprob, and seeded sampling at temperature 1 with top-p 0.95)
  runs alone, then in ``--trials`` crowds: 1 to ``--crowd`` other requests (pydoc
  chunks of 16 to 2 x ``--probe-len`` tokens) arriving over its first steps. Per mode:
  the crowds in which the probe's logprobs differ from its run alone, those in which
  its tokens differ, and the largest logprob difference.
- Cost, the engines alternating, ``--repeats`` each, medians: throughput of
  ``--requests`` requests of ``--out-len`` tokens in one ``generate`` call; one
  request's decode (ms per output token: a step of one row computes eight); and time
  to the first token of one prompt of each ``--long-len`` (invariant: every prefill
  row on the native rows kernel; default: SDPA past ``cpu_backend.ROWS_MAX_KEYS``
  keys). Printed as invariant / default (> 1: slower).

    python bench/batch_invariance.py
    python bench/batch_invariance.py --json bench/figures/batch_invariance.json
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from provenance import machine, tree_commit, write_figures
from quant import text_chunks  # CPython's pydoc topics, tokenised in chunks

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

MODES = {"default": False, "invariant": True}


def run(engine: Any, schedule: list[tuple[int, str, list[int], Any]]) -> dict[str, Any]:
    """Add each request at its step, step to the end; final outputs by name."""
    pending = sorted(schedule, key=lambda item: item[0])
    names: dict[str, str] = {}
    done: dict[str, Any] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, name, prompt, params = pending.pop(0)
            names[engine.add_request(prompt, params)] = name
        for out in engine.step():
            if out.finished:
                done[names[out.request_id]] = out.outputs[0]
        step += 1
    return done


def chosen_logprobs(out: Any) -> list[float]:
    return [lp[t] for lp, t in zip(out.logprobs, out.token_ids, strict=True)]


def determinism(llms: dict[str, Any], chunks: list[list[int]],
                args: argparse.Namespace) -> dict[str, Any]:
    from pagedserve.cluster import SamplingParams

    probes = {
        "greedy": SamplingParams(temperature=0.0, max_tokens=args.probe_out, ignore_eos=True,
                                 logprobs=1),
        "seeded": SamplingParams(temperature=1.0, top_p=0.95, seed=1234,
                                 max_tokens=args.probe_out, ignore_eos=True, logprobs=1),
    }
    probe = chunks[0][:args.probe_len]
    others = SamplingParams(temperature=0.8, seed=5, max_tokens=args.probe_out,
                            ignore_eos=True)
    rng = random.Random(0)
    crowds = []
    for _ in range(args.trials):
        n = rng.randint(1, args.crowd)
        crowds.append([(rng.randint(0, 4), f"o{i}",
                        rng.choice(chunks[1:])[:rng.randint(16, 2 * args.probe_len)], others)
                       for i in range(n)])
    result: dict[str, Any] = {}
    for mode, llm in llms.items():
        for kind, params in probes.items():
            alone = run(llm.engine, [(0, "probe", probe, params)])["probe"]
            want = chosen_logprobs(alone)
            lp_diff = tok_diff = 0
            worst = 0.0
            for crowd in crowds:
                got = run(llm.engine, [(rng.randint(0, 2), "probe", probe, params), *crowd])
                out = got["probe"]
                tok_diff += out.token_ids != alone.token_ids
                if out.logprobs != alone.logprobs:
                    lp_diff += 1
                    if out.token_ids == alone.token_ids:
                        worst = max(worst, max(abs(a - b) for a, b in
                                               zip(chosen_logprobs(out), want, strict=True)))
            result[f"{mode} {kind}"] = {"trials": len(crowds), "logprobs_differ": lp_diff,
                                        "tokens_differ": tok_diff,
                                        "max_abs_logprob_diff_same_tokens": worst}
    return result


def cost(llms: dict[str, Any], chunks: list[list[int]],
         args: argparse.Namespace) -> dict[str, Any]:
    from pagedserve.cluster import SamplingParams

    batch = [c[:rng_len] for c, rng_len in
             zip(chunks[1:args.requests + 1],
                 random.Random(1).choices(range(32, 400), k=args.requests), strict=False)]
    gen = SamplingParams(temperature=0.0, max_tokens=args.out_len, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=args.decode_len, ignore_eos=True)
    first = SamplingParams(temperature=0.0, max_tokens=1)
    text = [t for c in chunks[args.requests + 1:] for t in c]
    if len(text) < max(args.long_len):
        raise SystemExit(f"only {len(text)} tokens of text for --long-len")
    longs = {n: text[:n] for n in args.long_len}
    times: dict[str, dict[str, list[float]]] = {
        m: {"throughput_tok_s": [], "decode_ms_per_token": [],
            **{f"prefill_{n}_s": [] for n in longs}}
        for m in llms}
    for _ in range(args.repeats):
        for mode, llm in llms.items():
            t = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in batch], gen, use_tqdm=False)
            wall = time.perf_counter() - t
            times[mode]["throughput_tok_s"].append(
                sum(len(o.outputs[0].token_ids) for o in outs) / wall)
            t = time.perf_counter()
            llm.generate([{"prompt_token_ids": batch[0][:16]}], one, use_tqdm=False)
            times[mode]["decode_ms_per_token"].append(
                (time.perf_counter() - t) / args.decode_len * 1e3)
            for n, long_prompt in longs.items():
                llm.reset_prefix_cache()
                t = time.perf_counter()
                llm.generate([{"prompt_token_ids": long_prompt}], first, use_tqdm=False)
                times[mode][f"prefill_{n}_s"].append(time.perf_counter() - t)
            llm.reset_prefix_cache()
    med = {m: {k: statistics.median(v) for k, v in d.items()} for m, d in times.items()}
    ratio = {
        "throughput": med["default"]["throughput_tok_s"] / med["invariant"]["throughput_tok_s"],
        "decode": med["invariant"]["decode_ms_per_token"] / med["default"]["decode_ms_per_token"],
        **{f"prefill_{n}": med["invariant"][f"prefill_{n}_s"] / med["default"][f"prefill_{n}_s"]
           for n in longs},
    }
    return {"median": med, "runs": times, "invariant_over_default": ratio}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--probe-len", type=int, default=300)
    ap.add_argument("--probe-out", type=int, default=48)
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--crowd", type=int, default=8)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--out-len", type=int, default=64)
    ap.add_argument("--decode-len", type=int, default=64)
    ap.add_argument("--long-len", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads per engine")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()

    from pagedserve.cluster import LLM

    llms = {m: LLM(batch_invariant=flag, num_gpu_blocks=1024, num_threads=args.threads)
            for m, flag in MODES.items()}
    chunks = text_chunks(llms["default"].get_tokenizer(), "pydoc",
                         max(48, args.requests + 1 + -(-max(args.long_len) // 512)), size=512)
    det = determinism(llms, chunks, args)
    print(f"determinism: a {args.probe_len}-token probe, {args.probe_out} tokens, alone vs "
          f"{args.trials} crowds of 1-{args.crowd}")
    print(f"  {'mode':<20} {'logprobs differ':>16} {'tokens differ':>14} {'max |dlp|':>10}")
    for name, row in det.items():
        print(f"  {name:<20} {row['logprobs_differ']:>10}/{row['trials']:<5} "
              f"{row['tokens_differ']:>8}/{row['trials']:<5} "
              f"{row['max_abs_logprob_diff_same_tokens']:>10.2e}")
    c = cost(llms, chunks, args)
    print(f"cost (medians of {args.repeats}, engines alternating):")
    print(f"  {'':<28} {'default':>10} {'invariant':>10} {'invariant/default':>18}")
    rows = [("throughput (tok/s)", "throughput_tok_s", "throughput"),
            ("decode, 1 request (ms/tok)", "decode_ms_per_token", "decode"),
            *[(f"prefill {n} tokens (s)", f"prefill_{n}_s", f"prefill_{n}")
              for n in args.long_len]]
    for label, key, rkey in rows:
        print(f"  {label:<28} {c['median']['default'][key]:>10.3f} "
              f"{c['median']['invariant'][key]:>10.3f} "
              f"{c['invariant_over_default'][rkey]:>17.2f}x")
    print("  (invariant/default: time over time, > 1 = the invariant mode is slower)")
    commit = tree_commit()
    print(f"machine: {machine()}; tree {commit}")
    for llm in llms.values():
        llm.shutdown()
    if args.json:
        write_figures(args.json, args, commit, determinism=det, cost=c)


if __name__ == "__main__":
    main()
