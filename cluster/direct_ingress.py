"""Ray Serve direct ingress: clients speak HTTP to the ingress replica itself.

Through Serve's proxy, every request is an actor call from the proxy to the
ingress replica, its body is fetched with more calls, and every message of the
response (each SSE event of a stream) goes back as one item of a Ray stream,
about 0.9 ms of CPU across the two processes here. With direct ingress (Ray's
``RAY_SERVE_ENABLE_DIRECT_INGRESS``) the ingress replica runs its own HTTP
server on a port of its own and writes responses straight to the socket. On a
CPU node that CPU comes out of the forward: on the 2-core development box a
32-stream burst kept 92.1% of the in-process engine's throughput through the
replica's port (mean of 14 paired runs, ``bench/serve.py --request-rate inf
--direct-ingress``) against 89.9% through the proxy (9 pairs the same
morning); single pairs there scatter by about 15 points (README, Serving).
The proxy keeps serving too, on the usual port.

It is a cluster-wide setting read by Serve's controller when it starts, so it
applies to a Ray cluster that ``pagedserve serve`` (or the benchmark) starts
itself, or to one whose nodes were started with the variable set. Each ingress
replica takes a port from ``RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT`` up (30000,
retried when taken) and binds Serve's HTTP host; a replica being replaced keeps
serving for a draining period so that a load balancer can move off it (Ray's
default is 30 s; 2 s here unless the operator sets it).
"""

from __future__ import annotations

import os
import time

ENABLE = "RAY_SERVE_ENABLE_DIRECT_INGRESS"
DRAINING = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
REPLICA_TARGET = "SERVE_REPLICA::"


def direct_ingress_env() -> dict[str, str]:
    """Environment turning direct ingress on for a Ray cluster started after it is set."""
    return {ENABLE: "1", DRAINING: os.environ.get(DRAINING, "2")}


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
    deadline = time.monotonic() + timeout_s
    while True:
        groups = ray.get(client._controller.get_target_groups.remote(), timeout=timeout_s)
        urls = []
        for g in groups:
            if g.app_name != app_name or g.protocol != RequestProtocol.HTTP:
                continue
            prefix = (g.route_prefix or "/").rstrip("/")
            for t in g.targets:
                if t.name.startswith(REPLICA_TARGET):
                    ip = t.ip if host in ("0.0.0.0", "::", "") else host
                    urls.append(f"http://{ip}:{t.port}{prefix}")
        if urls or os.environ.get(ENABLE) != "1" or time.monotonic() > deadline:
            return sorted(urls)
        time.sleep(0.2)
