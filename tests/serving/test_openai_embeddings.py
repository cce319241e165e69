"""``POST /v1/embeddings`` through Ray Serve with the OpenAI client, and vLLM's
``/score`` and ``/rerank`` on top of it.

The default model's embeddings over HTTP equal the offline engine's
``LLM.embed`` (text and token-id inputs, a batch, ``dimensions``, base64), scores
are the cosine similarities of those embeddings,
usage counts the input tokens, bad inputs are 400s with OpenAI error bodies,
an unknown model is a 404, and the replica's pool is back at baseline after.
"""

from __future__ import annotations

import base64
import struct

import httpx
import pytest

from pagedserve.cluster import LLM, PoolingParams

TEXTS = ["The capital of France is Paris.", "Paged attention keeps KV blocks anywhere.",
         "A third, rather longer sentence about continuous batching and prefix caching."]
CHAT = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]


@pytest.fixture(scope="module")
def offline() -> dict[str, list[list[float]]]:
    llm = LLM(num_gpu_blocks=64)
    try:
        tok = llm.get_tokenizer()
        ids = [tok.encode(t) for t in TEXTS]
        full = [o.outputs.embedding for o in llm.embed(ids)]
        cut = [o.outputs.embedding for o in llm.embed(ids, PoolingParams(dimensions=64))]
        chat_ids = list(tok.apply_chat_template(CHAT, tokenize=True, return_dict=False))
        chat = llm.embed([chat_ids])[0].outputs.embedding
        tokens = llm.encode(ids[:2])[0].outputs.data.tolist()
        return {"full": full, "cut": cut, "ids": ids, "chat": chat, "tokens": tokens}
    finally:
        llm.shutdown()


def _close(a: list[float], b: list[float]) -> None:
    assert len(a) == len(b)
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4


def test_embeddings_equal_the_offline_engine(smol, offline) -> None:
    client = smol.openai()
    r = client.embeddings.create(model=client.models.list().data[0].id, input=TEXTS)
    assert [d.index for d in r.data] == [0, 1, 2]
    for d, want in zip(r.data, offline["full"], strict=True):
        _close(d.embedding, want)
    assert r.usage.prompt_tokens == sum(len(i) for i in offline["ids"]) == r.usage.total_tokens
    one = client.embeddings.create(model=r.model, input=offline["ids"][1], dimensions=64)
    _close(one.data[0].embedding, offline["cut"][1])
    raw = httpx.post(f"{smol.base}/v1/embeddings", headers=smol.headers, timeout=60,
                     json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    data = base64.b64decode(raw["data"][0]["embedding"])
    _close(list(struct.unpack(f"<{len(data) // 4}f", data)), offline["full"][0])
    assert raw["id"].startswith("embd-") and raw["created"] > 0
    named = httpx.post(f"{smol.base}/v1/embeddings", timeout=60,  # vLLM's ids
                       headers={**smol.headers, "X-Request-Id": "trace-7"},
                       json={"input": TEXTS[0]})
    assert named.json()["id"] == "embd-trace-7"
    assert named.headers["x-request-id"] == "trace-7"
    chat = httpx.post(f"{smol.base}/v1/embeddings", headers=smol.headers, timeout=60,
                      json={"messages": CHAT})  # vLLM's chat form: one templated prompt
    assert chat.status_code == 200, chat.text
    _close(chat.json()["data"][0]["embedding"], offline["chat"])
    # vLLM's /pooling: a generative model's token task is token_embed (a row a token).
    r = httpx.post(f"{smol.base}/pooling", headers=smol.headers, timeout=60,
                   json={"input": TEXTS[0]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("pool-") and body["data"][0]["object"] == "pooling"
    rows = body["data"][0]["data"]
    assert len(rows) == len(offline["tokens"]) == body["usage"]["prompt_tokens"]
    for got, want in zip(rows, offline["tokens"], strict=True):
        _close(got, want)
    r = httpx.post(f"{smol.base}/pooling", headers=smol.headers, timeout=60,
                   json={"input": TEXTS[0], "task": "embed", "encoding_format": "base64"})
    data = base64.b64decode(r.json()["data"][0]["data"])
    _close(list(struct.unpack(f"<{len(data) // 4}f", data)), offline["full"][0])
    for body, says in [({"input": "x", "task": "token_classify"}, "sequence classifier"),
                       ({"input": "x", "task": "token_embed", "dimensions": 0},
                        "dimensions")]:
        r = httpx.post(f"{smol.base}/pooling", headers=smol.headers, json=body, timeout=60)
        assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
    smol.wait_baseline()


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"),
    ({"input": ["ok", ""]}, "input"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "dimensions": 100000}, None),
    ({"input": [5] * 2000}, None),
    ({"input": [[5] * 300] * 6 + [[5] * 2000]}, None),  # one bad input cancels the rest
    ({"input": [10**9]}, "input"),
    ({}, "input"),
    ({"messages": []}, "messages"),
    ({"messages": CHAT, "add_generation_prompt": True, "continue_final_message": True},
     "continue_final_message"),
])
def test_bad_embedding_requests_are_400s(smol, body: dict, param: str | None) -> None:
    r = httpx.post(f"{smol.base}/v1/embeddings", headers=smol.headers, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] == param
    smol.wait_baseline()


def test_unknown_model_is_404_and_key_is_required(smol) -> None:
    r = httpx.post(f"{smol.base}/v1/embeddings", headers=smol.headers, timeout=60,
                   json={"model": "no-such-model", "input": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(f"{smol.base}/v1/embeddings", json={"input": "hi"}, timeout=60)
    assert r.status_code == 401
    smol.wait_baseline()


def _dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def test_score_and_rerank_are_cosine_similarities_of_the_embeddings(smol, offline) -> None:
    """vLLM's /score (one text against several, and pairwise) and /rerank: each score
    is the dot product of the offline engine's unit embeddings; rerank orders them."""
    full = offline["full"]

    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{smol.base}{path}", headers=smol.headers, json=body, timeout=60)

    r = post("/score", {"text_1": TEXTS[0], "text_2": TEXTS}).json()
    assert [d["index"] for d in r["data"]] == [0, 1, 2] and r["object"] == "list"
    want = [_dot(full[0], v) for v in full]
    assert max(abs(d["score"] - w) for d, w in zip(r["data"], want, strict=True)) < 1e-4
    assert abs(r["data"][0]["score"] - 1.0) < 1e-4  # a text against itself
    # Each distinct text is embedded once.
    assert r["usage"]["prompt_tokens"] == sum(len(i) for i in offline["ids"])
    assert r["id"].startswith("score-")
    pair = post("/v1/score", {"text_1": TEXTS[1:], "text_2": TEXTS[:2]}).json()
    want = [_dot(full[1], full[0]), _dot(full[2], full[1])]
    assert max(abs(d["score"] - w) for d, w in zip(pair["data"], want, strict=True)) < 1e-4
    ranked = post("/rerank", {"query": TEXTS[0], "documents": [*TEXTS[1:], TEXTS[0]],
                              "top_n": 2, "request_id": "r1"}).json()
    assert ranked["id"] == "rerank-r1"
    scores = [_dot(full[0], v) for v in (full[1], full[2], full[0])]
    best = sorted(range(3), key=lambda i: -scores[i])[:2]
    assert [x["index"] for x in ranked["results"]] == best and best[0] == 2
    assert ranked["results"][0]["document"] == {"text": TEXTS[0]}
    bare = post("/v1/rerank", {"query": TEXTS[0], "documents": TEXTS,
                               "return_documents": False}).json()
    assert len(bare["results"]) == 3 and "document" not in bare["results"][0]
    v2 = post("/v2/rerank", {"query": TEXTS[0], "documents": TEXTS,
                             "return_documents": False}).json()  # vLLM's Cohere v2 path
    assert [x["index"] for x in v2["results"]] == [x["index"] for x in bare["results"]]
    for path, body, param in (
            ("/score", {"text_1": TEXTS[:2], "text_2": TEXTS}, "text_1"),
            ("/score", {"text_1": "a", "text_2": []}, "text_2"),
            ("/score", {"text_1": "", "text_2": "b"}, "text_1"),
            ("/rerank", {"query": "q", "documents": []}, "documents"),
            ("/rerank", {"query": "q", "documents": ["d"], "top_n": 0}, "top_n"),
            ("/rerank", {"query": "", "documents": ["d"]}, "query"),
            ("/score", {"text_1": "a", "text_2": "b", "request_id": ""}, "request_id")):
        bad = post(path, body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, (body, bad.text)
    assert httpx.post(f"{smol.base}/score", json={"text_1": "a", "text_2": "b"},
                      timeout=60).status_code == 401
    smol.wait_baseline()


def test_an_embedding_model_serves_embeddings_and_stays_healthy(cluster, tmp_path) -> None:
    """A base-model checkpoint (no LM head): /v1/embeddings equals LLM.embed, the health
    probe embeds instead of generating, and a completion is a 400 saying why."""
    from pagedserve.worker.loaders import resolve_model
    from pagedserve.worker.testing import write_random_checkpoint

    path = write_random_checkpoint(tmp_path / "embedder", "qwen2", resolve_model(None).path,
                                   base_model=True)
    llm = LLM(model=path, num_gpu_blocks=32)
    try:
        want = [o.outputs.embedding for o in llm.embed([[5, 6, 7, 8], [9, 10]],
                                                       PoolingParams("mean"))]
    finally:
        llm.shutdown()
    app = cluster.deploy("embedder", {"model": path, "num_gpu_blocks": 32,
                                      "max_model_len": 256, "num_threads": 1,
                                      "pooling_type": "mean"})
    try:
        r = httpx.post(f"{app.base}/v1/embeddings", timeout=60,
                       json={"input": [[5, 6, 7, 8], [9, 10]]})
        assert r.status_code == 200, r.text
        for d, w in zip(r.json()["data"], want, strict=True):
            _close(d["embedding"], w)
        assert httpx.get(f"{app.base}/health", timeout=60).status_code == 200
        r = httpx.post(f"{app.base}/v1/completions", timeout=60,
                       json={"prompt": [5, 6], "max_tokens": 2})
        assert r.status_code == 400 and "embedding model" in r.json()["error"]["message"]
        app.wait_baseline()
    finally:
        cluster.delete("embedder")
