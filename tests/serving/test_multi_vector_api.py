"""Multi-vector encoders through Ray Serve: a ColBERT app's ``/pooling`` rows, ``/score``
and ``/rerank`` (late interaction) equal the offline engine's, its health probe
embeds tokens, and ``/v1/embeddings`` (one pooled vector) is a 400 that says why; a
BGE-M3 app beside it gives its dense vectors and lexical weights."""

from __future__ import annotations

import httpx

from pagedserve.cluster import LLM


def _close(a: list, b: list) -> None:
    import torch

    torch.testing.assert_close(torch.tensor(a, dtype=torch.float64),
                               torch.tensor(b, dtype=torch.float64), rtol=1e-5, atol=1e-5)


def test_colbert_and_bge_m3_apps_answer_as_the_offline_engine(cluster, tmp_path) -> None:
    from pagedserve.worker.testing_encoders import write_random_multi_vector

    query, docs = "w1 w2 w9", ["w3 w4 w5 w6", "w9", "w2 w1 w9 w9 w7"]
    colbert = write_random_multi_vector(tmp_path / "colbert", "colbert", dim=12, seed=7)
    m3 = write_random_multi_vector(tmp_path / "m3", "bge-m3", dim=16, seed=8)
    want: dict[str, dict] = {}
    for name, path in (("colbert", colbert), ("m3", m3)):
        llm = LLM(model=path)
        try:
            want[name] = {
                "rows": llm.encode([query])[0].outputs.data.tolist(),
                "scores": [s.outputs.score for s in llm.score(query, docs)],
                "weights": llm.encode([query], pooling_task="token_classify")[0]
                .outputs.data.tolist() if name == "m3" else None,
                "dense": llm.embed([query])[0].outputs.embedding if name == "m3" else None}
        finally:
            llm.shutdown()
    apps = cluster.deploy_many({name: {"model": path, "num_threads": 1,
                                       "served_model_name": name}
                                for name, path in (("colbert", colbert), ("m3", m3))})
    try:
        base = apps["colbert"].base
        r = httpx.post(f"{base}/pooling", timeout=60, json={"input": query})
        assert r.status_code == 200, r.text
        _close(r.json()["data"][0]["data"], want["colbert"]["rows"])
        r = httpx.post(f"{base}/v1/score", timeout=60, json={"text_1": query, "text_2": docs})
        assert r.status_code == 200, r.text
        _close([d["score"] for d in r.json()["data"]], want["colbert"]["scores"])
        r = httpx.post(f"{base}/rerank", timeout=60,
                       json={"query": query, "documents": docs, "top_n": 2})
        assert r.status_code == 200, r.text
        scores = want["colbert"]["scores"]
        assert [x["index"] for x in r.json()["results"]] == \
            sorted(range(3), key=lambda i: -scores[i])[:2]
        r = httpx.post(f"{base}/v1/embeddings", timeout=60, json={"input": query})
        assert r.status_code == 400 and "token_embed" in r.json()["error"]["message"], r.text
        r = httpx.post(f"{base}/pooling", timeout=60,
                       json={"input": query, "task": "token_classify"})
        assert r.status_code == 400 and "serves tasks" in r.json()["error"]["message"], r.text
        assert httpx.get(f"{base}/health", timeout=60).status_code == 200
        base = apps["m3"].base
        r = httpx.post(f"{base}/v1/embeddings", timeout=60, json={"input": query})
        assert r.status_code == 200, r.text
        _close(r.json()["data"][0]["embedding"], want["m3"]["dense"])
        r = httpx.post(f"{base}/pooling", timeout=60,
                       json={"input": query, "task": "token_classify"})
        assert r.status_code == 200, r.text
        _close(r.json()["data"][0]["data"], want["m3"]["weights"])
        r = httpx.post(f"{base}/score", timeout=60, json={"text_1": query, "text_2": docs})
        _close([d["score"] for d in r.json()["data"]], want["m3"]["scores"])
        assert httpx.get(f"{base}/health", timeout=60).status_code == 200
        for app in apps.values():
            app.wait_baseline()
    finally:
        cluster.delete_many(list(apps))
