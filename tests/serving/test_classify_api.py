"""vLLM's ``POST /classify`` and a cross-encoder behind ``/score`` and ``/rerank``, through
Ray Serve: a one-label sequence classifier answers what the offline engine does
(``LLM.classify``, ``LLM.score``), refuses embeddings and completions with 400s that
say why, stays healthy (its probe classifies), and a generative model's ``/classify``
is a 400 on ``model``."""

from __future__ import annotations

import httpx
import pytest

from pagedserve.cluster import LLM

QUERY = "What is paged attention?"
CHAT = [{"role": "user", "content": QUERY}, {"role": "assistant", "content": "KV blocks."}]
DOCS = ["Blocks of KV cache anywhere in memory.", "A recipe for sourdough bread.",
        "Attention over pages of keys and values."]


@pytest.fixture(scope="module")
def ranker_dir(tmp_path_factory) -> str:
    from pagedserve.worker.loaders import resolve_model
    from pagedserve.worker.testing import write_random_checkpoint

    return write_random_checkpoint(tmp_path_factory.mktemp("ranker") / "qwen2", "qwen2",
                                   resolve_model(None).path, classifier=True,
                                   id2label={"0": "relevant"}, label2id={"relevant": 0},
                                   weight_scale=2.0)


def _close(a: list[float], b: list[float]) -> None:
    assert len(a) == len(b)
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4, (a, b)


def test_a_cross_encoder_classifies_scores_and_reranks(cluster, smol, ranker_dir) -> None:
    llm = LLM(model=ranker_dir, num_gpu_blocks=32)
    try:
        probs = [o.outputs.probs for o in llm.classify(DOCS)]
        logits = [o.outputs.probs for o in llm.classify(DOCS[:1], use_activation=False)]
        scores = [s.outputs.score for s in llm.score(QUERY, DOCS)]
        tok = llm.get_tokenizer()
        tokens = [len(tok.encode(d)) for d in DOCS]
        chat_ids = list(tok.apply_chat_template(CHAT, tokenize=True, return_dict=False))
        chat = llm.classify([chat_ids])[0].outputs.probs
        every = llm.encode(DOCS[:1])[0].outputs.data.tolist()  # token_classify
    finally:
        llm.shutdown()
    app = cluster.deploy("ranker", {"model": ranker_dir, "num_gpu_blocks": 32,
                                    "max_model_len": 256, "num_threads": 1,
                                    "served_model_name": "ranker"})
    try:
        r = httpx.post(f"{app.base}/classify", timeout=60,
                       json={"model": "ranker", "input": DOCS})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["id"].startswith("classify-") and body["object"] == "list"
        assert body["model"] == "ranker" and body["usage"]["prompt_tokens"] == sum(tokens)
        for d, want in zip(body["data"], probs, strict=True):
            _close(d["probs"], want)
            assert d["label"] == "relevant" and d["num_classes"] == 1
        raw = httpx.post(f"{app.base}/v1/classify", timeout=60,
                         json={"input": DOCS[0], "use_activation": False}).json()
        _close(raw["data"][0]["probs"], logits[0])
        # vLLM's chat form: the conversation through the chat template, one prompt (a
        # reward model's use), no generation prompt unless asked.
        r = httpx.post(f"{app.base}/classify", timeout=60, json={"messages": CHAT})
        assert r.status_code == 200, r.text
        _close(r.json()["data"][0]["probs"], chat)
        assert r.json()["usage"]["prompt_tokens"] == len(chat_ids)
        r = httpx.post(f"{app.base}/score", timeout=60,
                       json={"text_1": QUERY, "text_2": DOCS})
        assert r.status_code == 200, r.text
        _close([d["score"] for d in r.json()["data"]], scores)
        r = httpx.post(f"{app.base}/rerank", timeout=60,
                       json={"query": QUERY, "documents": DOCS, "top_n": 2})
        assert r.status_code == 200, r.text
        best = sorted(range(3), key=lambda i: -scores[i])[:2]
        assert [x["index"] for x in r.json()["results"]] == best
        _close([x["relevance_score"] for x in r.json()["results"]],
               [scores[i] for i in best])
        # vLLM's /pooling: a classifier's token task labels every prefix.
        r = httpx.post(f"{app.base}/pooling", timeout=60, json={"input": DOCS[0]})
        assert r.status_code == 200, r.text
        assert len(r.json()["data"][0]["data"]) == len(every) == tokens[0]
        for got, want in zip(r.json()["data"][0]["data"], every, strict=True):
            _close(got, want)
        for path, body, says in [
            ("/v1/embeddings", {"input": "x"}, "does not embed"),
            ("/pooling", {"input": "x", "task": "token_embed"}, "does not embed"),
            ("/pooling", {"input": "x", "task": "max"}, "task"),
            ("/v1/completions", {"prompt": "x", "max_tokens": 2}, "sequence classifier"),
            ("/classify", {"input": []}, "must not be empty"),
            ("/classify", {"input": "x", "truncate_prompt_tokens": 0}, ">= 1"),
            ("/classify", {"input": "x", "messages": CHAT}, "either input or messages"),
            ("/classify", {"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}]}]},
             "text messages only"),
        ]:
            r = httpx.post(f"{app.base}{path}", json=body, timeout=60)
            assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
        assert httpx.get(f"{app.base}/health", timeout=60).status_code == 200
        app.wait_baseline()
    finally:
        cluster.delete("ranker")
    r = httpx.post(f"{smol.base}/classify", headers=smol.headers, timeout=60,
                   json={"input": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_a_bert_cross_encoder_reranks_over_http(cluster, tmp_path) -> None:
    """An encoder app (BERT, ``[CLS] query [SEP] doc [SEP]`` with token types): /rerank
    and /score equal transformers' sigmoid scores, truncation keeps ``[CLS]`` and the
    closing ``[SEP]``, and what it cannot serve is a 400 that says why."""
    import torch

    from pagedserve.worker.testing_encoders import hf_encoder_outputs, write_random_encoder

    ask, words = "w1 w2 w9", ["w3 w4 w5 w6", "w9", "w2 w1 w9 w9 w7"]
    path = write_random_encoder(tmp_path / "cross", "bert", num_labels=1, seed=4)
    want = [torch.sigmoid(x).item()
            for x in hf_encoder_outputs(path, [(ask, d) for d in words], True)]
    app = cluster.deploy("bert", {"model": path, "num_threads": 1, "served_model_name": "ce"})
    try:
        r = httpx.post(f"{app.base}/rerank", timeout=60,
                       json={"query": ask, "documents": words})
        assert r.status_code == 200, r.text
        got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
        _close([got[i] for i in range(len(words))], want)
        r = httpx.post(f"{app.base}/v1/score", timeout=60,
                       json={"text_1": ask, "text_2": words[0], "truncate_prompt_tokens": 5})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 5
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(path)(ask, words[0])["input_ids"]
        # [CLS] query [SEP]: no token after the only separator, so every type is 0
        cut = hf_encoder_outputs(path, [ids[:4] + ids[-1:]], True)[0]
        _close([r.json()["data"][0]["score"]], [torch.sigmoid(cut).item()])
        for route, body, says in [
            ("/v1/embeddings", {"input": "w1"}, "does not embed"),
            ("/v1/completions", {"prompt": "w1", "max_tokens": 2}, "sequence classifier"),
        ]:
            r = httpx.post(f"{app.base}{route}", json=body, timeout=60)
            assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
        assert httpx.get(f"{app.base}/health", timeout=60).status_code == 200
        app.wait_baseline()
    finally:
        cluster.delete("bert")
