"""Disaggregated prefill against colocated replicas, side by side, same cores.

Two apps serve the same mixed workload over HTTP, one after the other: short chat
turns (``--chat-input-len`` random tokens, ``--chat-output-len`` streamed tokens)
arriving at ``--chat-rate`` per second, and long documents (``--doc-input-len``
tokens, ``--doc-output-len`` tokens) at ``--doc-rate``, both Poisson, the same
schedule for both apps:

- colocated: ``--replicas`` engine replicas (default 2), each doing both phases;
- disaggregated: one prefill replica and ``--replicas - 1`` decode replicas
  (``prefill_replicas``), the same threads per replica.

A long prompt on a colocated replica is one long step, during which every chat
stream on that replica waits; on the disaggregated app it runs on the prefill
replica, and the decode replica only writes the shipped K/V. The figures that
matter are the chat streams' inter-token latency tail and the documents' time
to first token (vLLM's ``bench serve`` names); printed as disaggregated /
colocated ratios.

    python bench/disagg.py --json bench/figures/disagg.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve import Http, Req
from serve_metrics import Result, summarize


def workload(args: argparse.Namespace) -> list[tuple[float, str, Req]]:
    """(arrival time, class, request), sorted by time; random ids in a plain-text range."""
    rng = random.Random(args.seed)
    nrng = np.random.default_rng(args.seed)
    out = []
    for kind, n, rate, n_in, n_out in (
            ("chat", args.num_chats, args.chat_rate, args.chat_input_len, args.chat_output_len),
            ("doc", args.num_docs, args.doc_rate, args.doc_input_len, args.doc_output_len)):
        times = np.cumsum(nrng.exponential(1.0 / rate, n))
        for t in times:
            out.append((float(t), kind, Req([rng.randrange(1000, 40000) for _ in range(n_in)],
                                            n_out)))
    return sorted(out, key=lambda x: x[0])


async def run(backend: Http, reqs: list[tuple[float, str, Req]]
              ) -> tuple[dict[str, list[Result]], float]:
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    async def one(at: float, r: Req) -> Result:
        await asyncio.sleep(max(0.0, t0 + at - loop.time()))
        return await backend.send(r)

    results = await asyncio.gather(*(one(at, r) for at, _, r in reqs))
    by: dict[str, list[Result]] = {"chat": [], "doc": []}
    for (_, kind, _), res in zip(reqs, results, strict=True):
        by[kind].append(res)
    return by, loop.time() - t0


async def measure(name: str, serve_args: dict[str, Any], reqs: list[tuple[float, str, Req]]
                  ) -> dict[str, Any]:
    """Deploy the app, warm it up, run the schedule, tear it down; per-class metrics."""
    backend = Http({**serve_args, "max_ongoing_requests": 128, "max_queued_requests": -1},
                   None, None)
    try:
        await backend.send(Req([1000 + i for i in range(200)], 2))  # first-call costs
        by, wall = await run(backend, reqs)
    finally:
        await backend.close()
    failed = [r.error for rs in by.values() for r in rs if not r.ok]
    if failed:
        raise SystemExit(f"{name}: {len(failed)} requests failed, first: {failed[0]}")
    out = {kind: summarize(rs, wall, {}) for kind, rs in by.items()}
    itl = np.array([x for r in by["chat"] for x in r.itl]) * 1000
    out["chat"].update(p999_itl_ms=float(np.percentile(itl, 99.9)), max_itl_ms=float(itl.max()),
                       itl_over_1s=int((itl > 1000).sum()), itl_count=int(itl.size))
    print(f"{name}: chat ITL p50 {out['chat']['p50_itl_ms']:.0f} ms, "
          f"p99 {out['chat']['p99_itl_ms']:.0f} ms; doc TTFT p50 "
          f"{out['doc']['p50_ttft_ms']:.0f} ms", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per replica")
    p.add_argument("--num-chats", type=int, default=64)
    p.add_argument("--chat-rate", type=float, default=1.5)
    p.add_argument("--chat-input-len", type=int, default=48)
    p.add_argument("--chat-output-len", type=int, default=64)
    p.add_argument("--num-docs", type=int, default=8)
    p.add_argument("--doc-rate", type=float, default=0.15)
    p.add_argument("--doc-input-len", type=int, default=1536)
    p.add_argument("--doc-output-len", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)
    if args.replicas < 2:
        p.error("--replicas must be >= 2 (one of them prefills in the disaggregated app)")
    base = {"num_threads": args.num_threads, "num_gpu_blocks": 512, "max_model_len": 4096,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "stream_interval_ms": 0.0}
    reqs = workload(args)
    colo = asyncio.run(measure("colocated", {**base, "num_replicas": args.replicas}, reqs))
    pd = asyncio.run(measure("disaggregated", {
        **base, "num_replicas": args.replicas - 1, "prefill_replicas": 1,
        "remote_prefill_min_tokens": args.chat_input_len + 1}, reqs))
    rows = [("chat ITL p50 (ms)", "chat", "p50_itl_ms"), ("chat ITL p99 (ms)", "chat",
                                                         "p99_itl_ms"),
            ("chat ITL p99.9 (ms)", "chat", "p999_itl_ms"),
            ("chat ITL max (ms)", "chat", "max_itl_ms"),
            ("chat ITLs > 1 s", "chat", "itl_over_1s"),
            ("chat TPOT mean (ms)", "chat", "mean_tpot_ms"),
            ("chat TTFT p50 (ms)", "chat", "p50_ttft_ms"),
            ("doc TTFT p50 (ms)", "doc", "p50_ttft_ms"),
            ("doc TTFT p99 (ms)", "doc", "p99_ttft_ms"),
            ("output tok/s (all)", None, "output_throughput")]
    print(f"\n{'':24}{'colocated':>12}{'disagg':>12}{'disagg/colo':>13}")
    table = {}
    for label, kind, key in rows:
        if kind is None:
            c = colo["chat"][key] + colo["doc"][key]
            d = pd["chat"][key] + pd["doc"][key]
        else:
            c, d = colo[kind][key], pd[kind][key]
        table[label] = {"colocated": c, "disaggregated": d, "ratio": d / c if c else None}
        print(f"{label:24}{c:12.1f}{d:12.1f}{d / c if c else float('nan'):12.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "table": table,
                                               "colocated": colo, "disaggregated": pd},
                                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
