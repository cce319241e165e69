"""Disaggregated prefill behind Serve: a ``PrefillServer`` replica computes the prompts,
the ``EngineServer`` replica imports their K/V and decodes. Answers equal the offline
engine's; a prefill replica killed mid-call or a client gone mid-prefill loses nothing
and leaks no block on either side."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.cluster.disagg import PREFILL_DEPLOYMENT
from tests.serving.conftest import App, Cluster, at_baseline, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct"
ARGS: dict[str, Any] = {"num_gpu_blocks": 192, "max_model_len": 2048, "num_threads": 1,
                        "max_num_seqs": 16, "prefill_replicas": 1,
                        "remote_prefill_min_tokens": 16, "remote_prefill_timeout_s": 60}
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg, a goldsmith from Mainz, combined movable metal type with an oil-based ink "
    "and a screw press, and",
    "Here is a list of ten fruits, each with its colour and the season it is "
    "harvested in, written as a table with three columns:",
    "def merge_sort(values):\n    \"\"\"Sort a list of numbers with merge sort and return "
    "a new list; the input is left unchanged.\"\"\"\n",
]


@pytest.fixture(scope="module")
def pd(cluster: Cluster) -> Iterator[App]:
    app = cluster.deploy("pd", ARGS)
    yield app
    cluster.delete("pd")


@pytest.fixture(scope="module")
def offline() -> Iterator[LLM]:
    llm = LLM(num_gpu_blocks=192, num_threads=1)
    yield llm
    llm.shutdown()


def full_stats(app: App) -> dict[str, Any]:
    r = httpx.get(f"{app.base}/v1/stats", headers=app.headers, timeout=60)
    r.raise_for_status()
    return r.json()


def decode_and_prefill(app: App) -> tuple[dict[str, Any], dict[str, Any]]:
    body = full_stats(app)
    (decode,) = body["replicas"]
    (prefill,) = body["prefill_replicas"]
    return decode["stats"], prefill["stats"]


def both_at_baseline(app: App) -> bool:
    decode, prefill = decode_and_prefill(app)
    return at_baseline(decode) and at_baseline(prefill)


def test_answers_equal_the_offline_engine_and_the_prompts_were_shipped(
        pd: App, offline: LLM) -> None:
    client = pd.openai()
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    for prompt in PROMPTS:
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                        temperature=0.0)
        ref = offline.generate([prompt], greedy)[0]
        assert out.choices[0].text == ref.outputs[0].text
        # The decode replica computed only the prompt's last partial block.
        n = len(ref.prompt_token_ids)
        assert out.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20,
                                          temperature=0.0)
    assert chat.choices[0].message.content == "The capital of France is Paris."
    seeded = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, n=2,
                                       temperature=0.9, seed=5)
    ref = offline.generate([PROMPTS[1]], SamplingParams(n=2, temperature=0.9, seed=5,
                                                        max_tokens=12))[0]
    assert sorted(c.text for c in seeded.choices) == sorted(c.text for c in ref.outputs)
    wait_for(lambda: both_at_baseline(pd), 30, "both pools at baseline")
    decode, prefill = decode_and_prefill(pd)
    remote = decode["remote_prefill"]
    # Every prompt but the seeded repeat, whose blocks the decode replica already held.
    assert (remote["remote_prefills"], remote["skipped"], remote["failures"]) == (4, 1, 0)
    assert decode["kv_imported_blocks"] == remote["imported_blocks"] > 0
    assert remote["received_bytes"] > 0
    assert prefill["kv_exported_blocks"] >= decode["kv_imported_blocks"]
    assert "remote_prefill" not in prefill  # a prefill replica sends nothing further


def test_short_and_already_cached_prompts_stay_on_the_decode_replica(pd: App) -> None:
    client = pd.openai()
    before, _ = decode_and_prefill(pd)
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0.0)
    prompt = "Question: " + PROMPTS[0]
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0.0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4,
                                      temperature=0.0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    after, _ = decode_and_prefill(pd)
    b, a = before["remote_prefill"], after["remote_prefill"]
    assert a["skipped"] - b["skipped"] == 2  # "Hi", then the repeat: a local hit
    assert a["remote_prefills"] - b["remote_prefills"] == 1


def test_a_client_gone_mid_prefill_frees_both_pools(pd: App) -> None:
    prompt = " ".join(f"item {i} costs {3 * i + 1} euros;" for i in range(150))
    with pytest.raises(httpx.ReadTimeout):  # the client hangs up while the prompt runs
        httpx.post(f"{pd.base}/v1/completions", headers=pd.headers, timeout=0.5,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 64})
    wait_for(lambda: both_at_baseline(pd), 60, "both pools at baseline")


def test_a_prefill_replica_killed_mid_call_costs_time_not_the_answer(
        pd: App, offline: LLM) -> None:
    import ray
    from ray import serve

    prompt = " ".join(f"row {i}: {i * i} squared;" for i in range(120))
    ref = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8))[0]
    before, _ = decode_and_prefill(pd)
    prefill_handle = serve.get_deployment_handle(PREFILL_DEPLOYMENT, "pd")
    answers: list[Any] = []

    def ask() -> None:
        answers.append(pd.openai().completions.create(model=MODEL, prompt=prompt,
                                                      max_tokens=8, temperature=0.0))

    t = threading.Thread(target=ask)
    t.start()
    wait_for(lambda: prefill_handle.stats.remote().result()["server"]["in_flight"] > 0,
             60, "the prefill replica to be running the prompt")
    (name,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
               if a["name"].startswith(f"SERVE_REPLICA::pd#{PREFILL_DEPLOYMENT}#")]
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    t.join(120)
    assert not t.is_alive() and answers
    assert answers[0].choices[0].text == ref.outputs[0].text
    after, _ = decode_and_prefill_when_up(pd)
    assert after["remote_prefill"]["failures"] - before["remote_prefill"]["failures"] == 1
    assert at_baseline(after)
    # Serve replaces the prefill replica, and prompts go to it again.
    client = pd.openai()

    def shipped_again() -> bool:
        n = decode_and_prefill_when_up(pd)[0]["remote_prefill"]["remote_prefills"]
        client.completions.create(model=MODEL, prompt=PROMPTS[2] + f" # {time.time()}",
                                  max_tokens=2, temperature=0.0)
        return decode_and_prefill_when_up(pd)[0]["remote_prefill"]["remote_prefills"] > n

    wait_for(shipped_again, 120, "a replacement prefill replica taking prompts")
    wait_for(lambda: both_at_baseline(pd), 30, "both pools at baseline")


def decode_and_prefill_when_up(app: App) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The decode replica's stats, and the prefill replica's if one answers now."""
    body = full_stats(app)
    (decode,) = body["replicas"]
    prefill = [p["stats"] for p in body.get("prefill_replicas", []) if "stats" in p]
    return decode["stats"], (prefill[0] if prefill else None)


def test_admin_calls_reach_the_prefill_pool_too(pd: App) -> None:
    state = httpx.get(f"{pd.base}/is_sleeping", headers=pd.headers, timeout=60).json()
    assert not state["is_sleeping"] and len(state["replicas"]) == 2
    r = httpx.post(f"{pd.base}/reset_prefix_cache", headers=pd.headers, timeout=60)
    assert r.status_code == 200 and len(r.json()["replicas"]) == 2


def test_a_hybrid_models_prompts_ship_by_group(cluster: Cluster,
                                              tmp_path_factory: pytest.TempPathFactory) -> None:
    """A random Gemma 3 (five sliding layers over 16 tokens, one full) behind a prefill
    replica, both with KV cache groups: the decode replica hits the whole shipped prompt
    (the full group's blocks and each sliding group's window) and answers as the
    offline engine."""
    from pagedserve.worker.loaders import resolve_model
    from pagedserve.worker.testing import write_random_checkpoint

    path = write_random_checkpoint(
        tmp_path_factory.mktemp("models") / "tiny-gemma3", "gemma3_text",
        resolve_model(None).path, num_hidden_layers=6, head_dim=16,
        query_pre_attn_scalar=24, sliding_window=16,
        layer_types=["sliding_attention"] * 5 + ["full_attention"])
    args = {**ARGS, "model": str(path), "served_model_name": "tiny-gemma3"}
    app = cluster.deploy("pd-hybrid", args)
    try:
        out = app.openai().completions.create(
            model="tiny-gemma3", prompt=PROMPTS[0], max_tokens=12, temperature=0.0,
            extra_body={"ignore_eos": True})
        llm = LLM(model=str(path), num_gpu_blocks=192)
        try:
            ref = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=12,
                                                             ignore_eos=True))[0]
        finally:
            llm.shutdown()
        assert out.choices[0].text == ref.outputs[0].text
        n = len(ref.prompt_token_ids)
        assert out.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
        wait_for(lambda: both_at_baseline(app), 30, "both pools at baseline")
        decode, prefill = decode_and_prefill(app)
        k = (n - 1) // 16
        assert decode["kv_imported_blocks"] == k + 5 * min(k, 1)  # (window 16: one block)
        assert prefill["kv_exported_blocks"] == decode["kv_imported_blocks"]
    finally:
        cluster.delete("pd-hybrid")


def test_image_prompts_ship_from_the_prefill_pool(cluster: Cluster,
                                                  tmp_path_factory: pytest.TempPathFactory
                                                  ) -> None:
    """A random multimodal Gemma 3 behind a prefill replica: a chat with an image part is
    prefilled there (its encoder runs there), its blocks named by the picture too, and
    the decode replica hits the prompt's full blocks and answers as the offline engine;
    the same text with another picture is prefilled again, not mistaken for a hit."""
    import base64
    import io

    from pagedserve.worker.testing import random_picture, write_random_gemma3_multimodal

    path = write_random_gemma3_multimodal(tmp_path_factory.mktemp("models") / "mm")

    def chat(seed: int) -> list[dict[str, Any]]:
        buf = io.BytesIO()
        random_picture(seed).save(buf, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        return [{"role": "user", "content": [
            {"type": "text", "text": "t5 t6"},
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "t7"}]}]

    args = {**ARGS, "model": str(path), "served_model_name": "tiny-mm",
            "remote_prefill_min_tokens": 8}
    app = cluster.deploy("pd-images", args)
    try:
        kw = dict(model="tiny-mm", max_tokens=8, temperature=0.0,
                  extra_body={"ignore_eos": True})
        outs = [app.openai().chat.completions.create(messages=chat(s), **kw) for s in (11, 12)]
        llm = LLM(model=str(path), num_gpu_blocks=192)
        try:
            refs = [llm.chat(chat(s), SamplingParams(temperature=0.0, max_tokens=8,
                                                     ignore_eos=True))[0] for s in (11, 12)]
        finally:
            llm.shutdown()
        assert refs[0].outputs[0].text != refs[1].outputs[0].text  # the picture decides
        for out, ref in zip(outs, refs):
            assert out.choices[0].message.content == ref.outputs[0].text
            n = len(ref.prompt_token_ids)
            assert out.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16 > 0
        wait_for(lambda: both_at_baseline(app), 30, "both pools at baseline")
        decode, prefill = decode_and_prefill(app)
        assert decode["remote_prefill"]["remote_prefills"] == 2
        assert prefill["kv_exported_blocks"] == decode["kv_imported_blocks"] > 0
    finally:
        cluster.delete("pd-images")


def test_embeddings_run_on_the_prefill_pool(pd: App, offline: LLM) -> None:
    """Pooling is all prefill: the prefill replica embeds, the decode replica (and the
    streams it serves) never sees the inputs."""
    decode_before, prefill_before = decode_and_prefill(pd)
    r = httpx.post(f"{pd.base}/v1/embeddings", headers=pd.headers, timeout=60,
                   json={"model": MODEL, "input": PROMPTS[:2]})
    assert r.status_code == 200, r.text
    for d, want in zip(r.json()["data"], offline.embed(PROMPTS[:2]), strict=True):
        got = d["embedding"]
        assert max(abs(a - b) for a, b in zip(got, want.outputs.embedding, strict=True)) < 1e-4
    decode, prefill = decode_and_prefill(pd)
    assert prefill["finished_requests"] - prefill_before["finished_requests"] == 2
    assert decode["finished_requests"] == decode_before["finished_requests"]
    wait_for(lambda: both_at_baseline(pd), 30, "both pools at baseline")
