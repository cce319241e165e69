"""OpenAI's Responses API (``POST /v1/responses``) over HTTP on the default model, read
with the ``openai`` client: the answer equals the chat completion it runs as, streamed
events arrive in the documented order and add up to the final response, function
calls round-trip, logprobs and JSON schemas work, and what cannot be served is a 400
naming the Responses field."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.serving.conftest import App
from tests.serving.test_openai_api import FRANCE, MODEL
from tests.serving.test_openai_tools import WEATHER_Q, WEATHER_TOOL

pytestmark = [pytest.mark.ray, pytest.mark.slow]

FLAT_WEATHER = {"type": "function", **WEATHER_TOOL["function"]}


def _chat(app: App, messages: list[dict[str, Any]], **kw: Any) -> Any:
    return app.openai().chat.completions.create(model=MODEL, messages=messages,
                                                temperature=0, **kw)


def _post(app: App, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{app.base}/v1/responses", json={"model": MODEL, **body},
                      headers=app.headers, timeout=120)


def _stream(app: App, **kw: Any) -> list[Any]:
    return list(app.openai().responses.create(model=MODEL, temperature=0, stream=True, **kw))


def test_a_response_is_the_chat_answer_in_the_responses_shape(smol: App) -> None:
    client = smol.openai()
    r = client.responses.create(model=MODEL, input="What is the capital of France?",
                                temperature=0, max_output_tokens=20)
    chat = _chat(smol, FRANCE, max_tokens=20)
    assert r.output_text == chat.choices[0].message.content == "The capital of France is Paris."
    assert r.id.startswith("resp_") and r.status == "completed" and r.object == "response"
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.model == MODEL and r.store is False and r.incomplete_details is None
    # instructions are the system message; a message list is the conversation.
    convo = [{"role": "user", "content": "Name a colour."},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Blue."}]},
             {"role": "user", "content": [{"type": "input_text", "text": "Another one?"}]}]
    r = client.responses.create(model=MODEL, instructions="Answer in one word.", input=convo,
                                temperature=0, max_output_tokens=8)
    chat = _chat(smol, [{"role": "system", "content": "Answer in one word."},
                        {"role": "user", "content": "Name a colour."},
                        {"role": "assistant", "content": "Blue."},
                        {"role": "user", "content": "Another one?"}], max_tokens=8)
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens


def test_streamed_events_come_in_order_and_add_up_to_the_response(smol: App) -> None:
    events = _stream(smol, input="What is the capital of France?", max_output_tokens=20)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == events[-4].text == final.output_text == "The capital of France is Paris."
    assert final.output[0].id == events[2].item.id  # the streamed item is the final one
    assert events[0].response.status == "in_progress" and final.status == "completed"
    # Cut by max_output_tokens: incomplete, streamed or not.
    cut = smol.openai().responses.create(model=MODEL, input="What is the capital of France?",
                                         temperature=0, max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3
    events = _stream(smol, input="What is the capital of France?", max_output_tokens=3)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == cut.output_text


def test_function_calls_stream_and_round_trip(smol: App) -> None:
    client = smol.openai()
    named = {"type": "function", "name": "get_weather"}
    r = client.responses.create(model=MODEL, input=WEATHER_Q, tools=[FLAT_WEATHER],
                                tool_choice=named, temperature=0, max_output_tokens=60)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    args = json.loads(call.arguments)
    assert args["city"] in ("Paris", "London", "Rome")
    chat = _chat(smol, WEATHER_Q, tools=[WEATHER_TOOL], max_tokens=60,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert call.arguments == chat.choices[0].message.tool_calls[0].function.arguments
    events = _stream(smol, input=WEATHER_Q, tools=[FLAT_WEATHER], tool_choice=named,
                     max_output_tokens=60)
    streamed = "".join(e.delta for e in events
                       if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    final = events[-1].response
    assert streamed == done.arguments == final.output[0].arguments == call.arguments
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.call_id == final.output[0].call_id
    # The call and its output go back as input items; the model answers in text.
    follow = client.responses.create(
        model=MODEL, tools=[FLAT_WEATHER], temperature=0, max_output_tokens=30,
        input=[*WEATHER_Q, {"type": "function_call", "call_id": call.call_id,
                            "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id,
                "output": '{"temperature": 21}'}])
    assert follow.status in ("completed", "incomplete") and follow.output


def test_logprobs_and_json_schema(smol: App) -> None:
    client = smol.openai()
    r = client.responses.create(model=MODEL, input="What is the capital of France?",
                                temperature=0, max_output_tokens=8, top_logprobs=2,
                                include=["message.output_text.logprobs"])
    lps = r.output[0].content[0].logprobs
    assert len(lps) == r.usage.output_tokens and all(len(lp.top_logprobs) == 2 for lp in lps)
    assert "".join(lp.token for lp in lps).startswith(r.output_text)  # (and the EOS)
    events = _stream(smol, input="What is the capital of France?", max_output_tokens=8,
                     top_logprobs=2, include=["message.output_text.logprobs"])
    streamed = [lp.logprob for e in events if e.type == "response.output_text.delta"
                for lp in e.logprobs]
    assert streamed == [lp.logprob for lp in lps]
    schema = {"type": "object", "properties": {"capital": {"type": "string"}},
              "required": ["capital"], "additionalProperties": False}
    r = client.responses.create(
        model=MODEL, input="What is the capital of France? Answer in JSON.", temperature=0,
        max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    assert set(json.loads(r.output_text)) == {"capital"}


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "hi", "previous_response_id": "resp_123"}, "previous_response_id"),
    ({"input": "hi", "max_output_tokens": 10**6}, "max_output_tokens"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
    ({"input": [{"type": "web_search_call"}]}, "input"),
    ({"input": []}, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "include": ["file_search_call.results"]}, "include"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, "text"),
    ({"input": "hi", "temperature": -1.0}, "temperature"),
    ({}, "input"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(smol: App, body: dict[str, Any],
                                                         param: str) -> None:
    r = _post(smol, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
