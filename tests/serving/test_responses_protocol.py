"""The Responses API body as the chat completion it runs as, without Ray (milliseconds)."""

from __future__ import annotations

import pytest

from pagedserve.cluster.protocol import APIError
from pagedserve.cluster.responses_protocol import ResponsesRequest, responses_error


def test_input_items_become_chat_messages() -> None:
    body = ResponsesRequest(instructions="Be brief.", input=[
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "w", "arguments": '{"city":"Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "21"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "25"}]},
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": "Celsius."}]}])
    chat = body.to_chat()
    got = [m.as_template_dict() for m in chat.messages]
    assert [m["role"] for m in got] == ["system", "user", "assistant", "tool", "tool", "system"]
    assert got[0]["content"] == "Be brief."
    assert [c["id"] for c in got[2]["tool_calls"]] == ["c1", "c2"]  # one assistant turn
    assert (got[3]["tool_call_id"], got[3]["content"]) == ("c1", "21")
    assert (got[4]["tool_call_id"], got[4]["content"]) == ("c2", "25")
    assert got[5]["content"] == "Celsius."


def test_settings_map_to_chat_fields() -> None:
    body = ResponsesRequest(
        input="hi", max_output_tokens=7, temperature=0.3, top_p=0.9, seed=4,
        tools=[{"type": "function", "name": "w", "parameters": {"type": "object"}}],
        tool_choice={"type": "function", "name": "w"}, top_logprobs=3,
        text={"format": {"type": "json_schema", "name": "a", "schema": {"type": "object"}}})
    chat = body.to_chat()
    assert chat.requested_max_tokens() == 7 and chat.max_tokens_param == "max_completion_tokens"
    assert (chat.temperature, chat.top_p, chat.seed) == (0.3, 0.9, 4)
    assert chat.tools == [{"type": "function", "function": {
        "name": "w", "parameters": {"type": "object"}}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "w"}}
    assert chat.logprobs and chat.top_logprobs == 3
    assert chat.response_format == {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "object"}, "strict": False}}
    plain = ResponsesRequest(input="hi").to_chat()
    assert not plain.logprobs and plain.top_logprobs is None and plain.response_format is None
    assert ResponsesRequest(input="hi", include=["message.output_text.logprobs"]
                            ).to_chat().top_logprobs == 0


@pytest.mark.parametrize(("kw", "param"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"top_logprobs": 99}, "top_logprobs"),
    ({"tools": [{"type": "file_search"}]}, "tools"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"text": {"format": "json"}}, "text"),
    ({"input": [{"role": "user", "content": 5}]}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input"),
    ({"input": [{"type": "computer_call"}]}, "input"),
])
def test_what_a_chat_cannot_carry_names_the_responses_field(kw: dict, param: str) -> None:
    with pytest.raises(APIError) as e:
        ResponsesRequest(**{"input": "hi", **kw}).to_chat()
    assert e.value.param == param, e.value.message


def test_chat_errors_are_renamed() -> None:
    e = responses_error(APIError("max_completion_tokens must be at least 1",
                                 param="max_completion_tokens"))
    assert (e.param, e.message) == ("max_output_tokens", "max_output_tokens must be at least 1")
    e = responses_error(APIError("messages too long", param="messages", code="context_length"))
    assert (e.param, e.code, e.status) == ("input", "context_length", 400)
