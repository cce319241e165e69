"""GPT-OSS's harmony answers over HTTP (``--reasoning-parser openai_gptoss``).

A random model whose tokenizer has the harmony markers as special tokens (SmolLM2's
with them added, and a GPT-OSS-like chat template) is made to write exact harmony
answers by a test logits processor (``harmony_script``). The markers reach the
parser only because these requests keep special tokens; none reaches the client.
The thought goes to ``reasoning``, the final channel to ``content``, a call to
``functions.NAME`` to ``tool_calls``, streamed or not; a constrained request is a
400 naming its field, on chat completions and the Responses API."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.serving.conftest import App, Cluster
from tests.serving.harmony_script import SCRIPT_PROCESSOR

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MARKERS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
           "<|return|>", "<|call|>"]
TEMPLATE = ("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}"
            "<|end|>{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")
THINK = "<|channel|>analysis<|message|>The user wants Paris.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>Paris is the capital.<|return|>"
CALL = ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city":"Paris"}<|call|>')
CALL_FIRST = ("<|start|>assistant to=functions.get_weather<|channel|>commentary json"
              '<|message|>{"city": "Paris"}<|call|>')
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "Weather in the capital of France?"}]


@pytest.fixture(scope="module")
def harmony_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    """The model's directory and its tokenizer; ``<|return|>`` and ``<|call|>`` end an
    answer, as in the release's generation_config."""
    from pagedserve.worker.loaders import load_tokenizer, resolve_model
    from pagedserve.worker.testing import write_random_checkpoint

    root = tmp_path_factory.mktemp("harmony")
    tok = load_tokenizer(resolve_model(None))
    tok.add_special_tokens({"additional_special_tokens": MARKERS})
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(root / "tokenizer"))
    path = write_random_checkpoint(root / "model", "llama", root / "tokenizer",
                                   vocab_size=len(tok), max_position_embeddings=512)
    ends = tok.convert_tokens_to_ids(["<|return|>", "<|call|>"])
    (Path(path) / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}))
    return path, tok


@pytest.fixture(scope="module")
def harmony(cluster: Cluster, harmony_model: tuple[str, Any]) -> Iterator[App]:
    app = cluster.deploy("harmony", {
        "model": harmony_model[0], "num_gpu_blocks": 64, "max_model_len": 512,
        "num_threads": 2, "max_num_seqs": 8, "reasoning_parser": "openai_gptoss",
        "logits_processors": [SCRIPT_PROCESSOR]})
    yield app
    cluster.delete("harmony")


def _body(tok: Any, answer: str, **kw: Any) -> dict[str, Any]:
    script = tok.encode(answer, add_special_tokens=False)
    return {"messages": ASK, "max_tokens": 64, "vllm_xargs": {"script": script}, **kw}


def _post(app: App, body: dict[str, Any], route: str = "/v1/chat/completions",
          status: int = 200) -> httpx.Response:
    r = httpx.post(f"{app.base}{route}", json=body, headers=app.headers, timeout=120)
    assert r.status_code == status, r.text
    return r


def _streamed(app: App, body: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """The stream's chunk objects, and its raw text (to look for markers in)."""
    with httpx.stream("POST", f"{app.base}/v1/chat/completions", json={**body, "stream": True},
                      headers=app.headers, timeout=120) as r:
        assert r.status_code == 200
        raw = "".join(r.iter_text())
    events = [json.loads(line[len("data: "):]) for line in raw.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    return events, raw


def _joined(events: list[dict[str, Any]], key: str) -> str:
    return "".join(e["choices"][0]["delta"].get(key) or "" for e in events)


def test_thought_and_answer_are_split_streamed_or_not(
        harmony: App, harmony_model: tuple[str, Any]) -> None:
    tok = harmony_model[1]
    body = _body(tok, THINK + FINAL)
    r = _post(harmony, body)
    choice = r.json()["choices"][0]
    msg = choice["message"]
    assert msg["reasoning"] == msg["reasoning_content"] == "The user wants Paris."
    assert msg["content"] == "Paris is the capital." and choice["finish_reason"] == "stop"
    assert "<|" not in r.text
    events, raw = _streamed(harmony, body)
    assert (_joined(events, "reasoning"), _joined(events, "content")) == (
        msg["reasoning"], msg["content"])
    assert events[-1]["choices"][0]["finish_reason"] == "stop" and "<|" not in raw
    hidden = _post(harmony, {**body, "include_reasoning": False}).json()["choices"][0]
    assert hidden["message"] == {"role": "assistant", "content": "Paris is the capital."}


def test_calls_to_functions_are_tool_calls(harmony: App,
                                           harmony_model: tuple[str, Any]) -> None:
    tok = harmony_model[1]
    for answer, args in ((THINK + CALL, '{"city":"Paris"}'),
                         (THINK + CALL_FIRST, '{"city": "Paris"}')):
        body = _body(tok, answer, tools=[WEATHER])
        choice = _post(harmony, body).json()["choices"][0]
        msg = choice["message"]
        assert choice["finish_reason"] == "tool_calls", choice
        assert msg["content"] is None and msg["reasoning"] == "The user wants Paris."
        (call,) = msg["tool_calls"]
        assert call["function"] == {"name": "get_weather", "arguments": args}
    events, raw = _streamed(harmony, body)
    calls = [c for e in events for c in e["choices"][0]["delta"].get("tool_calls") or []]
    assert [c["function"] for c in calls] == [{"name": "get_weather", "arguments": args}]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls" and "<|" not in raw
    # offered no tools, the model's call is dropped (vLLM's, without its tool parser)
    plain = _post(harmony, _body(tok, THINK + CALL)).json()["choices"][0]
    assert "tool_calls" not in plain["message"] and plain["finish_reason"] == "stop"


def test_an_answer_cut_short_keeps_its_thought(harmony: App,
                                               harmony_model: tuple[str, Any]) -> None:
    tok = harmony_model[1]
    body = _body(tok, THINK + FINAL, max_tokens=6)
    choice = _post(harmony, body).json()["choices"][0]
    assert choice["finish_reason"] == "length"
    thought = choice["message"]["reasoning"]
    assert thought and "The user wants Paris.".startswith(thought), choice
    assert choice["message"]["content"] is None
    events, _ = _streamed(harmony, body)
    assert _joined(events, "reasoning") == thought and _joined(events, "content") == ""


@pytest.mark.parametrize(("route", "fields", "param"), [
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}},
     "response_format"),
    ("/v1/chat/completions", {"guided_regex": "[0-9]+"}, "guided_regex"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
    ("/v1/responses", {"text": {"format": {"type": "json_object"}}}, "text"),
])
def test_constrained_requests_are_refused(harmony: App, route: str, fields: dict[str, Any],
                                          param: str) -> None:
    """A grammar would have to start after the final channel's header: a 400 naming the
    field, never a wrong answer."""
    body = {"messages": ASK} if route.endswith("completions") else {"input": ASK}
    r = _post(harmony, {**body, **fields}, route, status=400)
    assert r.json()["error"]["param"] == param and "openai_gptoss" in r.text
