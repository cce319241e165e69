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


def test_serve_starts_a_local_ray_serves_and_stops_on_sigterm(tiny_model: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [*CLI, "serve", "--model", str(tiny_model), "--port", str(port), "--num-gpu-blocks",
         "32", "--max-model-len", "256", "--num-threads", "1", "--api-key", "k3y"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
    try:
        assert proc.stdout is not None
        deadline, url = time.monotonic() + 240, None
        while time.monotonic() < deadline and url is None:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            if line.startswith("pagedserve: serving"):
                url = line.split(" at ", 1)[1].split(" ", 1)[0]
        assert url == f"http://127.0.0.1:{port}/v1", url
        threading_drain(proc)
        client = openai.OpenAI(base_url=url, api_key="k3y", max_retries=0, timeout=120)
        r = client.completions.create(model="tiny-llama", prompt="Hi", max_tokens=5)
        assert r.usage.completion_tokens == 5
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=60).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def threading_drain(proc: subprocess.Popen[str]) -> None:
    """Keep reading the server's output so a full pipe never blocks it."""
    import threading

    def drain() -> None:
        assert proc.stdout is not None
        for _ in proc.stdout:
            pass

    threading.Thread(target=drain, daemon=True).start()
