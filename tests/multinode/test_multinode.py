"""Serving across nodes: replicas on two worker nodes, a lost node, TP ranks on three nodes.

The expected text is the in-process engine's greedy answer on the same random tiny Llama
(``LLM``, no Ray): whatever node serves a request, it must give that answer.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.multinode.conftest import (
    COMMON,
    LONG,
    PROMPTS,
    WORKER_CPUS,
    Nodes,
    complete_all,
    complete_one,
    replica_nodes,
)
from tests.serving.conftest import App, long_stream

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def two_nodes_app(nodes: Nodes, tiny_model: Path) -> Iterator[App]:
    # Each replica reserves a worker node's two CPUs: one replica per worker node.
    app = nodes.deploy("spread", {**COMMON, "model": str(tiny_model), "num_replicas": 2,
                                  "num_threads": WORKER_CPUS})
    yield app
    nodes.delete("spread")


def _wait(cond: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            v = cond()
        except (openai.APIError, AssertionError, KeyError):
            v = None
        if v:
            return v
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def test_replicas_on_two_worker_nodes_give_the_in_process_answers(
        nodes: Nodes, two_nodes_app: App, expected: dict[str, str]) -> None:
    app = two_nodes_app
    placed = replica_nodes(app)
    workers = {n.node_id for n in nodes.workers}
    assert len(placed) == 2 and set(placed.values()) == workers, (placed, workers)

    assert complete_all(app) == expected
    served = {rid: sum(s["server"]["finished"].values()) for rid, s in app.stats().items()}
    assert all(n > 0 for n in served.values()), served  # both nodes took requests
    app.wait_baseline()


def test_a_lost_nodes_stream_resumes_on_the_other_and_a_new_node_gets_a_replica(
        nodes: Nodes, two_nodes_app: App, expected: dict[str, str]) -> None:
    """The ingress, which holds the client's HTTP stream, is pinned to the head
    (``ingress_on_head``), so whichever worker node serves the stream can be lost: the
    stream goes on from the other node's replica and the client never sees the loss."""
    app = two_nodes_app
    stats = httpx.get(f"{app.base}/v1/stats", timeout=60).json()
    assert stats["ingress"]["node_id"] == nodes.cluster.head_node.node_id
    streams = [_stream_on_a_new_replica(app, [])]
    lost = replica_nodes(app)[streams[0][0]]
    nodes.remove_worker(lost)
    try:
        _check_the_loss_and_a_replacement(nodes, app, expected, lost, streams)
    finally:  # the next tests need two worker nodes, whatever happened here
        while len(nodes.workers) < 2:
            nodes.add_worker()


def _stream_on_a_new_replica(app: App, busy: list[str]
                             ) -> tuple[str, Any, list[BaseException], list[str]]:
    """A long greedy stream and the replica serving it (not one of ``busy``)."""
    texts: list[str] = []
    t, errors = long_stream(app, LONG, texts)
    now = [rid for rid, s in app.stats().items() if s["server"]["in_flight"] > 0]
    new = [rid for rid in now if rid not in busy]
    assert len(new) == 1, (now, busy)
    return new[0], t, errors, texts


def _check_the_loss_and_a_replacement(
        nodes: Nodes, app: App, expected: dict[str, str], lost: str,
        streams: list[tuple[str, Any, list[BaseException], list[str]]]) -> None:
    for _, t, errors, _ in streams:
        t.join(120)
        # The lost node's stream went on from the surviving replica (cluster/resume.py).
        assert not t.is_alive() and not errors, errors
    # The surviving node keeps serving while the lost one is replaced.
    _wait(lambda: complete_one(app, PROMPTS[0]) == expected[PROMPTS[0]], 60,
          "the surviving replica to answer")

    new = nodes.add_worker()
    placed = _wait(lambda: (lambda p: p if len(p) == 2 and new.node_id in p.values()
                            else None)(replica_nodes(app)), 120,
                   "a replacement replica on the new node")
    assert lost not in placed.values()
    assert app.health().status_code == 200
    assert _wait(lambda: complete_all(app) == expected, 60, "every answer from both nodes")
    again: list[str] = []  # the same stream uninterrupted: the resumed one lost nothing
    t, errors = long_stream(app, LONG, again)
    t.join(120)
    assert not errors and again
    for _, _, _, texts in streams:
        assert "".join(texts) == "".join(again)
    app.wait_baseline()
