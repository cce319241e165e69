"""Tool calling and vLLM's /tokenize and /detokenize over HTTP, default model (the
package's ``smol`` app; the parsing and streaming rules are in ``test_tools.py``)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from pagedserve.worker.loaders import load_tokenizer, resolve_model
from tests.serving.conftest import SMOL_ARGS, App
from tests.serving.test_openai_api import FRANCE, MODEL

pytestmark = [pytest.mark.ray, pytest.mark.slow]


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "London", "Rome"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
WEATHER_Q = [{"role": "user", "content": "What is the weather like in Paris?"}]


def test_tool_choice_named_and_required_give_valid_calls(smol: App) -> None:
    client = smol.openai()
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=WEATHER_Q, temperature=0,
                                       max_tokens=60, tools=[WEATHER_TOOL, TIME_TOOL],
                                       tool_choice=named)
    (call,) = r.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and call.type == "function"
    assert args["city"] in ("Paris", "London", "Rome") and args["unit"] in ("celsius",
                                                                           "fahrenheit")
    assert r.choices[0].finish_reason == "stop"  # a forced call, as OpenAI reports it
    # Streamed: the same call, arriving as tool_calls deltas.
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(
            model=MODEL, messages=WEATHER_Q, temperature=0, max_tokens=60,
            tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=named, stream=True):
        for tc in chunk.choices[0].delta.tool_calls or []:
            c = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            c["name"] += tc.function.name or ""
            c["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert calls == {0: {"name": "get_weather", "arguments": call.function.arguments}}
    assert finish == "stop"

    r = client.chat.completions.create(model=MODEL, messages=WEATHER_Q, temperature=0,
                                       max_tokens=80, tools=[WEATHER_TOOL, TIME_TOOL],
                                       tool_choice="required", parallel_tool_calls=False)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls"
    args = json.loads(call.function.arguments)
    if call.function.name == "get_time":
        assert args["zone"] in ("UTC", "CET")
    else:
        assert call.function.name == "get_weather" and args["city"] in ("Paris", "London",
                                                                        "Rome")
    smol.wait_baseline()


def test_tools_conversation_and_bad_tool_requests(smol: App) -> None:
    client = smol.openai()
    history = [
        *WEATHER_Q,
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather",
                         "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=history, temperature=0,
                                       max_tokens=30, tools=[WEATHER_TOOL])
    assert r.choices[0].message.content  # "auto": this model answers in text
    assert r.choices[0].finish_reason in ("stop", "length")
    r = client.chat.completions.create(model=MODEL, messages=WEATHER_Q, temperature=0,
                                       max_tokens=8, tools=[WEATHER_TOOL], tool_choice="none")
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    for kw, param in (
            ({"tools": [WEATHER_TOOL],
              "tool_choice": {"type": "function", "function": {"name": "nope"}}},
             "tool_choice"),
            ({"tool_choice": "required"}, "tool_choice"),
            ({"tools": [{"type": "function", "function": {"description": "no name"}}]},
             "tools"),
            ({"tools": [WEATHER_TOOL], "tool_choice": "required",
              "response_format": {"type": "json_object"}}, "tool_choice")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=WEATHER_Q, max_tokens=4,
                                           **kw)
        assert e.value.body["param"] == param, (kw, e.value.body)


def test_tokenize_and_detokenize(smol: App) -> None:
    """vLLM's /tokenize (a prompt, or messages through the chat template: the prompt a chat
    completion runs on) and /detokenize; API key required like /v1."""
    tok = load_tokenizer(resolve_model(None))
    h = smol.headers

    def post(path: str, body: dict[str, Any], headers: dict[str, str] = h) -> httpx.Response:
        return httpx.post(f"{smol.base}{path}", json=body, headers=headers, timeout=60)

    r = post("/tokenize", {"prompt": "Hello world"}).json()
    assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == SMOL_ARGS["max_model_len"]
    chat = post("/tokenize", {"messages": FRANCE}).json()
    usage = smol.openai().chat.completions.create(model=MODEL, messages=FRANCE,
                                                  max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens
    assert post("/detokenize", {"tokens": chat["tokens"]}).json()["prompt"] == tok.decode(
        chat["tokens"])
    # vLLM's continue_final_message: the assistant's open turn, continued.
    opened = [*FRANCE, {"role": "assistant", "content": "The capital of France is"}]
    cont = post("/tokenize", {"messages": opened, "add_generation_prompt": False,
                              "continue_final_message": True}).json()
    assert cont["tokens"] == list(tok.apply_chat_template(
        opened, continue_final_message=True, tokenize=True, return_dict=False))
    r = smol.openai().chat.completions.create(
        model=MODEL, messages=opened, max_tokens=6, temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert r.usage.prompt_tokens == cont["count"]
    assert r.choices[0].message.content.startswith(" Paris")
    both = post("/v1/chat/completions", {"model": MODEL, "messages": opened,
                                         "continue_final_message": True})
    assert both.status_code == 400
    assert both.json()["error"]["param"] == "continue_final_message"
    for path, body, param in (("/tokenize", {"prompt": "a", "messages": FRANCE}, "prompt"),
                              ("/tokenize", {}, "prompt"),
                              ("/detokenize", {"tokens": [10**9]}, "tokens")):
        bad = post(path, body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param
    assert post("/tokenize", {"prompt": "a"}, headers={}).status_code == 401
