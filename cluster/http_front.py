"""The HTTP front clients talk to: Serve's proxy, direct ingress, or HAProxy.

``proxy``: Serve's Python proxy owns Serve's HTTP port. Every request is an
actor call from the proxy to the ingress replica, its body is fetched with
more calls, and every message of the response (each SSE event of a stream)
goes back as one item of a Ray stream: about 0.9 ms of CPU per message across
the two processes here, and about 14 ms per 64-token stream in the proxy.

``direct`` (Ray's ``RAY_SERVE_ENABLE_DIRECT_INGRESS``): each ingress replica
also runs its own HTTP server on a port of its own and writes responses
straight to the socket; the proxy keeps serving Serve's port.

``haproxy`` (Ray's ``RAY_SERVE_ENABLE_HA_PROXY``, with the HAProxy binary that
``ray[serve]`` installs on Linux): HAProxy, in C, takes Serve's port in place
of the Python proxy and balances over the replicas' own ports, so clients keep
one URL at direct ingress's cost. This is the front Ray's high-throughput guide
recommends, and the default (``auto``) when ``pagedserve`` starts its own Ray
and the binary is there. On a CPU node the front's CPU comes out of the
forward: on the 2-core development box the serving stack took 37 ms of CPU
per 64-token stream of a 32-stream burst outside the engine through HAProxy,
against 50 ms through the proxy (``bench/serve_cpu.py --ingress``), and six
alternating burst pairs each kept a mean of 89.4% of the in-process engine's
throughput through HAProxy against 86.9% through the proxy (README, Serving).

All three are cluster-wide settings that Serve's controller reads when it
starts: they apply to a Ray that ``pagedserve serve`` (or the benchmark)
starts itself, or to one whose nodes were started with the variables set.
Each ingress replica takes a port from ``RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT``
up (30000, retried when taken) and binds Serve's HTTP host; a replica being
replaced keeps serving for a draining period so that a load balancer can move
off it (Ray's default is 30 s; 2 s here unless the operator sets it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from pathlib import Path

ENABLE = "RAY_SERVE_ENABLE_DIRECT_INGRESS"
HAPROXY = "RAY_SERVE_ENABLE_HA_PROXY"
# HAProxy's stats page and Prometheus endpoint, and the fallback Python proxy behind it:
# fixed ports (8404, 9101, 8500, 9500) by default, which a second cluster on the same
# machine could not bind (HAProxy then does not start at all).
HAPROXY_PORTS = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT",
                 "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT")
DRAINING = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
REPLICA_TARGET = "SERVE_REPLICA::"
INGRESS_MODES = ("auto", "proxy", "direct", "haproxy")


def haproxy_binary() -> str | None:
    """The HAProxy Serve would run (bundled with ``ray[serve]`` on Linux), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        from ray.serve._private.haproxy import get_haproxy_binary

        return get_haproxy_binary()
    except (ImportError, OSError):
        return None


def resolve_ingress(mode: str) -> str:
    """``auto`` becomes ``haproxy`` where its binary exists, else ``proxy``."""
    if mode not in INGRESS_MODES:
        raise ValueError(f"ingress must be one of {', '.join(INGRESS_MODES)}, got {mode!r}")
    if mode == "auto":
        return "haproxy" if haproxy_binary() else "proxy"
    if mode == "haproxy" and not haproxy_binary():
        raise ValueError("ingress 'haproxy' needs the HAProxy binary (ray[serve] on Linux, "
                         "or RAY_SERVE_HAPROXY_BINARY_PATH)")
    return mode


def ingress_env(mode: str) -> dict[str, str]:
    """Environment for a new Ray cluster whose HTTP front is ``mode`` (resolved first).

    ``haproxy`` also gets free ports for HAProxy's stats and metrics and for the fallback
    proxy, unless they are set.
    """
    mode = resolve_ingress(mode)
    if mode == "proxy":
        return {}
    env = {ENABLE: "1", DRAINING: os.environ.get(DRAINING, "2")}
    if mode == "haproxy":
        env[HAPROXY] = "1"
        for var in HAPROXY_PORTS:
            env[var] = os.environ.get(var) or str(_free_port())
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def direct_ingress_urls(app_name: str, host: str, timeout_s: float = 30.0) -> list[str]:
    """Base URLs (route prefix included) of ``app_name``'s ingress replicas' own HTTP servers.

    Empty when the cluster runs without direct ingress. ``host`` is Serve's HTTP host,
    the address each replica binds: it is the URL's host unless it is a wildcard, in
    which case the replica's node address is. Waits up to ``timeout_s`` for the
    controller to publish the replicas of an application that was just deployed.
    """
    import ray
    from ray.serve._private.common import RequestProtocol
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        raise RuntimeError("Serve is not running on this Ray cluster")
    haproxy = os.environ.get(HAPROXY) == "1"
    deadline = time.monotonic() + timeout_s
    while True:
        # Under HAProxy the controller names HAProxy as the target, unless the caller is
        # the proxy manager, which is given the replicas behind it.
        groups = ray.get(client._controller.get_target_groups.remote(
            from_proxy_manager=haproxy), timeout=timeout_s)
        urls = []
        for g in groups:
            if g.app_name != app_name or g.protocol != RequestProtocol.HTTP:
                continue
            prefix = (g.route_prefix or "/").rstrip("/")
            for t in g.targets:
                if t.name.startswith(REPLICA_TARGET):
                    ip = t.ip if host in ("0.0.0.0", "::", "") else host
                    urls.append(f"http://{ip}:{t.port}{prefix}")
        if urls or not (haproxy or os.environ.get(ENABLE) == "1") or (
                time.monotonic() > deadline):
            return sorted(urls)
        time.sleep(0.2)


def stop_leftover_haproxy(node_id: str) -> int:
    """Stop HAProxy processes of ``node_id`` that outlived their Ray; returns how many.

    Serve's HAProxy manager stops HAProxy when Serve shuts down cleanly, but HAProxy is
    not one of Ray's workers: if the controller dies first, it stays, holding Serve's port.
    Its command line names its config under a directory per node id.
    """
    mark, count = f"/{node_id}/".encode(), 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:  # it exited meanwhile
            continue
        if cmd[0].endswith(b"haproxy") and any(mark in arg for arg in cmd):
            with contextlib.suppress(OSError):  # it exited meanwhile
                os.kill(int(proc.name), signal.SIGTERM)
                count += 1
    return count
