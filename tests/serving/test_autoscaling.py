"""Engine replicas scale with load (Serve's ``autoscaling_config``) and lose nothing.

One replica at rest; a standing load of six concurrent streams pushes the ongoing
requests past the target, Serve starts a second replica, the router sends new requests to it
(least loaded), and every stream, old and new, finishes with all its tokens.
When the load is gone the app scales back to one replica, whose pool is at its
baseline. With ``min_replicas: 0`` the app starts with no engine replica, the
first request starts one and is answered, and after the downscale delay the app
is back to none and healthy (waking from there is the same path as the first
wake: the app starts with none).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.serving.conftest import App, Cluster, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct"
LOAD_TOKENS = 120
AUTOSCALING = {"min_replicas": 1, "max_replicas": 2, "initial_replicas": 1,
               "target_ongoing_requests": 2, "upscale_delay_s": 0.0,
               "downscale_delay_s": 5.0, "look_back_period_s": 1.0, "metrics_interval_s": 0.5}


@pytest.fixture(scope="module")
def scaled(cluster: Cluster) -> Iterator[App]:
    app = cluster.deploy("scaled", {"autoscaling_config": AUTOSCALING, "num_gpu_blocks": 512,
                                    "max_model_len": 1024, "num_threads": 1})
    yield app
    cluster.delete("scaled")


def _replicas(app: App) -> tuple[int, int]:
    """(replicas the ingress knows, those that answer a stats call): one starting or
    stopping may be listed without answering."""
    r = httpx.get(f"{app.base}/v1/stats", headers=app.headers, timeout=60)
    r.raise_for_status()
    reps = r.json()["replicas"]
    return len(reps), sum("stats" in rep for rep in reps)


def _stream(app: App, i: int, max_tokens: int) -> int:
    """Stream one completion; the number of tokens it delivered."""
    n, finish = 0, None
    for chunk in app.openai().completions.create(
            model=MODEL, prompt=f"Story {i}: once upon a time", max_tokens=max_tokens,
            temperature=0.8, seed=i, stream=True, extra_body={"ignore_eos": True},
            stream_options={"include_usage": True}):
        if chunk.choices:
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            n = chunk.usage.completion_tokens
    assert finish == "length", finish
    return n


def _keep_loading(app: App, slot: int, stop: threading.Event) -> list[int]:
    """Stream LOAD_TOKENS-token completions back to back until ``stop``: the tokens each
    delivered. A standing load ends one short stream after ``stop``, where one long
    stream had to outlast an unknown replica start (over 25 s in a CI run: loading the
    model on the cores the first replica decodes on) and then ran on to its end."""
    counts: list[int] = []
    while not stop.is_set():
        counts.append(_stream(app, 1000 * slot + len(counts), LOAD_TOKENS))
    return counts


def test_replicas_scale_up_under_load_and_back_down(scaled: App) -> None:
    assert len(scaled.stats()) == 1
    stop = threading.Event()
    with ThreadPoolExecutor(12) as pool:
        load = [pool.submit(_keep_loading, scaled, i, stop) for i in range(6)]
        try:
            wait_for(lambda: _replicas(scaled)[1] == 2, 120, "a second replica")
            second = [pool.submit(_stream, scaled, 100 + i, 40) for i in range(4)]
            assert [f.result(timeout=300) for f in second] == [40] * 4
        finally:
            stop.set()
        counts = [f.result(timeout=300) for f in load]
    assert all(counts) and {n for c in counts for n in c} == {LOAD_TOKENS}, counts
    stats = scaled.stats()
    served = {r: s["finished_requests"] for r, s in stats.items()}
    # The replica started for the load served some of the requests sent after it came
    # (read before the 5 s downscale delay has passed).
    assert len(served) == 2 and min(served.values()) > 0, served
    wait_for(lambda: _replicas(scaled) == (1, 1), 120, "scaling back to one replica")
    scaled.wait_baseline()


ZERO = {"min_replicas": 0, "max_replicas": 1, "initial_replicas": 0,
        "target_ongoing_requests": 2, "upscale_delay_s": 0.0, "downscale_delay_s": 2.0,
        "look_back_period_s": 1.0, "metrics_interval_s": 0.5}


def _engine_replicas(name: str) -> int:
    from ray import serve

    states = serve.status().applications[name].deployments["EngineServer"].replica_states
    return sum(states.values())


def test_scale_to_zero_wakes_for_a_request_and_idles_back(cluster: Cluster) -> None:
    app = cluster.deploy("zero", {"autoscaling_config": ZERO, "num_gpu_blocks": 128,
                                  "max_model_len": 512, "num_threads": 1})
    try:
        assert _engine_replicas("zero") == 0
        health = app.health()
        assert health.status_code == 200 and health.json()["scaled_to_zero"], health.text
        assert app.stats() == {}  # stats do not wake a replica
        assert _engine_replicas("zero") == 0
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        out = app.openai().chat.completions.create(
            model=MODEL, messages=messages, max_tokens=20, temperature=0.0)
        assert out.choices[0].message.content == "The capital of France is Paris."
        assert _engine_replicas("zero") == 1
        assert app.health().json()["status"] == "ok"
        wait_for(lambda: _engine_replicas("zero") == 0, 90, "scaling to zero")
        health = app.health()
        assert health.status_code == 200 and health.json()["replicas"] == []
        assert health.json()["scaled_to_zero"], health.text
    finally:
        cluster.delete("zero")
