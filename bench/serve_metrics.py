"""Per-run metrics of ``bench/serve.py``, named as vLLM's ``bench serve`` names them.

``summarize`` turns one run's request results into throughput, TTFT / TPOT /
ITL / end-to-end percentiles and goodput under the ``--goodput`` SLOs.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Result:
    """One request as a client saw it (seconds)."""

    ok: bool = False
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""


def _stats(name: str, xs: list[float], out: dict[str, float]) -> None:
    ms = [x * 1000 for x in xs] or [float("nan")]
    out[f"mean_{name}_ms"] = statistics.fmean(ms)
    out[f"median_{name}_ms"] = float(np.median(ms))
    out[f"std_{name}_ms"] = float(np.std(ms))
    for p in (50, 90, 99):
        out[f"p{p}_{name}_ms"] = float(np.percentile(ms, p))


def summarize(results: list[Result], duration: float, slo_ms: dict[str, float]
              ) -> dict[str, Any]:
    """vLLM ``bench serve`` metrics of one run."""
    ok = [r for r in results if r.ok]
    tpot = [(r.e2el - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok)
    m: dict[str, Any] = {
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": in_tok, "total_output_tokens": out_tok,
        "request_throughput": len(ok) / duration, "output_throughput": out_tok / duration,
        "total_token_throughput": (in_tok + out_tok) / duration,
    }
    _stats("ttft", [r.ttft for r in ok], m)
    _stats("tpot", tpot, m)
    _stats("itl", [x for r in ok for x in r.itl], m)
    _stats("e2el", [r.e2el for r in ok], m)

    def good(r: Result) -> bool:
        per_tok = (r.e2el - r.ttft) / max(1, r.output_tokens - 1)
        vals = {"ttft": r.ttft, "tpot": per_tok, "e2el": r.e2el}
        return all(vals[k] * 1000 <= v for k, v in slo_ms.items())

    m["request_goodput"] = sum(good(r) for r in ok) / duration
    m["errors"] = sorted({r.error for r in results if r.error})[:5]
    m["ttft_s"] = [r.ttft for r in ok]
    m["e2el_s"] = [r.e2el for r in ok]
    return m


def parse_slo(items: list[str]) -> dict[str, float]:
    slo = {}
    for it in items:
        k, v = it.split(":")
        if k not in ("ttft", "tpot", "e2el"):
            raise SystemExit(f"--goodput keys are ttft, tpot, e2el (ms), got {k!r}")
        slo[k] = float(v)
    return slo


def burst_phases(m: dict[str, Any]) -> tuple[float, float]:
    """Split a burst run's duration (s) at its last first token: (prefill, decode).

    With every request sent at once, the first part is how long the last
    request waited for its first token (arrival, queueing, prefill steps) and
    the second how long the decodes ran after it, so a gap between two
    backends shows in the phase it comes from.
    """
    last_first = max(m["ttft_s"]) if m["ttft_s"] else 0.0
    return last_first, m["duration"] - last_first
