"""Tensor-parallel ranks on different nodes: gloo between raylets gives the in-process answer.

Its own module, so that the two-replica app of ``test_multinode`` is gone and its
worker nodes' CPUs are free for the ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multinode.conftest import COMMON, Nodes, complete_all, replica_nodes

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_tensor_parallel_ranks_on_three_nodes_give_the_in_process_answers(
        nodes: Nodes, tiny_model: Path, expected: dict[str, str]) -> None:
    import ray
    from ray import serve

    # Bundles [replica, rank 0, rank 1] of one CPU each, one per node (the head has one
    # CPU, each worker node two): the ranks talk gloo between two raylets.
    app = nodes.deploy("tpspread", {**COMMON, "model": str(tiny_model), "num_threads": 1,
                                    "tensor_parallel_size": 2,
                                    "placement_group_strategy": "STRICT_SPREAD"})
    try:
        (replica_node,) = replica_nodes(app).values()
        workers = serve.get_deployment_handle("EngineServer", "tpspread").tp_workers.remote(
        ).result()
        rank_nodes = ray.get([w.__ray_call__.remote(
            lambda self: ray.get_runtime_context().get_node_id()) for w in workers])
        assert len({replica_node, *rank_nodes}) == 3, (replica_node, rank_nodes)
        assert complete_all(app) == expected
        app.wait_baseline()
    finally:
        serve.delete("tpspread")
