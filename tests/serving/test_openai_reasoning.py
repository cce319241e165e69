"""Reasoning outputs over HTTP (``--reasoning-parser qwen3``, SmolLM2 in a ``think`` app
of its own: under the parser its constrained answers may start with a thought): a thought goes to ``reasoning``, streamed or not, and the same split either way;
output constraints start after the thought; ``include_reasoning: false`` drops it;
plain answers are untouched; ``chat_template_kwargs`` is checked."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.serving.conftest import SMOL_ARGS, App, Cluster
from tests.serving.test_openai_api import FRANCE, MODEL

pytestmark = [pytest.mark.ray, pytest.mark.slow]

THINK = {"regex": "<think>[a-z]{3,12}</think>[A-Z][a-z]{2,12}"}


@pytest.fixture(scope="module")
def think(cluster: Cluster) -> Iterator[App]:
    app = cluster.deploy("think", {**SMOL_ARGS, "num_gpu_blocks": 64, "max_num_seqs": 8,
                                   "reasoning_parser": "qwen3"})
    yield app
    cluster.delete("think")


def _chat(app: App, **kw: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": FRANCE, "temperature": 0, "max_tokens": 40, **kw}
    r = httpx.post(f"{app.base}/v1/chat/completions", json=body, headers=app.headers,
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_thought_and_answer_are_split_streamed_or_not(think: App) -> None:
    """A constraint that itself begins with ``<think>`` makes SmolLM2 open a thought;
    the grammar lets that thought run free (the constraint starts after it), so the
    model thinks in plain words, then writes the constrained answer."""
    msg = _chat(think, structured_outputs=THINK)["choices"][0]["message"]
    assert msg["reasoning"] and "</think>" not in msg["reasoning"], msg
    assert msg["reasoning_content"] == msg["reasoning"]
    assert re.fullmatch(THINK["regex"], msg["content"].lstrip()), msg

    thought = answer = ""
    for chunk in think.openai().chat.completions.create(
            model=MODEL, messages=FRANCE, temperature=0, max_tokens=40, stream=True,
            extra_body={"structured_outputs": THINK}):
        delta = chunk.choices[0].delta
        thought += (delta.model_extra or {}).get("reasoning") or ""
        answer += delta.content or ""
    assert (thought, answer) == (msg["reasoning"], msg["content"])

    hidden = _chat(think, structured_outputs=THINK, include_reasoning=False)
    assert "reasoning" not in hidden["choices"][0]["message"]
    assert hidden["choices"][0]["message"]["content"] == msg["content"]


def test_a_constraint_starts_after_the_thought(think: App) -> None:
    """Under the parser the grammar lets the model think first (vLLM's rule): the
    thought's tags pushed by logit_bias, the answer after them in the regex."""
    from pagedserve.worker.loaders import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(None))
    bias = {str(t): 30.0 for t in tok.encode("</think>", add_special_tokens=False)}
    bias.update({str(t): 10.0 for t in tok.encode("<", add_special_tokens=False)})
    kw = {"guided_regex": "(Paris|Rome)[.]", "logit_bias": bias}
    msg = _chat(think, **kw)["choices"][0]["message"]
    assert msg["reasoning"] == "" and msg["content"].strip() == "Paris.", msg
    thought, answer = None, ""
    for chunk in think.openai().chat.completions.create(
            model=MODEL, messages=FRANCE, temperature=0, max_tokens=40, stream=True,
            extra_body=kw):
        delta = chunk.choices[0].delta
        thought = (delta.model_extra or {}).get("reasoning", thought)
        answer += delta.content or ""
    assert answer == msg["content"]


def test_plain_answers_have_no_reasoning(think: App, smol: App) -> None:
    msg = _chat(think, max_tokens=12)["choices"][0]["message"]
    assert msg["reasoning"] is None and msg["content"].startswith("The capital of France")
    plain = _chat(smol, max_tokens=12)["choices"][0]["message"]  # no parser: no field
    assert "reasoning" not in plain and plain["content"] == msg["content"]


def test_chat_template_kwargs(think: App) -> None:
    with_kwargs = _chat(think, max_tokens=12, chat_template_kwargs={"enable_thinking": False})
    assert with_kwargs["choices"][0]["message"]["content"].startswith("The capital")
    body = {"model": MODEL, "messages": FRANCE, "chat_template_kwargs": {"tokenize": False}}
    for route in ("/v1/chat/completions", "/tokenize"):
        r = httpx.post(f"{think.base}{route}", json=body, headers=think.headers, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_responses_api_puts_the_thought_in_a_reasoning_item(think: App) -> None:
    """``POST /v1/responses``: the thought is a reasoning item before the message,
    streamed as reasoning text events, the same split as chat completions."""
    msg = _chat(think, structured_outputs=THINK)["choices"][0]["message"]
    client = think.openai()
    kw: dict[str, Any] = {"model": MODEL, "input": FRANCE, "temperature": 0,
                          "max_output_tokens": 40,
                          "extra_body": {"structured_outputs": THINK}}
    r = client.responses.create(**kw)
    thought, answer = r.output
    assert thought.type == "reasoning" and thought.content[0].text == msg["reasoning"]
    assert answer.type == "message" and r.output_text == msg["content"]
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    events = list(client.responses.create(stream=True, **kw))
    streamed = {k: "".join(e.delta for e in events if e.type == f"response.{k}.delta")
                for k in ("reasoning_text", "output_text")}
    assert streamed == {"reasoning_text": msg["reasoning"], "output_text": msg["content"]}
    final = events[-1].response
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert [o.id for o in final.output] == [e.item.id for e in events
                                           if e.type == "response.output_item.added"]
