"""Plots for the serving benchmark: latency CDFs and request-rate sweeps (matplotlib, PNG)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

STYLE = {"inproc": "-", "http": "--"}


def _rate_label(rate: str) -> str:
    return "burst" if math.isinf(float(rate)) else f"{float(rate):g} req/s"


def plot_latency_cdfs(report: dict[str, Any], path: Path) -> Path:
    """TTFT and end-to-end latency CDFs, one line per backend and request rate."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in zip(axes, ("ttft_s", "e2el_s"), ("time to first token",
                                                           "end-to-end latency")):
        for backend, runs in report["backends"].items():
            for rate, m in runs.items():
                xs = np.sort(np.asarray(m.get(key, []), dtype=float))
                if xs.size == 0:
                    continue
                ys = np.arange(1, xs.size + 1) / xs.size
                ax.plot(xs, ys, STYLE.get(backend, ":"), label=f"{backend} {_rate_label(rate)}")
        ax.set_xlabel("seconds")
        ax.set_ylabel("fraction of requests")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_rate_sweep(report: dict[str, Any], path: Path) -> Path:
    """Output throughput and p99 TTFT against the offered request rate."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for backend, runs in report["backends"].items():
        rates = sorted(runs, key=float)
        finite = [r for r in rates if not math.isinf(float(r))]
        xs = [float(r) for r in finite]
        burst = [r for r in rates if math.isinf(float(r))]
        for ax, key in zip(axes, ("output_throughput", "p99_ttft_ms")):
            if xs:
                ax.plot(xs, [runs[r][key] for r in finite], STYLE.get(backend, ":"),
                        marker="o", label=backend)
            for r in burst:  # a burst has no rate: draw it as a level
                ax.axhline(runs[r][key], ls=STYLE.get(backend, ":"), lw=0.8, alpha=0.6,
                           label=f"{backend} burst")
    axes[0].set_ylabel("output tokens / s")
    axes[1].set_ylabel("p99 TTFT (ms)")
    for ax in axes:
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_serve_report(report: dict[str, Any], stem: Path) -> list[Path]:
    """Every plot of a ``bench/serve.py`` report, written next to ``stem``."""
    return [plot_latency_cdfs(report, stem.with_name(stem.name + "_cdf.png")),
            plot_rate_sweep(report, stem.with_name(stem.name + "_rates.png"))]
