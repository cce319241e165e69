"""Reasoning outputs over HTTP (``--reasoning-parser qwen3`` on the package's ``smol``
app): a thought the output constraint makes SmolLM2 write goes to ``reasoning``,
streamed or not, and the same split either way; ``include_reasoning: false`` drops it;
plain answers are untouched; ``chat_template_kwargs`` is checked."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest

from tests.serving.conftest import App
from tests.serving.test_openai_api import FRANCE, MODEL

pytestmark = [pytest.mark.ray, pytest.mark.slow]

THINK = {"regex": "<think>[a-z]{3,12}</think>[A-Z][a-z]{2,12}"}


def _chat(app: App, **kw: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": FRANCE, "temperature": 0, "max_tokens": 40, **kw}
    r = httpx.post(f"{app.base}/v1/chat/completions", json=body, headers=app.headers,
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_thought_and_answer_are_split_streamed_or_not(smol: App) -> None:
    msg = _chat(smol, structured_outputs=THINK)["choices"][0]["message"]
    assert re.fullmatch("[a-z]{3,12}", msg["reasoning"]), msg
    assert msg["reasoning_content"] == msg["reasoning"]
    assert re.fullmatch("[A-Z][a-z]{2,12}", msg["content"]), msg

    thought = answer = ""
    for chunk in smol.openai().chat.completions.create(
            model=MODEL, messages=FRANCE, temperature=0, max_tokens=40, stream=True,
            extra_body={"structured_outputs": THINK}):
        delta = chunk.choices[0].delta
        thought += (delta.model_extra or {}).get("reasoning") or ""
        answer += delta.content or ""
    assert (thought, answer) == (msg["reasoning"], msg["content"])

    hidden = _chat(smol, structured_outputs=THINK, include_reasoning=False)
    assert "reasoning" not in hidden["choices"][0]["message"]
    assert hidden["choices"][0]["message"]["content"] == msg["content"]


def test_plain_answers_have_no_reasoning(smol: App) -> None:
    msg = _chat(smol, max_tokens=12)["choices"][0]["message"]
    assert msg["reasoning"] is None and msg["content"].startswith("The capital of France")


def test_chat_template_kwargs(smol: App) -> None:
    with_kwargs = _chat(smol, max_tokens=12, chat_template_kwargs={"enable_thinking": False})
    assert with_kwargs["choices"][0]["message"]["content"].startswith("The capital")
    body = {"model": MODEL, "messages": FRANCE, "chat_template_kwargs": {"tokenize": False}}
    for route in ("/v1/chat/completions", "/tokenize"):
        r = httpx.post(f"{smol.base}{route}", json=body, headers=smol.headers, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
