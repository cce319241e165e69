"""Int8 weights behind Serve: ``quantization: int8`` in the app's args reaches the
replica's worker, whose chat answer equals the in-process int8 engine's (both
deterministic on one machine), a completion still says Paris, and ``/v1/stats``
and ``/metrics`` show the smaller weights."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from pagedserve.cluster import LLM, SamplingParams
from tests.serving.conftest import App, Cluster

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def int8_app(cluster: Cluster) -> Iterator[App]:
    app = cluster.deploy("int8", {"quantization": "int8", "num_gpu_blocks": 64,
                                  "num_threads": 1})
    yield app
    cluster.delete("int8")


def test_int8_chat_over_http_equals_the_offline_engine(int8_app: App) -> None:
    client = int8_app.openai()
    out = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MESSAGES,
                                         max_tokens=24, temperature=0.0)
    llm = LLM(quantization="int8", num_gpu_blocks=64)
    try:
        ref = llm.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=24))[0].outputs[0]
        weight_bytes = llm.engine.model_info["weight_bytes"]
    finally:
        llm.shutdown()
    assert out.choices[0].message.content == ref.text and ref.text
    done = client.completions.create(model="SmolLM2-135M-Instruct",
                                     prompt="The capital of France is", max_tokens=4,
                                     temperature=0.0)
    assert done.choices[0].text.startswith(" Paris")
    (stats,) = int8_app.wait_baseline().values()
    assert stats["memory"]["quantization"] == "int8"
    assert stats["memory"]["weight_bytes"] == weight_bytes < 300 * 2**20  # fp32: 621 MiB
    metrics = httpx.get(f"{int8_app.base}/metrics", timeout=60).text
    line = next(x for x in metrics.splitlines()
                if x.startswith("pagedserve_model_weight_bytes{"))
    assert float(line.rsplit(" ", 1)[1]) == weight_bytes
