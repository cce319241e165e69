"""LoRA adapters over HTTP: the OpenAI ``model`` field picks an adapter.

One app of the default model with a static adapter (``lora_modules``) and a
directory of adapters loaded on first use (``lora_dir``); every answer is
checked against the offline engine with the same adapter, token for token.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pagedserve.cluster import LLM, LoRARequest, SamplingParams
from pagedserve.worker.loaders import resolve_model
from pagedserve.worker.testing import write_random_lora
from tests.serving.conftest import App, Cluster

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    base = resolve_model(None).path
    root = tmp_path_factory.mktemp("adapters")
    lora_dir = root / "dir"
    lora_dir.mkdir()
    return {
        "static": write_random_lora(base, root / "static", ["q_proj", "v_proj"], seed=1,
                                    scale=2.0),
        "pirate": write_random_lora(base, lora_dir / "pirate",
                                    ["o_proj", "gate_proj", "up_proj", "down_proj"], r=4,
                                    seed=2, scale=2.0),
        "too_big": write_random_lora(base, root / "too_big", ["q_proj"], r=32, seed=3),
        "lora_dir": str(lora_dir),
    }


@pytest.fixture(scope="module")
def lora_app(cluster: Cluster, adapters: dict[str, str]) -> Iterator[App]:
    app = cluster.deploy("lora", {"num_gpu_blocks": 128, "max_model_len": 512,
                                  "num_threads": 2, "max_num_seqs": 16, "max_loras": 2,
                                  "lora_modules": [f"sql={adapters['static']}"],
                                  "lora_dir": adapters["lora_dir"],
                                  "allow_runtime_lora_updating": True,
                                  "served_model_name": ["smol", "smol-alias"]})
    yield app
    cluster.delete("lora")


@pytest.fixture(scope="module")
def offline(adapters: dict[str, str]) -> Iterator[dict[str, Any]]:
    """Reference outputs of the offline engine: base, ``sql`` and ``pirate``."""
    llm = LLM(enable_lora=True, max_loras=2, num_gpu_blocks=128, max_model_len=512)
    loras = {None: None, "sql": LoRARequest("sql", 1, adapters["static"]),
             "pirate": LoRARequest("pirate", 2, str(Path(adapters["lora_dir"]) / "pirate"))}
    params = SamplingParams(temperature=0.0, max_tokens=12)
    try:
        names = list(loras)
        text = llm.generate([PROMPT] * 3, params, lora_request=[loras[n] for n in names])
        chat = llm.chat([CHAT] * 3, params, lora_request=[loras[n] for n in names])
        yield {"completion": {n: o.outputs[0].text for n, o in zip(names, text)},
               "chat": {n: o.outputs[0].text for n, o in zip(names, chat)}}
    finally:
        llm.shutdown()


def test_models_lists_the_adapters_with_their_parent(lora_app: App) -> None:
    data = httpx.get(f"{lora_app.base}/v1/models", timeout=30).json()["data"]
    by_id = {m["id"]: m for m in data}
    base = data[0]["id"]
    assert [m["id"] for m in data[:2]] == ["smol", "smol-alias"]  # vLLM's served names
    assert set(by_id) == {base, "smol-alias", "sql", "pirate"}
    assert by_id["sql"]["parent"] == by_id["pirate"]["parent"] == base
    assert by_id[base]["parent"] is None and by_id["smol-alias"]["parent"] is None
    # Either served name names the base model, alone or as BASE:ADAPTER's base.
    for model, answered in (("smol-alias", "smol"), ("smol-alias:sql", "sql")):
        r = httpx.post(f"{lora_app.base}/v1/completions", timeout=60,
                       json={"model": model, "prompt": PROMPT, "max_tokens": 1})
        assert r.status_code == 200 and r.json()["model"] == answered, r.text
    assert by_id["pirate"]["root"].endswith("pirate")
    one = httpx.get(f"{lora_app.base}/v1/models/pirate", timeout=30).json()
    assert one == by_id["pirate"] | {"created": one["created"]}
    # Ray Serve LLM's BASE:ADAPTER name, retrieved as asked.
    both = httpx.get(f"{lora_app.base}/v1/models/{base}:sql", timeout=30).json()
    assert both["id"] == f"{base}:sql" and both["parent"] == base


def test_completions_and_chat_per_adapter_equal_the_offline_engine(
        lora_app: App, offline: dict[str, Any]) -> None:
    client = lora_app.openai()
    base = client.models.list().data[0].id
    got: dict[str, dict[str | None, str]] = {"completion": {}, "chat": {}}
    for name in (None, "sql", "pirate"):
        model = name or base
        r = client.completions.create(model=model, prompt=PROMPT, max_tokens=12,
                                      temperature=0)
        assert r.model == model
        got["completion"][name] = r.choices[0].text
        c = client.chat.completions.create(model=model, messages=CHAT, max_tokens=12,
                                           temperature=0)
        got["chat"][name] = c.choices[0].message.content
        streamed = "".join(ch.choices[0].delta.content or "" for ch in
                           client.chat.completions.create(model=model, messages=CHAT,
                                                          max_tokens=12, temperature=0,
                                                          stream=True) if ch.choices)
        assert streamed == got["chat"][name]
    assert got == offline
    # Ray Serve LLM's form, BASE:ADAPTER, names the same adapter.
    r = client.completions.create(model=f"{base}:pirate", prompt=PROMPT, max_tokens=12,
                                  temperature=0)
    assert r.choices[0].text == offline["completion"]["pirate"]
    # The adapters change the answers (otherwise nothing above tells them apart).
    assert len(set(offline["chat"].values())) == 3
    stats = lora_app.wait_baseline()
    (replica,) = stats.values()
    assert sorted(replica["lora"]["loaded"]) == ["pirate", "sql"]
    metrics = httpx.get(f"{lora_app.base}/metrics", timeout=30).text
    assert any(line.startswith("pagedserve_lora_adapters_loaded{") and line.endswith(" 2.0")
               for line in metrics.splitlines()), metrics


def test_an_adapter_copied_into_lora_dir_is_served_without_a_restart(
        lora_app: App, adapters: dict[str, str], offline: dict[str, Any]) -> None:
    shutil.copytree(adapters["static"], Path(adapters["lora_dir"]) / "sql-copy")
    client = lora_app.openai()
    assert "sql-copy" in {m.id for m in client.models.list().data}
    r = client.completions.create(model="sql-copy", prompt=PROMPT, max_tokens=12,
                                  temperature=0)
    assert r.choices[0].text == offline["completion"]["sql"]


def test_unknown_or_bad_adapters_are_clear_errors(lora_app: App,
                                                  adapters: dict[str, str]) -> None:
    for model in ("nope", "../dir/pirate", "pirate/../pirate", "other-base:pirate"):
        r = httpx.post(f"{lora_app.base}/v1/completions", timeout=30,
                       json={"model": model, "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 404, r.text
        assert r.json()["error"]["code"] == "model_not_found"
        assert r.json()["error"]["param"] == "model"
    # An adapter over max_lora_rank (16) fails its request, naming the rank; the replica
    # keeps serving.
    shutil.copytree(adapters["too_big"], Path(adapters["lora_dir"]) / "too-big")
    r = httpx.post(f"{lora_app.base}/v1/completions", timeout=60,
                   json={"model": "too-big", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert "max_lora_rank" in r.json()["error"]["message"]
    ok = httpx.post(f"{lora_app.base}/v1/completions", timeout=60,
                    json={"model": "sql", "prompt": PROMPT, "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    lora_app.wait_baseline()


def test_bad_lora_settings_fail_before_deploying(tmp_path: Path) -> None:
    from pagedserve.cluster.serve_app import ServeArgs

    with pytest.raises(ValueError, match="NAME=PATH"):
        ServeArgs(lora_modules=["no-path"]).settings()
    with pytest.raises(ValueError, match=r"adapter_config\.json"):
        ServeArgs(lora_modules=[f"x={tmp_path}"]).settings()
    with pytest.raises(ValueError, match="lora_dir"):
        ServeArgs(lora_dir=str(tmp_path / "missing")).settings()
    with pytest.raises(ValueError, match="ingress_replicas"):
        ServeArgs(allow_runtime_lora_updating=True, ingress_replicas=2).settings()


def test_an_adapter_stream_cut_mid_generation_is_aborted(lora_app: App) -> None:
    """A client that leaves an adapter's stream: the request is aborted at once, the pool
    is back at baseline, and the adapter keeps serving the next request."""
    (before,) = lora_app.wait_baseline().values()
    with httpx.stream("POST", f"{lora_app.base}/v1/completions", timeout=60,
                      json={"model": "sql", "prompt": PROMPT, "max_tokens": 400,
                            "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: {")
            if chunks == 3:
                break
    (after,) = lora_app.wait_baseline(timeout=10).values()
    assert after["aborted_requests"] == before["aborted_requests"] + 1
    assert after["generation_tokens"] - before["generation_tokens"] < 200
    ok = httpx.post(f"{lora_app.base}/v1/completions", timeout=60,
                    json={"model": "sql", "prompt": PROMPT, "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_adapters_loaded_and_unloaded_at_run_time(lora_app: App, smol: App,
                                                  adapters: dict[str, str],
                                                  offline: dict[str, Any]) -> None:
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter: a name serves the
    directory it was given (a new path with load_inplace, a new adapter to the
    replicas), then stops; bad bodies are 400s naming the field; off by default."""
    def post(path: str, body: dict[str, Any], app: App = lora_app) -> httpx.Response:
        return httpx.post(f"{app.base}{path}", json=body, headers=app.headers, timeout=60)

    def answer(model: str) -> str:
        r = post("/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 12,
                                     "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    pirate = str(Path(adapters["lora_dir"]) / "pirate")
    ok = post("/v1/load_lora_adapter", {"lora_name": "rt", "lora_path": adapters["static"]})
    assert ok.status_code == 200 and ok.json()["success"], ok.text
    assert answer("rt") == offline["completion"]["sql"]
    ids = {m["id"] for m in httpx.get(f"{lora_app.base}/v1/models", timeout=30).json()["data"]}
    assert "rt" in ids
    again = post("/v1/load_lora_adapter", {"lora_name": "rt", "lora_path": pirate})
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    assert post("/v1/load_lora_adapter", {"lora_name": "rt", "lora_path": pirate,
                                          "load_inplace": True}).status_code == 200
    assert answer("rt") == offline["completion"]["pirate"]
    for body, param in (({"lora_name": "x", "lora_path": "relative/dir"}, "lora_path"),
                        ({"lora_name": "x", "lora_path": adapters["lora_dir"]}, "lora_path"),
                        ({"lora_name": "../x", "lora_path": pirate}, "lora_name"),
                        ({"lora_name": "sql", "lora_path": pirate}, "lora_name"),
                        ({"lora_name": "x"}, "lora_path")):
        bad = post("/v1/load_lora_adapter", body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
    assert post("/v1/unload_lora_adapter", {"lora_name": "rt"}).status_code == 200
    gone = post("/v1/completions", {"model": "rt", "prompt": PROMPT, "max_tokens": 2})
    assert gone.status_code == 404
    assert post("/v1/unload_lora_adapter", {"lora_name": "rt"}).status_code == 404
    assert post("/v1/unload_lora_adapter", {"lora_name": "sql"}).status_code == 404
    off = post("/v1/load_lora_adapter", {"lora_name": "rt", "lora_path": pirate}, smol)
    assert off.status_code == 400 and "allow-runtime-lora-updating" in off.text
    lora_app.wait_baseline()
