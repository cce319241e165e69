"""Custom logits processors over HTTP: ``--logits-processors`` loads them into every
replica, ``vllm_xargs`` sets a request's (vLLM's field), bad settings are 400s."""

from __future__ import annotations

import httpx
import pytest

from pagedserve.cluster.cli import build_parser
from pagedserve.cluster.serve_args import ServeArgs
from tests.serving.conftest import App

TARGET = "pagedserve.worker.testing_logits:TargetTokenProcessor"


def post(app: App, path: str, **body: object) -> httpx.Response:
    return httpx.post(f"{app.base}{path}", headers=app.headers, timeout=120,
                      json={"model": "SmolLM2-135M-Instruct", "max_tokens": 6,
                            "temperature": 0.0, "ignore_eos": True, **body})


def test_vllm_xargs_reach_the_processor(smol: App) -> None:
    from pagedserve.worker.loaders import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(None).path)
    target = tok.encode(" Paris")[0]
    r = post(smol, "/v1/completions", prompt="The capital of France is",
             vllm_xargs={"target_token": target}, n=2)
    assert r.status_code == 200, r.text
    assert [c["text"] for c in r.json()["choices"]] == [tok.decode([target] * 6)] * 2
    chat = post(smol, "/v1/chat/completions", vllm_xargs={"target_token": target},
                messages=[{"role": "user", "content": "Name a city."}])
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"] == tok.decode([target] * 6)
    free = post(smol, "/v1/completions", prompt="The capital of France is")
    assert free.json()["choices"][0]["text"] != tok.decode([target] * 6)


def test_bad_vllm_xargs_are_400s(smol: App) -> None:
    r = post(smol, "/v1/completions", prompt="hi", vllm_xargs={"target_token": "x"})
    assert r.status_code == 400, r.text
    assert "extra_args.target_token must be an integer" in r.json()["error"]["message"]
    nested = post(smol, "/v1/completions", prompt="hi", vllm_xargs={"a": {"b": 1}})
    assert nested.status_code == 400 and "vllm_xargs" in nested.json()["error"]["message"]
    smol.wait_baseline()


def test_the_flags_reach_the_engine() -> None:
    ngram = "pagedserve.worker.testing_logits.NoRepeatNgramProcessor"
    args = ServeArgs.parse(build_parser().parse_args(
        ["serve", "--logits-processors", TARGET, ngram, "--enable-prompt-embeds"]))
    kwargs = args.settings().engine_kwargs
    assert kwargs["logits_processors"] == [TARGET, ngram]
    assert kwargs["enable_prompt_embeds"] is True
    bad = ServeArgs.parse(build_parser().parse_args(["serve", "--logits-processors", "a.b:C"]))
    with pytest.raises(ValueError, match=r"logits_processors: cannot load 'a\.b:C'"):
        bad.settings()  # before any replica starts
