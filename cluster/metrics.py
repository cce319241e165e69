"""Serving metrics: latency histograms kept by each engine replica, HTTP counters kept by the
ingress, and their rendering as Prometheus text.

Latencies are measured where the work happens (the engine replica) and travel with its
stats; the ingress renders every replica's numbers with a ``replica`` label at scrape
time. So ``/metrics`` says the same thing whichever ingress replica answers the scrape,
and a replica's counters restart (Prometheus handles resets) only when the replica does.
"""

from __future__ import annotations

import asyncio
import bisect
import threading
import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

PREFIX = "pagedserve"

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0,
               300.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
               2.5)


class Histogram:
    """A fixed-bucket histogram that pickles as a plain dict (it crosses Ray calls)."""

    def __init__(self, buckets: Iterable[float]) -> None:
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)  # last: +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def as_dict(self) -> dict[str, Any]:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.sum,
                "count": self.count}


class RequestTimer:
    """Timestamps of one request inside a replica; feeds ``ServerMetrics`` when it ends."""

    __slots__ = ("arrival", "first", "last", "tokens")

    def __init__(self) -> None:
        self.arrival = time.monotonic()
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0


class ServerMetrics:
    """Per-replica request outcomes and latency distributions."""

    def __init__(self) -> None:
        self.ttft = Histogram(TTFT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.finished: dict[str, int] = {}
        self.in_flight = 0

    def on_tokens(self, t: RequestTimer, num_new: int) -> None:
        if num_new <= 0:
            return
        now = time.monotonic()
        if t.first is None:
            t.first = now
            self.ttft.observe(now - t.arrival)
        elif t.last is not None:
            # Several tokens in one step share its gap, as vLLM's inter-token latency does.
            gap = (now - t.last) / num_new
            for _ in range(num_new):
                self.itl.observe(gap)
        t.last = now
        t.tokens += num_new

    def on_end(self, t: RequestTimer, reason: str) -> None:
        self.e2e.observe(time.monotonic() - t.arrival)
        self.finished[reason] = self.finished.get(reason, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        return {"ttft": self.ttft.as_dict(), "e2e": self.e2e.as_dict(), "itl": self.itl.as_dict(),
                "finished": dict(self.finished), "in_flight": self.in_flight}


class HttpMetrics:
    """Counts of HTTP responses by route and status, and of requests moved off a failed
    replica ("retry": before any token; "resume": mid-stream), kept by each ingress
    replica."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.responses: dict[tuple[str, int], int] = {}
        self.failovers: dict[str, int] = {"retry": 0, "resume": 0}
        self.in_flight = 0

    def record(self, route: str, status: int) -> None:
        with self._lock:
            self.responses[(route, status)] = self.responses.get((route, status), 0) + 1

    def record_failover(self, kind: str) -> None:
        with self._lock:
            self.failovers[kind] = self.failovers.get(kind, 0) + 1


class HttpMetricsMiddleware:
    """Plain ASGI middleware feeding :class:`HttpMetrics`.

    Starlette's ``BaseHTTPMiddleware`` would pipe every chunk of a streamed
    response through an extra task and memory stream, a cost paid per SSE
    event on the ingress's event loop. This one only watches the
    ``http.response.start`` message, and counts a request in flight until its
    last byte is sent, not just until its handler returns.
    """

    def __init__(self, app: Any, metrics: HttpMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def watch(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.metrics.in_flight += 1
        try:
            await self.app(scope, receive, watch)
        finally:
            self.metrics.in_flight -= 1
            self.metrics.record(scope["path"], status)


def _hist_family(name: str, doc: str, replicas: list[dict[str, Any]], key: str
                 ) -> HistogramMetricFamily:
    fam = HistogramMetricFamily(name, doc, labels=["replica"])
    for r in replicas:
        h = r["stats"].get("server", {}).get(key)
        if not h:
            continue
        cum, buckets = 0, []
        for bound, c in zip([*h["bounds"], float("inf")], h["counts"]):
            cum += c
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cum))
        fam.add_metric([r["replica"]], buckets, h["sum"])
    return fam


class _Collector:
    def __init__(self, replicas: list[dict[str, Any]], http: HttpMetrics | None,
                 store: dict[str, int] | None = None) -> None:
        self.replicas, self.http, self.store = replicas, http, store

    def collect(self) -> Iterable[Any]:
        p = PREFIX
        ok = [r for r in self.replicas if r.get("stats")]
        up = GaugeMetricFamily(f"{p}_replica_up", "1 if the replica answered the scrape",
                               labels=["replica"])
        for r in self.replicas:
            up.add_metric([r["replica"]], 1.0 if r.get("stats") else 0.0)
        yield up
        gauges = [
            ("num_requests_running", "Requests in the running batch", ("num_running",)),
            ("num_requests_waiting", "Requests waiting to be scheduled", ("num_waiting",)),
            ("num_requests_swapped", "Requests swapped out to CPU", ("num_swapped",)),
            ("kv_blocks_total", "KV blocks in the device pool", ("memory", "num_gpu_blocks")),
            ("kv_blocks_used", "KV blocks held by requests", ("memory", "num_used_blocks")),
            ("kv_blocks_free", "KV blocks free (incl. cached)", ("memory", "num_free_blocks")),
            ("kv_blocks_shared", "KV blocks with refcount > 1", ("memory", "num_shared_blocks")),
            ("kv_blocks_cached_free", "Free blocks still holding a prefix",
             ("memory", "num_cached_free_blocks")),
            ("kv_cpu_blocks_total", "Blocks of the CPU tier (swap and offloading)",
             ("memory", "num_cpu_blocks")),
            ("kv_cpu_blocks_cached", "CPU blocks holding an offloaded prefix",
             ("memory", "num_cpu_cached_blocks")),
            ("kv_block_bytes", "Bytes of one KV block (all layers, this rank)",
             ("memory", "bytes_per_block")),
            ("model_weight_bytes", "Bytes of model weights one rank holds (int8 codes and "
             "scales when quantized)", ("memory", "weight_bytes")),
            ("requests_in_flight", "Requests open on the replica", ("server", "in_flight")),
            ("lora_adapters_loaded", "LoRA adapters loaded", ("lora", "num_loaded")),
            ("spec_decode_suffix_cached_requests", "Responses in the suffix decoding cache",
             ("spec_decode", "suffix_cached_requests")),
            ("spec_decode_suffix_cached_tokens", "Tokens of the responses in the suffix "
             "decoding cache", ("spec_decode", "suffix_cached_tokens")),
            ("expert_parallel_balance", "Expert parallelism since start: the mean rank's "
             "routed pairs over the busiest rank's, per layer and step (1: even)",
             ("expert_parallel_balance",)),
        ]
        for name, doc, path in gauges:
            fam = GaugeMetricFamily(f"{p}_{name}", doc, labels=["replica"])
            for r in ok:
                v = _dig(r["stats"], path)
                if v is not None:
                    fam.add_metric([r["replica"]], float(v))
            yield fam
        info = GaugeMetricFamily(f"{p}_cache_config_info", "KV cache settings (value 1)",
                                 labels=["replica", "kv_cache_dtype"])
        for r in ok:
            info.add_metric([r["replica"], str(r["stats"]["memory"].get("kv_cache_dtype"))], 1.0)
        yield info
        usage = GaugeMetricFamily(f"{p}_kv_cache_usage_ratio", "Used / total KV blocks",
                                  labels=["replica"])
        for r in ok:
            m = r["stats"]["memory"]
            usage.add_metric([r["replica"]], m["num_used_blocks"] / max(1, m["num_gpu_blocks"]))
        yield usage
        counters = [
            ("prompt_tokens", "Prompt tokens received", ("prompt_tokens",)),
            ("generation_tokens", "Tokens generated", ("generation_tokens",)),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
             ("prefix_cache_queries",)),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache",
             ("prefix_cache_hits",)),
            ("prefix_cache_cpu_hits", "Prompt tokens loaded from the CPU tier (offloaded "
             "blocks) instead of computed", ("kv_offload", "cpu_hit_tokens")),
            ("kv_offloaded_blocks", "Evicted device blocks copied to the CPU tier",
             ("kv_offload", "offloaded_blocks")),
            ("engine_steps", "Engine steps run", ("steps",)),
            ("spec_decode_num_drafts", "Decode rows that carried draft tokens",
             ("spec_decode", "num_drafts")),
            ("spec_decode_num_draft_tokens", "Draft tokens proposed",
             ("spec_decode", "num_draft_tokens")),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted",
             ("spec_decode", "num_accepted_tokens")),
            ("lora_evictions", "LoRA adapters unloaded to make room for another",
             ("lora", "evictions")),
            ("kv_exported_blocks", "KV blocks shipped to decode replicas (prefill replicas)",
             ("kv_exported_blocks",)),
            ("kv_imported_blocks", "KV blocks received from prefill replicas",
             ("kv_imported_blocks",)),
            ("remote_prefills", "Prompts computed on a prefill replica",
             ("remote_prefill", "remote_prefills")),
            ("remote_prefill_failures", "Remote prefills that failed and ran locally instead",
             ("remote_prefill", "failures")),
            ("remote_prefill_overflow", "Prompts computed locally past remote_prefill_max_inflight",
             ("remote_prefill", "overflow")),
            ("shared_prefix_steps", "Decode steps whose attention split off prefixes that "
             "rows share (cascade attention)", ("shared_prefix_steps",)),
            ("shared_prefix_rows", "Decode rows that read a shared prefix once per run of rows",
             ("shared_prefix_rows",)),
            ("shared_prefix_keys_saved", "Prefix keys per layer not read again thanks to the "
             "split", ("shared_prefix_keys_saved",)),
            ("expert_parallel_routed_pairs", "Token-expert pairs routed, over layers and "
             "steps (expert parallelism; the last pipeline stage's layers)",
             ("expert_parallel_routed_pairs",)),
            ("expert_parallel_busiest_pairs", "The busiest rank's pairs of each layer and "
             "step, summed (routed / (ranks x busiest) is the balance)",
             ("expert_parallel_busiest_pairs",)),
        ]
        for name, doc, path in counters:
            fam = CounterMetricFamily(f"{p}_{name}", doc, labels=["replica"])
            for r in ok:
                v = _dig(r["stats"], path)
                if v is not None:
                    fam.add_metric([r["replica"]], float(v))
            yield fam
        lora = GaugeMetricFamily(f"{p}_lora_requests", "Sequences per LoRA adapter and state "
                                 "(running, waiting, swapped)",
                                 labels=["replica", "adapter", "state"])
        for r in ok:
            for state in ("running", "waiting", "swapped"):
                for name, n in (_dig(r["stats"], ("lora", state)) or {}).items():
                    lora.add_metric([r["replica"], name, state], float(n))
        yield lora
        fin = CounterMetricFamily(f"{p}_request_finished", "Requests ended, by finish reason",
                                  labels=["replica", "finished_reason"])
        pre = CounterMetricFamily(f"{p}_num_preemptions", "Preemptions by mode",
                                  labels=["replica", "mode"])
        for r in ok:
            for reason, n in r["stats"].get("server", {}).get("finished", {}).items():
                fin.add_metric([r["replica"], reason], float(n))
            for mode, n in (r["stats"].get("num_preemptions") or {}).items():
                pre.add_metric([r["replica"], mode], float(n))
        yield fin
        yield pre
        for key, doc in (("num_accepted_tokens_per_pos", "Draft tokens accepted, by their "
                          "position in the draft (0: the first guess)"),
                         ("num_draft_tokens_per_pos", "Draft tokens proposed, by their "
                          "position in the draft")):
            fam = CounterMetricFamily(f"{p}_spec_decode_{key}", doc,
                                      labels=["replica", "position"])
            for r in ok:
                for pos, n in enumerate(_dig(r["stats"], ("spec_decode", key)) or ()):
                    fam.add_metric([r["replica"], str(pos)], float(n))
            yield fam
        yield _hist_family(f"{p}_time_to_first_token_seconds", "Time to first token", ok,
                           "ttft")
        yield _hist_family(f"{p}_e2e_request_latency_seconds", "End-to-end latency", ok, "e2e")
        yield _hist_family(f"{p}_inter_token_latency_seconds", "Inter-token latency", ok, "itl")
        if self.http is not None:
            fam = CounterMetricFamily(f"{p}_http_requests", "HTTP responses by route and status",
                                      labels=["route", "status"])
            with self.http._lock:
                items = list(self.http.responses.items())
            for (route, status), n in items:
                fam.add_metric([route, str(status)], float(n))
            yield fam
            moved = CounterMetricFamily(
                f"{p}_request_failovers", "Requests moved off a failed engine replica: "
                "retried before any token, or resumed mid-stream", labels=["kind"])
            with self.http._lock:
                for kind, n in self.http.failovers.items():
                    moved.add_metric([kind], float(n))
            yield moved
            yield GaugeMetricFamily(f"{p}_http_requests_in_flight",
                                    "HTTP requests open on this ingress replica",
                                    value=float(self.http.in_flight))
        for key, what in (("entries", "Responses kept by the responses store"),
                          ("background_running", "Background responses generating"),
                          ("events_kept", "Streamed background events kept for resuming")):
            if self.store is not None:
                yield GaugeMetricFamily(f"{p}_responses_store_{key}", what,
                                        value=float(self.store[key]))


def _dig(d: dict[str, Any], path: tuple[str, ...]) -> Any:
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


async def call_each_replica(handle: Any, replica_ids: list[str], method: str,
                            timeout_s: float, **args: Any) -> list[dict[str, Any]]:
    """Call ``method`` on every engine replica by id; a failure is reported, not raised.

    Used for ``/v1/stats``, ``/metrics`` (method ``stats``), ``/health`` (``probe``) and
    the admin calls (``sleep``...; ``args`` travel in the ``ReplicaCall``).
    """
    from pagedserve.cluster.wire import ReplicaCall

    async def call(rid: str) -> dict[str, Any]:
        try:
            res = await asyncio.wait_for(
                getattr(handle, method).remote(ReplicaCall(rid, timeout_s, args)),
                timeout_s + 5)
            return {"replica": rid, "stats" if method == "stats" else "result": res}
        except Exception as e:
            last = (str(e).strip().splitlines() or [""])[-1][:300]
            return {"replica": rid, "error": f"{type(e).__name__}: {last}"}

    return list(await asyncio.gather(*(call(r) for r in replica_ids)))


def render_prometheus(replicas: list[dict[str, Any]], http: HttpMetrics | None = None,
                      store: dict[str, int] | None = None) -> bytes:
    """Prometheus text for ``[{"replica": id, "stats": engine stats or None}, ...]`` (and
    the responses store's ``stats``, when the app has one)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(replicas, http, store))  # type: ignore[arg-type]
    return generate_latest(registry)
