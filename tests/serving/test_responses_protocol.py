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


@pytest.mark.parametrize(("kw", "has_store", "param"), [
    ({"previous_response_id": "resp_1"}, False, "previous_response_id"),
    ({"background": True}, False, "background"),
    ({"background": True, "store": False}, True, "background"),
])
def test_what_needs_a_store_it_cannot_have_is_refused(kw: dict, has_store: bool,
                                                      param: str) -> None:
    with pytest.raises(APIError) as e:
        ResponsesRequest(**{"input": "hi", **kw}).check_storage(has_store)
    assert e.value.param == param, e.value.message


def test_storage_follows_store_and_the_server() -> None:
    assert ResponsesRequest(input="hi").check_storage(True) is True  # OpenAI's default
    assert ResponsesRequest(input="hi", store=False).check_storage(True) is False
    assert ResponsesRequest(input="hi", store=True).check_storage(False) is False


def test_input_items_get_ids_and_a_stored_conversation_leads_the_chat() -> None:
    body = ResponsesRequest(instructions="Be brief.", input="And Rome?")
    (item,) = body.input_items()
    assert item["id"].startswith("msg_") and item["type"] == "message"
    assert item["content"] == [{"type": "input_text", "text": "And Rome?"}]
    # A stored turn: its input and output items (ids, statuses, annotations kept).
    history = [{"id": "msg_1", "type": "message", "role": "user",
                "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
               {"id": "rs_1", "type": "reasoning", "summary": [], "content": []},
               {"id": "msg_2", "type": "message", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": "Sunny.", "annotations": [],
                             "logprobs": []}]}]
    got = [m.as_template_dict() for m in body.to_chat([*history, item]).messages]
    assert got == [{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": "Weather in Paris?"},
                   {"role": "assistant", "content": "Sunny."},
                   {"role": "user", "content": "And Rome?"}]


def test_chat_errors_are_renamed() -> None:
    e = responses_error(APIError("max_completion_tokens must be at least 1",
                                 param="max_completion_tokens"))
    assert (e.param, e.message) == ("max_output_tokens", "max_output_tokens must be at least 1")
    e = responses_error(APIError("messages too long", param="messages", code="context_length"))
    assert (e.param, e.code, e.status) == ("input", "context_length", 400)


def test_vllm_stop_extras_reach_the_chat() -> None:
    chat = ResponsesRequest(input="hi", stop=["\n"], ignore_eos=True).to_chat()
    params = chat.sampling_params(8, None, 49152)
    assert params.stop == ["\n"] and params.ignore_eos is True
