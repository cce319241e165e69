"""vLLM's ``return_token_ids``: the prompt's ids and each choice's output ids beside
the text, whole and streamed (the prompt's ids in the first chunk only), for RL
frameworks that must not re-tokenise."""

from __future__ import annotations

import json

import httpx

from tests.serving.conftest import App

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "Water boils at"]


def post(app: App, path: str, **body: object) -> httpx.Response:
    return httpx.post(f"{app.base}{path}", headers=app.headers, timeout=120,
                      json={"model": MODEL, "max_tokens": 8, "temperature": 0.0,
                            "return_token_ids": True, **body})


def events(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_completions_carry_prompt_and_output_ids(smol: App) -> None:
    from pagedserve.worker.loaders import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(None).path)
    r = post(smol, "/v1/completions", prompt=PROMPTS, n=2)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for c in choices:
        assert c["prompt_token_ids"] == tok.encode(PROMPTS[c["index"] // 2])
        assert len(c["token_ids"]) == 8 and tok.decode(c["token_ids"]) == c["text"]
    streamed = events(post(smol, "/v1/completions", prompt=PROMPTS, n=2, stream=True))
    ids: dict[int, list[int]] = {}
    firsts: dict[int, list[int]] = {}
    for ev in streamed:
        for c in ev["choices"]:
            ids.setdefault(c["index"], []).extend(c["token_ids"])
            if "prompt_token_ids" in c:
                assert c["index"] not in firsts  # the first chunk of each choice only
                firsts[c["index"]] = c["prompt_token_ids"]
    assert ids == {c["index"]: c["token_ids"] for c in choices}
    assert firsts == {c["index"]: c["prompt_token_ids"] for c in choices}
    plain = post(smol, "/v1/completions", prompt=PROMPTS[0], return_token_ids=None)
    assert "token_ids" not in plain.json()["choices"][0]


def test_chat_carries_them_once_for_the_prompt(smol: App) -> None:
    msgs = [{"role": "user", "content": "Name a colour."}]
    r = post(smol, "/v1/chat/completions", messages=msgs)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["prompt_token_ids"] and body["usage"]["prompt_tokens"] == len(
        body["prompt_token_ids"])
    assert len(body["choices"][0]["token_ids"]) == body["usage"]["completion_tokens"]
    streamed = events(post(smol, "/v1/chat/completions", messages=msgs, stream=True))
    assert streamed[0]["prompt_token_ids"] == body["prompt_token_ids"]
    assert all("prompt_token_ids" not in ev for ev in streamed[1:])
    assert [t for ev in streamed for c in ev["choices"] for t in c["token_ids"]] == \
        body["choices"][0]["token_ids"]


def test_beam_search_carries_them_too(smol: App) -> None:
    from pagedserve.worker.loaders import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(None).path)
    r = post(smol, "/v1/completions", prompt=PROMPTS[0], n=2, use_beam_search=True)
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        assert c["prompt_token_ids"] == tok.encode(PROMPTS[0])
        assert tok.decode(c["token_ids"], skip_special_tokens=True) == c["text"]
    streamed = events(post(smol, "/v1/chat/completions", n=2, use_beam_search=True,
                           stream=True, messages=[{"role": "user", "content": "Hi"}]))
    assert streamed[0]["prompt_token_ids"] and "prompt_token_ids" not in streamed[1]
    assert all(c["token_ids"] for ev in streamed for c in ev["choices"])
