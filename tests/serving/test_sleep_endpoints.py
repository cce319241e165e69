"""Sleep mode and new weights over HTTP (vLLM's ``/sleep``, ``/wake_up``, ``/is_sleeping``,
``/reset_prefix_cache``; SGLang's ``/update_weights_from_disk``): an asleep replica answers
503 and stays healthy, wakes to the same answers, drains a running stream before it
sleeps, and serves another checkpoint's exact answers after an update."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.serving.conftest import App, Cluster, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
KEY = "admin-key"


@pytest.fixture(scope="module")
def other_model(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    """``tiny_model``'s architecture and tokenizer, other weights (an RLHF step's)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("models") / "tiny-llama-step"
    torch.manual_seed(1)
    cfg = LlamaConfig.from_pretrained(tiny_model)
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    for f in tiny_model.iterdir():
        if f.name.startswith(("tokenizer", "chat_template")):
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def app(cluster: Cluster, tiny_model: Path) -> Iterator[App]:
    app = cluster.deploy("sleepy", {"model": str(tiny_model), "num_gpu_blocks": 128,
                                    "num_threads": 1, "api_key": KEY})
    yield app
    cluster.delete("sleepy")


def offline_answers(model: Path) -> list[str]:
    from pagedserve.cluster import LLM, SamplingParams

    llm = LLM(model=str(model), num_gpu_blocks=64)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8),
                            use_tqdm=False)
        return [o.outputs[0].text for o in outs]
    finally:
        llm.shutdown()


def answers(app: App) -> list[str]:
    client = app.openai()
    return [client.completions.create(model="tiny-llama", prompt=p, max_tokens=8,
                                      temperature=0).choices[0].text for p in PROMPTS]


def post(app: App, path: str, **kw) -> httpx.Response:
    return httpx.post(f"{app.base}{path}", headers=app.headers, timeout=300, **kw)


def test_asleep_answers_503_stays_healthy_and_wakes_to_the_same_answers(
        app: App, tiny_model: Path) -> None:
    before = answers(app)
    assert before == offline_answers(tiny_model)
    assert httpx.post(f"{app.base}/sleep").status_code == 401  # the API key is required
    r = post(app, "/sleep", params={"level": 2})
    assert r.status_code == 200 and r.json()["success"], r.text
    state = httpx.get(f"{app.base}/is_sleeping", headers=app.headers, timeout=60).json()
    assert state["is_sleeping"] and state["replicas"][0]["result"]["sleep_level"] == 2
    with pytest.raises(openai.APIStatusError) as e:
        answers(app)
    assert e.value.status_code == 503 and "asleep" in str(e.value)
    assert app.health().status_code == 200  # asleep on purpose is healthy
    again = post(app, "/sleep", params={"level": 1})
    assert again.status_code == 400 and "already asleep" in again.json()["error"]["message"]
    assert post(app, "/sleep", params={"level": 3}).status_code == 400
    assert post(app, "/wake_up").status_code == 200
    assert answers(app) == before
    assert not httpx.get(f"{app.base}/is_sleeping", headers=app.headers,
                         timeout=60).json()["is_sleeping"]
    app.wait_baseline()


def test_sleep_drains_a_running_stream_first(app: App) -> None:
    chunks: list[object] = []

    def stream() -> None:
        chunks.extend(app.openai().completions.create(
            model="tiny-llama", prompt="Count:", max_tokens=300, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))

    t = threading.Thread(target=stream)
    t.start()
    try:
        wait_for(lambda: chunks or not t.is_alive(), 60, "the stream to start", 0.02)
        r = post(app, "/sleep", params={"level": 1, "drain_timeout_s": 120})
        assert r.status_code == 200, r.text
        t.join(60)
        assert not t.is_alive()
        # The stream got every token before the engine slept.
        assert chunks[-1].usage.completion_tokens == 300
    finally:
        assert post(app, "/wake_up").status_code == 200
    app.wait_baseline()


def test_new_weights_from_disk_give_that_checkpoints_answers(
        app: App, tiny_model: Path, other_model: Path) -> None:
    want = offline_answers(other_model)
    assert want != offline_answers(tiny_model)
    r = post(app, "/update_weights_from_disk", json={"model_path": str(other_model)})
    assert r.status_code == 200, r.text
    assert r.json()["replicas"][0]["result"]["model_path"] == str(other_model)
    assert answers(app) == want
    bad = post(app, "/update_weights_from_disk", json={"model_path": "/no/such/model"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "update_weights"
    assert answers(app) == want  # a failed update changes nothing
    r = post(app, "/update_weights_from_disk", json={"model_path": str(tiny_model)})
    assert r.status_code == 200
    assert answers(app) == offline_answers(tiny_model)
    r = post(app, "/reset_prefix_cache")
    assert r.status_code == 200 and r.json()["replicas"][0]["result"]["ok"]
    app.wait_baseline()
