"""Chaos for background responses: the engine replica generating two of them (one
polled, one streamed whose client left) is killed; both resume on the other replica
and end with exactly the uninterrupted greedy answer, the streamed one's events
still consecutive and adding up to it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.serving.conftest import App, Cluster, kill_engine_replica, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow]

INPUT = "Count slowly and carefully, one number after another, never stopping: " * 3
TOKENS = 1200


@pytest.fixture(scope="module")
def pair(cluster: Cluster, tiny_model: Path) -> Iterator[App]:
    app = cluster.deploy("respfail", {
        "model": str(tiny_model), "num_replicas": 2, "num_threads": 1,
        "num_gpu_blocks": 512, "max_model_len": 4096, "checkpoint_interval_ms": 50,
        "health_check_period_s": 1.0, "health_check_timeout_s": 10.0,
        "enable_responses_store": True})
    yield app
    cluster.delete("respfail")


def test_background_responses_survive_their_engine_replica(pair: App) -> None:
    client = pair.openai()
    kw = dict(model="tiny-llama", input=INPUT, temperature=0, max_output_tokens=TOKENS,
              extra_body={"ignore_eos": True})
    expected = client.responses.create(**kw).output_text
    pair.wait_baseline()
    polled = client.responses.create(background=True, **kw).id
    with client.responses.create(background=True, stream=True, **kw) as events:
        streamed = next(iter(events)).response.id  # the client leaves
    wait_for(lambda: all(client.responses.retrieve(r).status == "in_progress"
                         for r in (polled, streamed)), 60, "both to start")
    busy = [rid for rid, s in pair.stats().items() if s["server"]["in_flight"] > 0]
    assert len(busy) == 1, busy  # one prefix: one replica
    kill_engine_replica(busy[0])
    for rid in (polled, streamed):
        done = wait_for(lambda rid=rid: (r := client.responses.retrieve(rid)).status
                        != "in_progress" and r, 180, f"{rid} to end")
        assert done.status == "incomplete", done.error  # cut by max_output_tokens
        assert done.output_text == expected and done.usage.output_tokens == TOKENS
    every = list(client.responses.retrieve(streamed, stream=True))
    assert [e.sequence_number for e in every] == list(range(len(every)))
    assert "".join(e.delta for e in every if e.type == "response.output_text.delta") \
        == expected
    metrics = httpx.get(f"{pair.base}/metrics", timeout=30).text
    assert 'pagedserve_request_failovers_total{kind="resume"} 2.0' in metrics, [
        line for line in metrics.splitlines() if "failover" in line]
