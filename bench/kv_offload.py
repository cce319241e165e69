"""KV offloading: multi-turn chat whose history outgrows the KV pool.

Same machine, same model (SmolLM2-135M, fp32 on CPU), same conversations, one
engine per configuration, run side by side:

- ``device only``: a ``--pool-blocks`` KV pool with prefix caching, no CPU tier
  for the cache (what vLLM does without ``--kv-offloading-size``);
- ``offload``: the same pool plus ``--offload-blocks`` CPU blocks of offloaded
  prefixes (``--kv-offloading-size``);
- ``roomy device``: a pool that holds every conversation (the upper bound).

``--conversations`` chats, each a distinct document of ``--system-len`` tokens
(CPython's pydoc topics) followed by ``--turns`` user messages of
``--user-len`` tokens; each turn's prompt is the previous prompt, the previous
greedy answer (``--out-len`` tokens) and the next message, as a chat client
sends it. Conversations take turns in groups of ``--concurrency`` (one
``generate`` call per group), so between two turns of one conversation the
other groups run and push its blocks out of the small pool.

Prints, per configuration: wall time, mean latency of a group's later turns
(the first turn of a conversation can hit nothing), prompt tokens computed
versus found cached (device and CPU), and the ratios to ``device only``; and
whether the answers equal the roomy run's token for token.

``--clients`` runs the same conversations as closed-loop chat clients against
the in-process ``AsyncEngine`` instead: conversations start as a Poisson
process of ``--rate`` per second, and each sends its next turn an exponential
think time (mean ``--think-s``) after its answer ends, so the batch is
whatever happens to overlap. It reports time to first token (when the first
token of the answer comes out) of the later turns, mean / p50 / p90 / p99.

    python bench/kv_offload.py
    python bench/kv_offload.py --json bench/figures/kv_offload.json
    python bench/kv_offload.py --clients --json bench/figures/kv_offload_clients.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from quant import text_chunks  # CPython's pydoc topics, tokenised in chunks

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def run_chats(name: str, engine_kwargs: dict[str, Any], systems: list[list[int]],
              users: list[list[list[int]]], args: argparse.Namespace) -> dict[str, Any]:
    """Every conversation's turns, group by group; returns timings, counts, answers."""
    from pagedserve.cluster import LLM, SamplingParams

    llm = LLM(max_num_seqs=args.concurrency, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=args.out_len, ignore_eos=True)
    try:
        llm.generate(systems[0][:32], SamplingParams(temperature=0.0, max_tokens=2),
                     use_tqdm=False)  # warm-up, then forget it
        llm.reset_prefix_cache()
        eng = llm.engine
        before = eng.get_stats()
        history = [list(s) for s in systems]
        answers: list[list[int]] = [[] for _ in systems]
        later: list[float] = []
        t0 = time.perf_counter()
        for turn in range(args.turns):
            for g in range(0, len(systems), args.concurrency):
                idx = range(g, min(g + args.concurrency, len(systems)))
                prompts = [{"prompt_token_ids": history[i] + users[i][turn]} for i in idx]
                t1 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                if turn:
                    later.append(time.perf_counter() - t1)
                for i, p, o in zip(idx, prompts, outs):
                    ids = list(o.outputs[0].token_ids)
                    history[i] = p["prompt_token_ids"] + ids
                    answers[i] += ids
        wall = time.perf_counter() - t0
        after = eng.get_stats()

        def delta(*path: str) -> float:
            a, b = after, before
            for k in path:
                a, b = a[k], b[k]
            return a - b

        prompt = delta("prompt_tokens")
        device_hits = delta("prefix_cache_hits")
        cpu_hits = delta("kv_offload", "cpu_hit_tokens")
        mem = after["memory"]
        return {
            "config": name, "pool_blocks": mem["num_gpu_blocks"],
            "offload_blocks": engine_kwargs.get("num_offload_blocks", 0),
            "wall_s": round(wall, 2),
            "later_turn_latency_s": round(sum(later) / len(later), 3) if later else None,
            "prompt_tokens": int(prompt), "device_hit_tokens": int(device_hits),
            "cpu_hit_tokens": int(cpu_hits),
            "computed_prompt_tokens": int(prompt - device_hits - cpu_hits),
            "offloaded_blocks": int(delta("kv_offload", "offloaded_blocks")),
            "preemptions": dict(after["num_preemptions"]),
            "cpu_cache_mib": round(mem["num_cpu_cached_blocks"] * mem["bytes_per_block"]
                                   / 2**20, 1),
            "answers": answers,
        }
    finally:
        llm.shutdown()


async def _clients(engine: Any, systems: list[list[int]], users: list[list[list[int]]],
                   args: argparse.Namespace) -> tuple[list[float], list[list[int]]]:
    """Every conversation as a chat client; returns later turns' TTFTs and the answers."""
    from pagedserve.cluster import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.out_len, ignore_eos=True)
    rng = random.Random(0)
    starts, t = [], 0.0
    for _ in systems:
        starts.append(t)
        t += rng.expovariate(args.rate)
    thinks = [[rng.expovariate(1 / args.think_s) for _ in range(args.turns)] for _ in systems]
    ttfts: list[float] = []
    answers: list[list[int]] = [[] for _ in systems]

    async def chat(i: int) -> None:
        await asyncio.sleep(starts[i])
        history = list(systems[i])
        for turn in range(args.turns):
            if turn:
                await asyncio.sleep(thinks[i][turn])
            prompt = history + users[i][turn]
            t0, first, ids = time.perf_counter(), None, []
            async for out in engine.generate(prompt, params, f"c{i}-{turn}"):
                ids = list(out.outputs[0].token_ids)
                if first is None and ids:
                    first = time.perf_counter() - t0
            if turn:
                ttfts.append(first or 0.0)
            history = prompt + ids
            answers[i] += ids

    await asyncio.gather(*(chat(i) for i in range(len(systems))))
    return ttfts, answers


def run_clients(name: str, engine_kwargs: dict[str, Any], systems: list[list[int]],
                users: list[list[list[int]]], args: argparse.Namespace) -> dict[str, Any]:
    """The conversations as closed-loop clients of one ``AsyncEngine``."""
    from pagedserve.cluster.async_engine import AsyncEngine
    from pagedserve.cluster.config import EngineConfig

    async def go() -> dict[str, Any]:
        engine = AsyncEngine(EngineConfig(max_num_seqs=64, **engine_kwargs))
        try:
            t0 = time.perf_counter()
            ttfts, answers = await _clients(engine, systems, users, args)
            wall = time.perf_counter() - t0
            stats = engine.get_stats()
        finally:
            await engine.shutdown()
        ms = np.array(ttfts) * 1000
        return {"config": name, "pool_blocks": stats["memory"]["num_gpu_blocks"],
                "offload_blocks": engine_kwargs.get("num_offload_blocks", 0),
                "wall_s": round(wall, 2),
                **{f"{k}_ttft_ms": round(float(v), 1) for k, v in (
                    ("mean", ms.mean()), ("p50", np.percentile(ms, 50)),
                    ("p90", np.percentile(ms, 90)), ("p99", np.percentile(ms, 99)))},
                "device_hit_tokens": stats["prefix_cache_hits"],
                "cpu_hit_tokens": stats["kv_offload"]["cpu_hit_tokens"],
                "preemptions": dict(stats["num_preemptions"]), "answers": answers}

    return asyncio.run(go())


def same_answers(row: dict[str, Any], ref: dict[str, Any]) -> str:
    """How many conversations got the reference run's answers, token for token."""
    same = sum(a == b for a, b in zip(row["answers"], ref["answers"]))
    return f"{same}/{len(ref['answers'])}"


def print_clients(rows: list[dict[str, Any]]) -> None:
    base, ref = rows[0], rows[-1]
    print(f"{'config':<13} {'pool':>5} {'cpu':>5} {'mean TTFT':>10} {'x':>5} {'p50':>8} "
          f"{'p90':>8} {'p99':>8} {'x p99':>6} {'dev hit':>8} {'cpu hit':>8} {'same':>6}")
    for r in rows:
        r["answers_equal_roomy"] = same_answers(r, ref)
        r["mean_ttft_speedup_vs_device_only"] = round(base["mean_ttft_ms"] / r["mean_ttft_ms"], 2)
        r["p99_ttft_speedup_vs_device_only"] = round(base["p99_ttft_ms"] / r["p99_ttft_ms"], 2)
        print(f"{r['config']:<13} {r['pool_blocks']:>5} {r['offload_blocks']:>5} "
              f"{r['mean_ttft_ms']:>10.1f} {r['mean_ttft_speedup_vs_device_only']:>5.2f} "
              f"{r['p50_ttft_ms']:>8.1f} {r['p90_ttft_ms']:>8.1f} {r['p99_ttft_ms']:>8.1f} "
              f"{r['p99_ttft_speedup_vs_device_only']:>6.2f} {r['device_hit_tokens']:>8} "
              f"{r['cpu_hit_tokens']:>8} {r['answers_equal_roomy']:>6}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--system-len", type=int, default=256)
    ap.add_argument("--user-len", type=int, default=24)
    ap.add_argument("--out-len", type=int, default=16)
    ap.add_argument("--pool-blocks", type=int, default=128)
    ap.add_argument("--offload-blocks", type=int, default=1536)
    ap.add_argument("--clients", action="store_true",
                    help="closed-loop chat clients of an AsyncEngine (TTFT) instead of groups")
    ap.add_argument("--rate", type=float, default=0.5, help="--clients: conversations / s")
    ap.add_argument("--think-s", type=float, default=3.0, help="--clients: mean think time")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()

    from pagedserve.worker.loaders import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(None))
    need = args.conversations * (1 + args.turns)
    chunks = text_chunks(tok, "pydoc", need, max(args.system_len, args.user_len))
    if len(chunks) < need:
        raise SystemExit(f"the text has {len(chunks)} chunks, {need} needed")
    systems = [c[:args.system_len] for c in chunks[:args.conversations]]
    rest = chunks[args.conversations:]
    users = [[rest[i * args.turns + t][:args.user_len] for t in range(args.turns)]
             for i in range(args.conversations)]
    longest = args.system_len + args.turns * (args.user_len + args.out_len)
    roomy = args.conversations * -(-longest // 16) + 64
    configs = [
        ("device only", {"num_gpu_blocks": args.pool_blocks, "num_offload_blocks": 0}),
        ("offload", {"num_gpu_blocks": args.pool_blocks,
                     "num_offload_blocks": args.offload_blocks}),
        ("roomy device", {"num_gpu_blocks": roomy, "num_offload_blocks": 0}),
    ]
    how = (f"clients starting at {args.rate}/s, think {args.think_s} s" if args.clients
           else f"groups of {args.concurrency}")
    print(f"{args.conversations} conversations x {args.turns} turns, {how}; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    run = run_clients if args.clients else run_chats
    rows = [run(name, kw, systems, users, args) for name, kw in configs]
    if args.clients:
        print_clients(rows)
    else:
        print_groups(rows)
    if args.json:
        for r in rows:
            r.pop("answers")
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "machine": platform.platform(),
                       "cores": os.cpu_count(), "rows": rows}, f, indent=2)


def print_groups(rows: list[dict[str, Any]]) -> None:
    base, ref = rows[0], rows[-1]
    print(f"{'config':<13} {'pool':>5} {'cpu':>5} {'wall s':>7} {'x':>5} {'turn s':>7} "
          f"{'x':>5} {'computed':>9} {'dev hit':>8} {'cpu hit':>8} {'same':>6}")
    for r in rows:
        r["answers_equal_roomy"] = same_answers(r, ref)
        r["speedup_vs_device_only"] = round(base["wall_s"] / r["wall_s"], 2)
        lat = r["later_turn_latency_s"]
        r["later_turn_speedup_vs_device_only"] = (
            round(base["later_turn_latency_s"] / lat, 2) if lat else None)
        print(f"{r['config']:<13} {r['pool_blocks']:>5} {r['offload_blocks']:>5} "
              f"{r['wall_s']:>7.2f} {r['speedup_vs_device_only']:>5.2f} {lat or 0:>7.3f} "
              f"{r['later_turn_speedup_vs_device_only'] or 0:>5.2f} "
              f"{r['computed_prompt_tokens']:>9} {r['device_hit_tokens']:>8} "
              f"{r['cpu_hit_tokens']:>8} {r['answers_equal_roomy']:>6}")


if __name__ == "__main__":
    main()
