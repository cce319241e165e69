"""A mixture-of-experts model served over HTTP: a random Qwen3-MoE (SmolLM2's tokenizer
and chat template) in an engine replica with two TP ranks (Ray actors, gloo), against
the in-process engine at TP=1 on the same weights."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.worker.loaders import resolve_model
from pagedserve.worker.testing import write_random_checkpoint
from tests.serving.conftest import App, Cluster

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(write_random_checkpoint(
        tmp_path_factory.mktemp("models") / "tiny-qwen3-moe", "qwen3_moe",
        resolve_model(None).path, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=2048))


@pytest.fixture(scope="module")
def moe_app(cluster: Cluster, moe_dir: Path) -> Iterator[App]:
    app = cluster.deploy("moe", {"model": str(moe_dir), "served_model_name": "tiny-moe",
                                 "tensor_parallel_size": 2, "num_gpu_blocks": 64,
                                 "num_threads": 1})
    yield app
    cluster.delete("moe")


def test_moe_chat_over_http_equals_the_offline_engine(moe_app: App, moe_dir: Path) -> None:
    client = moe_app.openai()
    out = client.chat.completions.create(model="tiny-moe", messages=MESSAGES, max_tokens=16,
                                         temperature=0.0, extra_body={"ignore_eos": True})
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="tiny-moe", messages=MESSAGES, max_tokens=16, temperature=0.0,
            stream=True, extra_body={"ignore_eos": True}) if c.choices)
    llm = LLM(model=str(moe_dir), num_gpu_blocks=64)
    try:
        ref = llm.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=16,
                                                ignore_eos=True))[0].outputs[0]
    finally:
        llm.shutdown()
    assert out.usage.completion_tokens == 16 and len(ref.token_ids) == 16 and ref.text
    assert out.choices[0].message.content == ref.text == streamed
    health = moe_app.health()
    assert health.status_code == 200, health.text
    moe_app.wait_baseline()
