"""Serving fixtures: one Ray + Serve instance for the package, apps deployed into it.

Everything runs on loopback with a free port. The package fixture starts its own local
Ray (``address="local"``, never joining another one on this machine) and ends it with
``serve.shutdown()`` and ``ray.shutdown()``; modules that deploy extra apps delete them.
"""

from __future__ import annotations

import contextlib
import http.server
import os
import random

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

API_KEY = "test-key"
SMOL_ARGS: dict[str, Any] = {"num_gpu_blocks": 192, "max_model_len": 1024, "num_threads": 2,
                             "max_num_seqs": 32, "api_key": API_KEY,
                             "enable_prompt_embeds": True, "logits_processors": [
                                 "pagedserve.worker.testing_logits:TargetTokenProcessor"]}


@contextlib.contextmanager
def loopback_http(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """An HTTP server on 127.0.0.1 (a free port) in a thread, for the block: its base URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def free_port() -> int:
    """A loopback port that binds now, from 20000-29999: below the kernel's ephemeral
    range (32768 up here), where outgoing connections take their local ports and so
    could take this one before the server binds it (HAProxy once failed so), above
    Ray's worker ports (10002-19999) and below Serve's direct-ingress ports (30000 up)."""
    rng = random.Random()  # not the global generator, which hypothesis seeds
    for _ in range(500):
        port = rng.randrange(20000, 30000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free loopback port in 20000-29999")


@dataclass
class App:
    """A deployed application: its base URL and helpers over its HTTP API."""

    name: str
    base: str
    api_key: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def openai(self, **kw: Any) -> Any:
        import openai

        return openai.OpenAI(base_url=f"{self.base}/v1", api_key=self.api_key or "none",
                             max_retries=0, timeout=kw.pop("timeout", 120), **kw)

    def stats(self) -> dict[str, dict[str, Any]]:
        """Engine stats per replica id (every replica must answer)."""
        r = httpx.get(f"{self.base}/v1/stats", headers=self.headers, timeout=60)
        r.raise_for_status()
        out = {}
        for rep in r.json()["replicas"]:
            assert "stats" in rep, rep
            out[rep["replica"]] = rep["stats"]
        return out

    def wait_baseline(self, timeout: float = 20.0) -> dict[str, dict[str, Any]]:
        """Wait until every replica's pool is back at baseline; returns the stats."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if all(at_baseline(s) for s in stats.values()):
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"pool not back at baseline: {stats}")
            time.sleep(0.2)

    def health(self, timeout: float = 60.0) -> httpx.Response:
        return httpx.get(f"{self.base}/health", timeout=timeout)


def wait_for(cond: Callable[[], Any], timeout: float, what: str, period: float = 0.5) -> Any:
    """Poll ``cond`` until it returns something truthy (returned), or fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(period)


def at_baseline(s: dict[str, Any]) -> bool:
    m = s["memory"]
    return (s["num_running"] == 0 and s["num_waiting"] == 0 and s["num_swapped"] == 0
            and m["num_used_blocks"] == 0 and m["num_free_blocks"] == m["num_gpu_blocks"]
            and m["num_shared_blocks"] == 0 and s["server"]["in_flight"] == 0)


# Replicas stop a fifth of a second after their last request, not Serve's 2 s: every
# deletion, redeploy and scale-down in the tests pays that wait.
QUICK_STOP: dict[str, Any] = {"graceful_shutdown_wait_loop_s": 0.2}


@dataclass
class Cluster:
    port: int

    def deploy(self, name: str, args: dict[str, Any]) -> App:
        from ray import serve

        from pagedserve.cluster.serve_app import build_app

        serve.run(build_app({**QUICK_STOP, **args}), name=name, route_prefix=f"/{name}")
        return App(name, f"http://127.0.0.1:{self.port}/{name}", args.get("api_key"))

    def deploy_many(self, specs: dict[str, dict[str, Any]]) -> dict[str, App]:
        """Deploy several applications at once (``serve.run_many``): their replicas start
        side by side, where one ``deploy`` after another waits for each in turn."""
        from ray import serve
        from ray.serve.api import RunTarget

        from pagedserve.cluster.serve_app import build_app

        serve.run_many([RunTarget(build_app({**QUICK_STOP, **args}), name=name,
                                  route_prefix=f"/{name}")
                        for name, args in specs.items()])
        return {name: App(name, f"http://127.0.0.1:{self.port}/{name}", args.get("api_key"))
                for name, args in specs.items()}

    def delete(self, name: str) -> None:
        self.delete_many([name])

    def delete_many(self, names: list[str]) -> None:
        """Delete several applications, their replicas draining side by side (looked at
        every 0.1 s: ``serve.delete`` itself looks once a second)."""
        from ray import serve

        for name in names:
            serve.delete(name, _blocking=False)
        wait_for(lambda: not set(names) & set(serve.status().applications), 300,
                 f"applications {names} deleted", period=0.1)


@pytest.fixture(scope="package")
def cluster() -> Iterator[Cluster]:
    import ray
    from ray import serve

    if ray.is_initialized():  # a driver connection left behind by another package
        ray.shutdown()
    # Logical CPUs: the replicas and TP ranks reserve them; 2 physical cores do the work.
    ray.init(address="local", include_dashboard=False, num_cpus=16, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield Cluster(port)
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="package")
def smol(cluster: Cluster) -> Iterator[App]:
    """The default model (SmolLM2-135M-Instruct), one replica, API key required."""
    app = cluster.deploy("smol", SMOL_ARGS)
    yield app
    cluster.delete("smol")


@pytest.fixture(scope="package")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Llama (4 heads, 2 KV heads: TP=2 divides it) with SmolLM2's tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedserve.worker.loaders import resolve_model

    out = tmp_path_factory.mktemp("models") / "tiny-llama"
    torch.manual_seed(0)
    # A wide init makes logits peaked, so greedy choices are not near-ties between TP layouts.
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=49152,
                      max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=True, initializer_range=0.2)
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    src = Path(resolve_model(None).path)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / f).exists():
            shutil.copy(src / f, out / f)
    return out


def kill_engine_replica(replica_id: str) -> None:
    """``ray.kill`` the engine replica actor ``replica_id`` (Serve replaces it)."""
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].endswith(f"#EngineServer#{replica_id}")]
    assert len(names) == 1, names
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)


def long_stream(app: App, max_tokens: int = 400, texts: list[str] | None = None
                ) -> tuple[threading.Thread, list[BaseException]]:
    """A ``max_tokens`` greedy stream in a thread, returned once its first chunks arrived.

    The list gets the exception the stream ended with (a killed replica or node with no
    other replica to resume on must fail it, not hang it); ``texts`` gets its text
    pieces. The tiny model decodes a token in a few milliseconds, so a test that kills
    something under the stream asks for enough tokens to still be generating when the
    kill lands.
    """
    errors: list[BaseException] = []
    started = threading.Event()

    def run() -> None:
        try:
            for k, ev in enumerate(app.openai().completions.create(
                    model="tiny-llama", prompt="Count slowly:", max_tokens=max_tokens,
                    stream=True, temperature=0, extra_body={"ignore_eos": True})):
                if texts is not None:
                    texts.extend(c.text for c in ev.choices)
                if k == 2:
                    started.set()
                time.sleep(0.02)
        except BaseException as e:  # the stream must fail, not hang
            errors.append(e)
        finally:
            started.set()

    t = threading.Thread(target=run)
    t.start()
    assert started.wait(60)
    return t, errors
