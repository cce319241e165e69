"""Serving benchmark: the HTTP/Ray Serve path against the in-process ``AsyncEngine``.

Both backends get the same requests (random prompt token ids of ``--input-len``, exactly
``--output-len`` generated tokens with ``ignore_eos``) on the same arrival schedule: Poisson
at each ``--request-rate`` (``inf`` = all at once), optionally capped by
``--max-concurrency``. The in-process engine is timed at its own ``generate`` iterator;
the HTTP path at an OpenAI streaming client, so the ratio prices the whole serving stack
(proxy, ingress, routing, Ray streaming, SSE). Metric names follow vLLM's ``bench serve``
(``request_throughput``, ``output_throughput``, ``mean_ttft_ms``, ``p99_itl_ms``,
``request_goodput`` ...); goodput counts requests meeting every ``--goodput`` SLO.
For a burst it also splits each run at its last first token and prints how much longer
HTTP took before it (arrival, the first steps) and after it (the decodes).

    python bench/serve.py --num-prompts 48 --request-rate 1,2,4,inf
    python bench/serve.py --max-concurrency 8 --request-rate inf --backends http
    python bench/serve.py --url http://127.0.0.1:8000 --backends http   # a running server
    python bench/serve.py --no-stream    # HTTP without SSE: the per-request cost alone
    python bench/serve.py --request-rate inf --repeat 5   # median of 5 paired runs

Writes ``serve_<timestamp>.json`` and PNG plots into ``--out`` (default bench/results/).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_metrics import Result, burst_phases, parse_slo, summarize


@dataclass
class Req:
    prompt: list[int]
    output_len: int


def make_requests(n: int, input_len: int, output_len: int, seed: int) -> list[Req]:
    """Random token ids in a plain-text id range, so no special token ends a prompt."""
    rng = random.Random(seed)
    return [Req([rng.randrange(1000, 40000) for _ in range(input_len)], output_len)
            for _ in range(n)]


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    return list(np.cumsum(rng.exponential(1.0 / rate, n)))


async def run_schedule(reqs: list[Req], rate: float, max_concurrency: int | None, seed: int,
                       send: Any) -> tuple[list[Result], float]:
    """Send each request at its arrival time (bounded by the semaphore); wall time too."""
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t0 = time.perf_counter()

    async def one(at: float, r: Req) -> Result:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        if sem is None:
            return await send(r)
        async with sem:
            return await send(r)

    results = await asyncio.gather(*(one(at, r) for at, r in
                                     zip(arrival_times(len(reqs), rate, seed), reqs)))
    return list(results), time.perf_counter() - t0


# ---- backends -------------------------------------------------------------------------


class InProcess:
    """The engine in this process: what the serving stack adds nothing to."""

    name = "inproc"

    def __init__(self, engine_kwargs: dict[str, Any]) -> None:
        from pagedserve.cluster.async_engine import AsyncEngine
        from pagedserve.cluster.config import EngineConfig

        self.engine = AsyncEngine(EngineConfig(**engine_kwargs))
        self._ids = 0

    async def send(self, r: Req) -> Result:
        from pagedserve.scheduler.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0)
        self._ids += 1
        res, start, last = Result(prompt_tokens=len(r.prompt)), time.perf_counter(), 0.0
        shown, n = 0, 0
        try:
            async for out in self.engine.generate(r.prompt, params, f"b{self._ids}"):
                # Timed like the HTTP client (and vLLM's bench): when new text shows, so a
                # token that decodes to nothing yet (part of a character) counts later.
                now, n, k = time.perf_counter(), len(out.outputs[0].token_ids), len(
                    out.outputs[0].text)
                if k > shown:
                    if shown == 0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last, shown = now, k
            res.ok, res.e2el, res.output_tokens = True, time.perf_counter() - start, n
        except Exception as e:
            res.error = repr(e)
        return res

    async def close(self) -> None:
        await self.engine.shutdown()


class Http:
    """An OpenAI streaming client against the Serve app (deployed here unless ``url``)."""

    name = "http"

    def __init__(self, serve_args: dict[str, Any], url: str | None, api_key: str | None,
                 stream: bool = True, ingress: str = "proxy") -> None:
        self.stream = stream
        self.ingress = ingress
        self.started = url is None
        if url is None:
            url = self._deploy(serve_args)
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client: Any = None

    def _deploy(self, serve_args: dict[str, Any]) -> str:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        import ray
        from ray import serve

        from pagedserve.cluster.placement import local_cluster_env
        from pagedserve.cluster.serve_app import build_app

        os.environ.update(local_cluster_env())  # what `pagedserve serve` starts Ray with
        from pagedserve.cluster import http_front

        self.ingress = http_front.resolve_ingress(self.ingress)
        os.environ.update(http_front.ingress_env(self.ingress))
        ray.init(address="local", include_dashboard=False, log_to_driver=False,
                 num_cpus=max(4, os.cpu_count() or 1))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(serve_args), name="bench", route_prefix="/")
        if self.ingress == "direct":
            return http_front.direct_ingress_urls("bench", "127.0.0.1")[0]
        return f"http://127.0.0.1:{port}"

    async def send(self, r: Req) -> Result:
        import aiohttp

        if self.client is None:
            # aiohttp, as vLLM's `bench serve` uses: on a CPU node the client shares the
            # cores with the engine, and httpx took 5.9 ms of CPU per 64-token stream
            # here against 2.2-2.8 ms (bench/serve_cpu.py).
            self.client = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None),
                connector=aiohttp.TCPConnector(limit=0, force_close=False))
        body = {"prompt": r.prompt, "max_tokens": r.output_len, "temperature": 0.0,
                "ignore_eos": True}
        if not self.stream:
            return await self._send_whole(body)
        body.update(stream=True, stream_options={"include_usage": True})
        res, start, last = Result(), time.perf_counter(), 0.0
        try:
            async with self.client.post(f"{self.url}/v1/completions", json=body,
                                        headers=self.headers) as resp:
                if resp.status != 200:
                    res.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
                    return res
                async for raw in resp.content:  # one SSE line at a time
                    line = raw.strip()
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    data = json.loads(line[6:])
                    if "error" in data:
                        res.error = data["error"]["message"]
                        return res
                    now = time.perf_counter()
                    if data.get("usage"):
                        res.output_tokens = data["usage"]["completion_tokens"]
                        res.prompt_tokens = data["usage"]["prompt_tokens"]
                    if data.get("choices") and data["choices"][0]["text"]:
                        if res.ttft == 0.0:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last = now
            res.ok, res.e2el = True, time.perf_counter() - start
        except Exception as e:
            res.error = repr(e)
        return res

    async def _send_whole(self, body: dict[str, Any]) -> Result:
        """One non-streaming request: TTFT is the whole latency, no ITL."""
        res, start = Result(), time.perf_counter()
        try:
            async with self.client.post(f"{self.url}/v1/completions", json=body,
                                        headers=self.headers) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    res.error = f"HTTP {resp.status}: {raw[:200]!r}"
                    return res
            usage = json.loads(raw)["usage"]
            res.output_tokens, res.prompt_tokens = usage["completion_tokens"], usage["prompt_tokens"]
            res.ok, res.ttft = True, time.perf_counter() - start
            res.e2el = res.ttft
        except Exception as e:
            res.error = repr(e)
        return res

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
        if self.started:
            import ray
            from ray import serve

            from pagedserve.cluster.http_front import stop_leftover_haproxy

            node_id = ray.get_runtime_context().get_node_id()
            serve.shutdown()
            ray.shutdown()
            stop_leftover_haproxy(node_id)


async def bench_backend(backend: Any, reqs: list[list[Req]], rates: list[float],
                        args: argparse.Namespace, slo: dict[str, float]) -> dict[str, Any]:
    out = {}
    warm = make_requests(2, args.input_len, 4, args.seed + 1)
    await run_schedule(warm, math.inf, None, 0, backend.send)  # first-call costs
    for rate, rate_reqs in zip(rates, reqs):
        results, dur = await run_schedule(rate_reqs, rate, args.max_concurrency, args.seed,
                                          backend.send)
        m = summarize(results, dur, slo)
        out[str(rate)] = m
        print(f"  {backend.name:6s} rate={rate:<5} done={m['completed']}/{len(rate_reqs)} "
              f"out_tok/s={m['output_throughput']:.1f} req/s={m['request_throughput']:.2f} "
              f"ttft p50/p99={m['median_ttft_ms']:.0f}/{m['p99_ttft_ms']:.0f} ms "
              f"tpot p50={m['median_tpot_ms']:.1f} ms itl p99={m['p99_itl_ms']:.1f} ms "
              f"goodput={m['request_goodput']:.2f}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF dir or .gguf (default: SmolLM2-135M)")
    p.add_argument("--backends", default="inproc,http")
    p.add_argument("--url", default=None, help="benchmark a running server instead")
    p.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"))
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--request-rate", default="inf", help="comma list, req/s; inf = burst")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--goodput", nargs="*", default=["ttft:2000", "tpot:250"],
                   help="SLOs in ms, e.g. ttft:2000 tpot:250 e2el:20000")
    p.add_argument("--num-gpu-blocks", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--burst-wait-ms", type=float, default=None,
                   help="an idle engine's wait for the rest of a burst, both backends "
                        "(default: the engine's own, sized from its steps; 0: off)")
    p.add_argument("--num-replicas", type=int, default=1)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--stream-interval-ms", type=float, default=None,
                   help="engine replicas merge a stream's tokens over this interval "
                        "(default: the server's)")
    p.add_argument("--stream-messages-per-s", type=float, default=None,
                   help="a replica's streamed-message budget (default: the server's; "
                        "0: none)")
    p.add_argument("--no-stream", action="store_true",
                   help="HTTP requests without streaming (prices the per-request path alone)")
    p.add_argument("--ingress", choices=("auto", "proxy", "direct", "haproxy"), default="auto",
                   help="the HTTP front clients talk to: HAProxy in front of the ingress "
                        "replica's own port, Serve's Python proxy, or that port itself; "
                        "auto: as `pagedserve serve` (see pagedserve.cluster.http_front)")
    p.add_argument("--repeat", type=int, default=1,
                   help="run every backend this many times, in A B / B A order, and report "
                        "the median HTTP / in-process ratio (this box's runs vary by several "
                        "%%)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)
    if args.repeat < 1:
        raise SystemExit(f"--repeat must be >= 1, got {args.repeat}")
    rates = [float(x) for x in args.request_rate.split(",")]
    slo = parse_slo(args.goodput)
    # Fresh prompts per rate (the same for every backend): a rate must not find the
    # previous rate's prompts in the prefix cache.
    reqs = [make_requests(args.num_prompts, args.input_len, args.output_len, args.seed + 7919 * i)
            for i in range(len(rates))]
    engine_kwargs = dict(model=args.model, num_gpu_blocks=args.num_gpu_blocks,
                         max_num_seqs=args.max_num_seqs, num_threads=args.num_threads,
                         burst_wait_ms=args.burst_wait_ms,
                         tensor_parallel_size=args.tensor_parallel_size)
    serve_args = {**engine_kwargs, "num_replicas": args.num_replicas,
                  "max_ongoing_requests": max(64, args.num_prompts),
                  "max_queued_requests": -1}
    if args.stream_interval_ms is not None:
        serve_args["stream_interval_ms"] = args.stream_interval_ms
    if args.stream_messages_per_s is not None:
        serve_args["stream_messages_per_s"] = args.stream_messages_per_s
    print(f"{args.num_prompts} requests per rate, input {args.input_len}, output {args.output_len} tokens, "
          f"rates {rates}, concurrency {args.max_concurrency or 'unbounded'}, SLO {slo} ms")
    report: dict[str, Any] = {"config": vars(args), "slo_ms": slo, "repeats": []}
    if args.url is None and "http" in args.backends.split(","):
        from pagedserve.cluster.http_front import resolve_ingress

        report["http_front"] = resolve_ingress(args.ingress)  # what auto chose

    async def run_all() -> None:
        names = args.backends.split(",")
        for i in range(args.repeat):
            runs: dict[str, Any] = {}
            # Every other repeat runs the backends in reverse (A B, B A, A B ...): this box
            # drifts by several % over minutes, and a fixed order would hand that drift to
            # every pair in the same direction.
            for name in (names if i % 2 == 0 else names[::-1]):
                backend: Any = InProcess(engine_kwargs) if name == "inproc" else Http(
                    serve_args, args.url, args.api_key, stream=not args.no_stream,
                    ingress=args.ingress)
                try:
                    runs[name] = await bench_backend(backend, reqs, rates, args, slo)
                finally:
                    await backend.close()
            report["repeats"].append(runs)

    asyncio.run(run_all())
    report["backends"] = report["repeats"][-1]
    b = report["backends"]
    if "inproc" in b and "http" in b:
        ratios = {rate: [r["http"][rate]["output_throughput"] / r["inproc"][rate]["output_throughput"]
                         for r in report["repeats"]] for rate in b["http"]}
        report["ratio_http_vs_inproc"] = {
            rate: {"output_throughput": statistics.median(ratios[rate]),
                   "output_throughput_each_repeat": ratios[rate],
                   "median_ttft": b["inproc"][rate]["median_ttft_ms"]
                   / max(1e-9, b["http"][rate]["median_ttft_ms"])}
            for rate in b["http"]}
        if "inf" in b["http"]:
            # Where a burst's gap comes from: the wait for every first token, or the decodes.
            pairs = [(burst_phases(r["inproc"]["inf"]), burst_phases(r["http"]["inf"]))
                     for r in report["repeats"]]
            split = {f"{name}_s": {"inproc": statistics.median(a[i] for a, _ in pairs),
                                   "http": statistics.median(h[i] for _, h in pairs),
                                   "http_extra": statistics.median(h[i] - a[i] for a, h in pairs)}
                     for i, name in enumerate(("until_last_first_token", "decode_after_it"))}
            report["ratio_http_vs_inproc"]["inf"]["burst_phases"] = split
            print("burst phases, medians over the pairs: " + "; ".join(
                f"{k[:-2].replace('_', ' ')} {v['inproc']:.2f} s in-process, {v['http']:.2f} s "
                f"HTTP ({v['http_extra']:+.2f} s)" for k, v in split.items()))
        for rate, r in report["ratio_http_vs_inproc"].items():
            verdict = "ok" if r["output_throughput"] >= 0.9 else "BELOW GOAL"
            each = ", ".join(f"{x:.1%}" for x in r["output_throughput_each_repeat"])
            print(f"rate={rate}: HTTP/Ray output throughput = {r['output_throughput']:.1%} of "
                  f"in-process (median of {args.repeat} paired runs: {each}; "
                  f"goal >= 90%: {verdict})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = out / f"serve_{stamp}.json"
    path.write_text(json.dumps(report, indent=1, default=str))
    try:
        from plots import plot_serve_report

        for png in plot_serve_report(report, out / f"serve_{stamp}"):
            print("wrote", png)
    except ImportError as e:
        print(f"plots skipped ({e})")
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
