"""Deploy the Serve application for a command and remove it afterwards.

``pagedserve serve`` and ``pagedserve run-batch`` share this: start a fresh local Ray
unless given ``--address`` (or ``RAY_ADDRESS``), start Serve when none runs, deploy
the app, and on the way out delete it (its open requests get ``--drain-timeout-s``)
and stop Serve and Ray when this process started them. A second Ctrl-C during the
drain stops at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from typing import Any


class SetupError(Exception):
    """A bad setting, found before anything started (the command exits with 2)."""


@contextlib.contextmanager
def local_app(args: Any, command: str, quiet: bool = False) -> Iterator[tuple[str, str]]:
    """Deploy ``args``' app; yields its base URL and HTTP front. ``args.port`` 0 takes a
    free port; ``quiet`` keeps the cluster's logs off this process's output (a command
    whose stdout is data)."""
    address = args.address or os.environ.get("RAY_ADDRESS") or None
    if address is None:
        # A new single-user cluster: no token auth, so `--address` clients can join it.
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    from pagedserve.cluster import http_front
    from pagedserve.cluster.placement import local_cluster_env
    from pagedserve.cluster.serve_app import build_app

    try:
        build_app(args)  # validates the engine settings before anything starts
    except ValueError as e:  # (pydantic's ValidationError is one too)
        raise SetupError(str(e)) from None
    started_ray = address is None
    try:
        front = http_front.resolve_ingress(args.ingress) if started_ray else "cluster's"
    except ValueError as e:
        raise SetupError(str(e)) from None
    if args.port == 0:
        with socket.socket() as sock:
            sock.bind((args.host, 0))
            args.port = int(sock.getsockname()[1])
    if started_ray:
        # Every rank gets at least one logical CPU and a TP replica's scheduler one more,
        # even on a machine with fewer cores (serve_app sizes threads by real cores).
        need = args.num_replicas * (args.tensor_parallel_size * args.pipeline_parallel_size + 1)
        os.environ.update(local_cluster_env(args.dashboard))
        os.environ.update(http_front.ingress_env(front))
        ray.init(address="local", include_dashboard=args.dashboard,
                 num_cpus=args.num_cpus or max(os.cpu_count() or 1, need),
                 num_gpus=args.num_gpus, log_to_driver=not quiet)
    else:
        if args.ingress != "auto":
            print(f"pagedserve {command}: --ingress applies to a Ray that pagedserve "
                  "starts; this cluster's own setting is kept", file=sys.stderr)
        ray.init(address=address, log_to_driver=not quiet)
    started_serve = started_ray or not _serve_running()
    serve.start(http_options={"host": args.host, "port": args.port})
    if not started_serve:
        print(f"pagedserve {command}: Serve already runs on this cluster; its HTTP "
              "host/port are kept", file=sys.stderr)
    app = build_app(args)  # again, now that Ray knows the cluster's GPUs (device auto)
    try:
        serve.run(app, name=args.name, route_prefix=args.route_prefix, blocking=False)
        yield f"http://{args.host}:{args.port}{args.route_prefix.rstrip('/')}", front
    finally:
        try:
            for sig in (signal.SIGINT, signal.SIGTERM):  # a second one stops the drain
                signal.signal(sig, signal.default_int_handler)
            _delete_app(args.name, args.drain_timeout_s, args.failover_wait_s)
            if started_serve:
                serve.shutdown()
        except KeyboardInterrupt:
            print(f"pagedserve {command}: stopping at once", file=sys.stderr, flush=True)
        finally:
            node_id = ray.get_runtime_context().get_node_id() if started_ray else None
            ray.shutdown()
            if node_id and front == "haproxy":
                http_front.stop_leftover_haproxy(node_id)


def _delete_app(name: str, drain_timeout_s: float, failover_wait_s: float) -> None:
    """Delete the application, its open requests given ``drain_timeout_s`` to finish
    (``serve.delete`` itself gives up after 60 s, ``serve.shutdown`` after 30)."""
    from ray import serve

    serve.delete(name, _blocking=False)
    # The ingress drains failover_wait_s longer than the engine replicas (see build_app).
    deadline = time.monotonic() + drain_timeout_s + failover_wait_s + 30.0
    while time.monotonic() < deadline:
        app = serve.status().applications.get(name)
        if app is None or app.status == "NOT_STARTED":
            return
        time.sleep(0.1)


def _serve_running() -> bool:
    """Whether this cluster already runs a Serve controller (then we only add our app)."""
    from ray.serve.context import _get_global_client

    return _get_global_client(raise_if_no_controller_running=False) is not None
