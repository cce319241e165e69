"""A Ray cluster of three nodes on this machine, the way ``ray up`` builds one on three.

``ray.cluster_utils.Cluster`` starts a head and two worker nodes, each with its own
raylet, object store and worker processes, as ``ray start`` does on separate machines.
Only the addresses are shared (loopback), so what crosses nodes here (object
transfers, actor calls between raylets, placement groups over several nodes, gloo
between ranks on different raylets, a node's death) is the same as on a real cluster.

The head has one CPU: Serve's controller, proxy and ingress (0 CPUs each) and a
replica's own placement-group bundle fit there, a two-thread engine replica does not.
Each worker node has two CPUs. Node loss is detected within seconds (the GCS checks
raylets every second and gives up after three misses).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.serving.conftest import App, Cluster, free_port, tiny_model  # noqa: F401  (fixture)

WORKER_CPUS = 2
PROMPTS = ["The capital of France is", "1, 2, 3,", "def fibonacci(n):", "Hello",
           "Once upon a time", "The quick brown fox", "import numpy as np", "Dear Sir,"]
# Room for ``long_stream(app, LONG)``: 4000 tokens take the tiny model 5 s or more
# (1.3 ms a token in-process on the 2-core box; 400 took 0.5 s, and a lost node
# sometimes came too late to fail the stream).
LONG = 4000
COMMON = {"num_gpu_blocks": 320, "max_model_len": 4096, "health_check_period_s": 1.0,
          "health_check_timeout_s": 10.0}
MAX_TOKENS = 12


@pytest.fixture(scope="package")
def expected(tiny_model: Path) -> dict[str, str]:  # noqa: F811  (the fixture)
    from pagedserve.cluster import LLM, SamplingParams

    llm = LLM(model=str(tiny_model), num_gpu_blocks=64)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                            use_tqdm=False)
        return {p: o.outputs[0].text for p, o in zip(PROMPTS, outs)}
    finally:
        llm.shutdown()


def complete_one(app: App, prompt: str) -> str:
    """One greedy completion of ``prompt``."""
    r = app.openai().completions.create(model="tiny-llama", prompt=prompt,
                                        max_tokens=MAX_TOKENS, temperature=0)
    return r.choices[0].text


def complete_all(app: App) -> dict[str, str]:
    """Every prompt at once (so several replicas get some), answer by prompt."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return dict(zip(PROMPTS, pool.map(lambda p: complete_one(app, p), PROMPTS)))


def replica_nodes(app: App) -> dict[str, str]:
    """The node id of each engine replica, from its stats."""
    return {rid: s["node_id"] for rid, s in app.stats().items()}


@dataclass
class Nodes:
    """The running cluster, its worker nodes (``ray._private.node.Node``) and Serve's port."""

    cluster: Any
    port: int
    workers: list[Any] = field(default_factory=list)

    def add_worker(self) -> Any:
        node = self.cluster.add_node(num_cpus=WORKER_CPUS)
        self.workers.append(node)
        return node

    def remove_worker(self, node_id: str) -> None:
        (node,) = [n for n in self.workers if n.node_id == node_id]
        self.cluster.remove_node(node, allow_graceful=False)
        self.workers.remove(node)

    def deploy(self, name: str, args: dict[str, Any]) -> App:
        return Cluster(self.port).deploy(name, args)

    def delete(self, name: str) -> None:
        Cluster(self.port).delete(name)


@pytest.fixture(scope="package")
def nodes() -> Iterator[Nodes]:
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster as RayCluster

    if ray.is_initialized():  # a driver connection left behind by another package
        ray.shutdown()
    cluster = RayCluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False,
        "_system_config": {"health_check_period_ms": 1000,
                           "health_check_failure_threshold": 3}})
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        out = Nodes(cluster, free_port())
        for _ in range(2):
            out.add_worker()
        cluster.wait_for_nodes()
        # One proxy, on the head: proxies on every node would all bind this port here.
        serve.start(http_options={"host": "127.0.0.1", "port": out.port,
                                  "location": "HeadOnly"})
        yield out
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
