"""Replicas replaced or stopped under open requests: a redeploy, a deletion.

A redeploy (Serve's rolling update) replaces an application's ingress and engine
replicas. The old ones finish their open requests for up to ``drain_timeout_s``
(Serve's default of 20 s would cut a longer request off); an engine replica still busy
then is stopped and its requests resume on a new one (the stream from the tokens it
sent, the non-streamed request from its last checkpoint). Deleting the application
drains the same way; past the drain no replacement comes, so an open stream ends with
an error event at once instead of waiting for one.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray

from tests.serving.conftest import Cluster, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PROMPT = "Count slowly and carefully, one number after another, never stopping: " * 3
MAX_TOKENS = 3500


def _requests(base: str, out: dict[str, Any], started: threading.Event) -> list[threading.Thread]:
    """The stream and the non-streamed request, each in a thread; ``started`` is set
    once the stream has sent a few events."""
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=300)
    kw = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": MAX_TOKENS,
          "temperature": 0.0, "extra_body": {"ignore_eos": True}}

    def stream() -> None:
        pieces: list[str] = []
        try:
            for k, ev in enumerate(client.completions.create(stream=True, **kw)):
                pieces.extend(c.text for c in ev.choices)
                if k >= 5:
                    started.set()
            out["stream_end"] = time.monotonic()
        except BaseException as e:  # recorded: the test says what it expected
            out["stream_error"] = e
        finally:
            started.set()
            out["stream"] = "".join(pieces)

    def whole() -> None:
        try:
            r = client.completions.create(**kw)
            out["whole"], out["whole_tokens"] = r.choices[0].text, r.usage.completion_tokens
            out["whole_end"] = time.monotonic()
        except BaseException as e:
            out["whole_error"] = e

    threads = [threading.Thread(target=whole), threading.Thread(target=stream)]
    for t in threads:
        t.start()
    return threads


def _ids(base: str) -> tuple[str, set[str]]:
    st = httpx.get(f"{base}/v1/stats", timeout=60).json()
    return st["ingress"]["replica"], {r["replica"] for r in st["replicas"]}


def _engine_actor_alive(replica_id: str) -> bool:
    return any(a["name"].endswith(f"#EngineServer#{replica_id}")
               for a in ray.util.list_named_actors(all_namespaces=True))


_UNINTERRUPTED: dict[str, Any] = {}


@pytest.mark.parametrize("drain_s", [120.0, 3.0], ids=["drained", "resumed"])
def test_a_redeploy_under_open_requests_loses_none(cluster: Cluster, tiny_model: Path,
                                                   drain_s: float) -> None:
    """One replica of a random tiny Llama; a long greedy stream and a non-streamed request
    open when the application is deployed again with a changed setting. Both end with
    the uninterrupted run's text: finished by the old replicas (a drain longer than
    they take) or, past a 3 s drain, resumed on the new engine replica while the old
    ingress keeps the client's connection (the tiny model takes ~10 s for them)."""
    args = {"model": str(tiny_model), "num_replicas": 1, "num_threads": 1,
            "num_gpu_blocks": 512, "max_model_len": 4096, "checkpoint_interval_ms": 50,
            "drain_timeout_s": drain_s, "health_check_period_s": 1.0}
    app = cluster.deploy("rolling", args)
    try:
        expected = _UNINTERRUPTED  # the same model and settings: one run serves both cases
        if not expected:
            started = threading.Event()
            for t in _requests(app.base, expected, started):
                t.join(120)
        assert "stream_error" not in expected and "whole_error" not in expected, expected
        assert expected["stream"] == expected["whole"] and expected["whole_tokens"] == MAX_TOKENS

        ingress, engines = _ids(app.base)
        got: dict[str, Any] = {}
        started = threading.Event()
        threads = _requests(app.base, got, started)
        assert started.wait(60) and threads[1].is_alive()
        gone: dict[str, float] = {}

        def watch() -> None:  # when the old engine replica's actor is gone
            while _engine_actor_alive(next(iter(engines))):
                time.sleep(0.1)
            gone["at"] = time.monotonic()

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        cluster.deploy("rolling", {**args, "stream_interval_ms": 40.0})  # a new version
        for t in threads:
            t.join(180)
            assert not t.is_alive()
        assert "stream_error" not in got, got["stream_error"]
        assert "whole_error" not in got, got["whole_error"]
        assert got["stream"] == expected["stream"]
        assert (got["whole"], got["whole_tokens"]) == (expected["whole"], MAX_TOKENS)

        new_ingress, new_engines = wait_for(lambda: _ids(app.base), 60, "the new replicas")
        assert new_ingress != ingress and not new_engines & engines
        watcher.join(60)
        assert gone
        if drain_s < 10:  # they outlived the engine replica they started on: resumed
            assert got["stream_end"] > gone["at"] and got["whole_end"] > gone["at"]
        else:  # the old engine replica finished them, then stopped
            assert got["stream_end"] < gone["at"] and got["whole_end"] < gone["at"]
    finally:
        cluster.delete("rolling")


def test_deleting_the_app_past_its_drain_ends_an_open_stream_at_once(cluster: Cluster) -> None:
    """No replacement comes for an engine replica of a deleted application: once its
    3 s drain is over and it stops, its stream ends with an error event instead of
    waiting for one (``FAILOVER_WAIT_S``, 60 s). SmolLM2 decodes slowly enough here
    (tens of ms a token) to outlast the drain."""
    import openai

    from pagedserve.cluster.dispatch import FAILOVER_WAIT_S

    app = cluster.deploy("stopping", {"num_replicas": 1, "num_threads": 1,
                                      "num_gpu_blocks": 192, "max_model_len": 2048,
                                      "drain_timeout_s": 3.0})
    out: dict[str, Any] = {"pieces": 0}
    started = threading.Event()

    def stream() -> None:
        client = openai.OpenAI(base_url=f"{app.base}/v1", api_key="none", max_retries=0,
                               timeout=300)
        try:
            for ev in client.completions.create(
                    model="SmolLM2-135M-Instruct", prompt="Count slowly:", max_tokens=1500,
                    stream=True, temperature=0.0, extra_body={"ignore_eos": True}):
                out["pieces"] += len(ev.choices)
                if out["pieces"] >= 3:
                    started.set()
        except BaseException as e:
            out["error"] = e
        finally:
            out["end"] = time.monotonic()
            started.set()

    t = threading.Thread(target=stream)
    t.start()
    try:
        assert started.wait(120) and t.is_alive()
    finally:
        t0 = time.monotonic()
        cluster.delete("stopping")
        took = time.monotonic() - t0
    t.join(60)
    assert not t.is_alive()
    assert isinstance(out.get("error"), openai.APIError), out
    assert "shutting down" in str(out["error"]), out["error"]
    assert out["end"] - t0 < FAILOVER_WAIT_S / 2 and took < FAILOVER_WAIT_S / 2, (out, took)
