"""Where engine replicas run and what they reserve: CPU threads, Ray resources, runtime env.

A CPU engine rank computes on as many cores as it has torch threads, so it
reserves that many Ray CPUs; otherwise Ray both packs other work onto those
cores and caps the rank's OpenMP pool at its ``num_cpus`` (one, by default)
through OMP_NUM_THREADS.
"""

from __future__ import annotations

import os
from typing import Any


def cpu_threads_per_rank(num_replicas: int, ranks: int) -> int:
    """Default torch threads per CPU rank: a node's cores shared by every rank.

    Ray's CPU count is what the operator declared; on a one-node cluster it is
    capped by this machine's cores, since tests and the CLI declare extra
    logical CPUs so that placement groups fit on small machines. With more than
    one rank per replica (TP x PP), each replica's scheduler bundle keeps one CPU
    of its own.
    """
    import ray

    cores = os.cpu_count() or 1
    if ray.is_initialized():
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        declared = max((int(n["Resources"].get("CPU", 0)) for n in nodes), default=0)
        if declared:
            cores = min(declared, cores) if len(nodes) == 1 else declared
    reserved = num_replicas if ranks > 1 else 0
    return max(1, (cores - reserved) // max(1, num_replicas * ranks))


STREAM_MESSAGES_PER_CORE = 25.0


def stream_message_budget(configured: float | None) -> float:
    """Streamed messages per second one engine replica may send (0: no budget).

    Unset: 25 a second per core of this node. At one to two milliseconds of
    CPU per message across replica, ingress, proxy and client (about 2 ms
    measured on a 2-core node), that keeps the serving stack's share of the
    node's CPU within about 5% however many streams are open, so on a CPU node
    it cannot starve the forward it shares cores with.
    """
    if configured is not None:
        if configured < 0:
            raise ValueError(f"stream_messages_per_s must be >= 0, got {configured}")
        return float(configured)
    return STREAM_MESSAGES_PER_CORE * (os.cpu_count() or 1)


def replica_runtime_env() -> dict[str, Any]:
    """Run our replicas' code, and their handles' routers, on Serve's own event loop.

    Both deployments are async and keep their loop free (the forward runs in
    a worker thread). A second thread for user code, or a separate loop for
    the ingress's handle router, only adds a cross-thread hop and GIL traffic
    to every streamed message: the user-code thread cost about 10% of a
    32-stream burst's decode time here. An operator's own setting of either
    variable wins.
    """
    keys = ("RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP")
    return {"env_vars": {k: os.environ.get(k, "0") for k in keys}}


# Ray gives the head node this resource (1.0); asking for a sliver of it pins an actor there.
HEAD_NODE_RESOURCE = "node:__internal_head__"


def ingress_actor_options(on_head: bool) -> dict[str, Any]:
    """The ingress replicas' actor options: no CPU of their own, on the head when
    ``on_head``.

    The ingress holds each client's HTTP connection: failover moves a request off a
    dead engine replica, but a stream whose ingress dies ends with a broken connection.
    The head is the one node whose loss ends the cluster anyway (and where Serve's
    HTTP proxy listens in a ``ray up`` cluster), so with the ingress there, losing any
    worker node never breaks a client's connection.
    """
    opts: dict[str, Any] = {"num_cpus": 0, "runtime_env": replica_runtime_env()}
    if on_head:
        opts["resources"] = {HEAD_NODE_RESOURCE: 0.001}
    return opts


def local_cluster_env(dashboard: bool = False) -> dict[str, str]:
    """Environment for a Ray cluster that ``pagedserve`` starts itself (set before ``ray.init``).

    An idle one-node Serve app woke its threads about 1,730 times a second
    and took 0.09 of a core here, most of it Serve's controller loop (10 Hz)
    and metrics export (10 Hz per actor). On a CPU node that time comes out
    of the forward: every wakeup preempts one of its OpenMP threads and the
    other waits at the next barrier. These settings brought the idle app to
    about 1,160 wakeups and 0.05 of a core, and a 32-stream burst served
    4-7% faster in alternating runs. Ray's log monitor globs the log directory
    for new files on every 100 ms poll while there are fewer than
    ``RAY_LOG_MONITOR_MANY_FILES_THRESHOLD`` of them, and every 0.5 s above it;
    a threshold of 0 keeps it to the 0.5 s rescan (new log files found within
    0.5 s), which took it from 0.77% to 0.40% of a core in an idle app. Ray's
    own metrics stay on when the dashboard is asked for; whatever the operator
    already set wins.
    """
    env = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1",
           "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
           "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0"}
    if not dashboard:
        env["RAY_enable_metrics_collection"] = "0"
    return {k: os.environ.get(k, v) for k, v in env.items()}


def engine_replica_options(gpu: bool, threads: int | None, ranks: int,
                           replica_num_cpus: float | None, strategy: str) -> dict[str, Any]:
    """Serve deployment options placing one engine replica and its rank actors.

    One rank (TP = PP = 1): the replica runs the forward itself and reserves the
    rank's resources. More (TP x PP): a placement group with the replica's own
    bundle (its scheduler) plus one bundle per rank actor.
    """
    rank_cpus = 1.0 if gpu else float(threads or 1)
    env = replica_runtime_env()
    if ranks > 1:
        replica_cpus = replica_num_cpus if replica_num_cpus is not None else 1.0
        rank = {"CPU": rank_cpus, "GPU": 1.0} if gpu else {"CPU": rank_cpus}
        bundles = [{"CPU": replica_cpus}] + [dict(rank) for _ in range(ranks)]
        return {"placement_group_bundles": bundles, "placement_group_strategy": strategy,
                "ray_actor_options": {"num_cpus": replica_cpus, "runtime_env": env}}
    replica_cpus = replica_num_cpus if replica_num_cpus is not None else rank_cpus
    return {"ray_actor_options": {"num_cpus": replica_cpus, "num_gpus": 1 if gpu else 0,
                                  "runtime_env": env}}
