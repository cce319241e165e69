"""Rank actors on different nodes (TP ranks over gloo, pipeline stages over the object
store) give the in-process answers.

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
        nodes.delete("tpspread")


def test_pipeline_stages_on_their_own_nodes_give_the_in_process_answers(
        nodes: Nodes, tiny_model: Path, expected: dict[str, str]) -> None:
    """PP=2 spread over the nodes: each stage's hidden states cross between raylets
    through the object store (no process group spans the stages)."""
    import ray
    from ray import serve

    app = nodes.deploy("ppspread", {**COMMON, "model": str(tiny_model), "num_threads": 1,
                                    "pipeline_parallel_size": 2,
                                    "placement_group_strategy": "STRICT_SPREAD"})
    try:
        (replica_node,) = replica_nodes(app).values()
        workers = serve.get_deployment_handle("EngineServer", "ppspread").tp_workers.remote(
        ).result()
        stage_nodes = ray.get([w.__ray_call__.remote(
            lambda self: ray.get_runtime_context().get_node_id()) for w in workers])
        assert len({replica_node, *stage_nodes}) == 3, (replica_node, stage_nodes)
        assert complete_all(app) == expected
        app.wait_baseline()
    finally:
        nodes.delete("ppspread")
