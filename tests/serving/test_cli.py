"""The ``pagedserve`` command as a user runs it: a real process, a real local Ray."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.serving.conftest import free_port

pytestmark = [pytest.mark.ray, pytest.mark.slow]

CLI = [sys.executable, "-m", "pagedserve.cluster.cli"]


def _env() -> dict[str, str]:
    env = dict(os.environ, RAY_AUTH_MODE="disabled", HF_HUB_OFFLINE="1")
    env.pop("RAY_ADDRESS", None)
    return env


def test_generate_prints_the_completion(tiny_model: Path) -> None:
    from pagedserve.cluster import LLM, SamplingParams

    out = subprocess.run([*CLI, "generate", "--model", str(tiny_model), "--raw",
                          "--max-tokens", "8", "--num-gpu-blocks", "32", "Hello world"],
                         capture_output=True, text=True, timeout=300, env=_env())
    assert out.returncode == 0, out.stderr[-2000:]
    llm = LLM(model=str(tiny_model), num_gpu_blocks=32)
    try:
        (ref,) = llm.generate("Hello world", SamplingParams(temperature=0.0, max_tokens=8))
    finally:
        llm.shutdown()
    assert out.stdout.rstrip("\n") == ref.outputs[0].text


def test_generate_rejects_bad_settings() -> None:
    out = subprocess.run([*CLI, "generate", "--temperature", "-3", "hi"], capture_output=True,
                         text=True, timeout=300, env=_env())
    assert out.returncode == 2 and "temperature" in out.stderr


def _start_serve(tiny_model: Path, port: int, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*CLI, "serve", "--model", str(tiny_model), "--port", str(port), "--num-gpu-blocks",
         "32", "--max-model-len", "256", "--num-threads", "1", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())


def _printed_urls(proc: subprocess.Popen[str], kinds: tuple[str, ...]) -> dict[str, str]:
    """The URLs the server prints (``serving``, ``direct ingress``), read until all are seen."""
    assert proc.stdout is not None
    deadline, urls = time.monotonic() + 240, {}
    while time.monotonic() < deadline and len(urls) < len(kinds):
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        for kind in kinds:
            if line.startswith(f"pagedserve: {kind} "):
                urls[kind] = line.split(" at ", 1)[1].split(" ", 1)[0].strip()
    assert set(urls) == set(kinds), urls
    threading_drain(proc)
    return urls


def _terminates(proc: subprocess.Popen[str], url: str) -> None:
    """SIGTERM ends the server cleanly, and ``url`` no longer answers."""
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=90) == 0
    with pytest.raises(httpx.TransportError):
        httpx.get(url, timeout=5)


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


def test_serve_starts_a_local_ray_serves_and_stops_on_sigterm(tiny_model: Path) -> None:
    port = free_port()
    proc = _start_serve(tiny_model, port, "--api-key", "k3y")
    try:
        url = _printed_urls(proc, ("serving",))["serving"]
        assert url == f"http://127.0.0.1:{port}/v1", url
        client = openai.OpenAI(base_url=url, api_key="k3y", max_retries=0, timeout=120)
        r = client.completions.create(model="tiny-llama", prompt="Hi", max_tokens=5)
        assert r.usage.completion_tokens == 5
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=60).status_code == 200
        _terminates(proc, f"http://127.0.0.1:{port}/health")
    finally:
        _stop(proc)


def test_serve_direct_ingress_answers_on_the_replica_port_and_cancels(tiny_model: Path) -> None:
    port = free_port()
    proc = _start_serve(tiny_model, port, "--direct-ingress")
    try:
        urls = _printed_urls(proc, ("serving", "direct ingress"))
        proxied, direct = urls["serving"], urls["direct ingress"]
        assert proxied == f"http://127.0.0.1:{port}/v1" and direct != proxied, urls

        def greedy(base: str, **kw: object) -> str:
            client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=120)
            r = client.completions.create(model="tiny-llama", prompt="The capital of France is",
                                          max_tokens=8, temperature=0, **kw)
            if kw.get("stream"):
                return "".join(c.choices[0].text for c in r if c.choices)
            return r.choices[0].text

        assert greedy(direct) == greedy(proxied) == greedy(direct, stream=True)

        # A client that goes away mid-stream on the replica's port aborts its request.
        with httpx.stream("POST", f"{direct}/completions", timeout=120, json={
                "prompt": "Count:", "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200
            for k, _ in enumerate(r.iter_lines()):
                if k == 3:
                    break

        def at_baseline() -> bool:
            (rep,) = httpx.get(f"{proxied}/stats", timeout=30).json()["replicas"]
            s = rep["stats"]
            return (s["server"]["in_flight"] == 0 and s["memory"]["num_used_blocks"] == 0
                    and s["server"]["finished"].get("abort") == 1)

        deadline = time.monotonic() + 30
        while not at_baseline():
            assert time.monotonic() < deadline, "the disconnected stream was not aborted"
            time.sleep(0.2)
        _terminates(proc, f"{direct}/models")
    finally:
        _stop(proc)


def threading_drain(proc: subprocess.Popen[str]) -> None:
    """Keep reading the server's output so a full pipe never blocks it."""
    import threading

    def drain() -> None:
        assert proc.stdout is not None
        for _ in proc.stdout:
            pass

    threading.Thread(target=drain, daemon=True).start()
