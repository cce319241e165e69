"""Tool calling without a server: request checks, the output constraints each
``tool_choice`` imposes, parsing finished outputs, and streaming (content shown at once,
``<tool_call>`` blocks held back, even when the tag is split across deltas), and
Mistral's ``[TOOL_CALLS]`` through a real tokenizer's incremental detokenisation."""

from __future__ import annotations

import json

import pytest

from pagedserve.cluster.protocol import APIError
from pagedserve.cluster.tools import (
    ToolContext,
    ToolStream,
    mistral_tool_format,
    parse_hermes,
    parse_json_calls,
    parse_mistral,
    template_messages,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


@pytest.mark.parametrize("tools,choice,param", [
    (None, "required", "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
    ([{"type": "function", "function": {}}], None, "tools"),
    ([WEATHER, WEATHER], None, "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, "tools"),
])
def test_bad_tools_or_choice_name_the_field(tools, choice, param) -> None:
    with pytest.raises(APIError) as e:
        ToolContext.from_request(tools, choice, None)
    assert e.value.body()["error"]["param"] == param


def test_each_choice_constrains_the_output_with_a_schema_xgrammar_accepts() -> None:
    from pagedserve.worker.structured import check_structured_outputs

    assert ToolContext.from_request(None, None, None) is None
    auto = ToolContext.from_request([WEATHER], None, None)
    assert auto.mode == "auto" and auto.structured() is None
    assert ToolContext.from_request([WEATHER], "none", None).structured() is None
    named = ToolContext.from_request([WEATHER, TIME], {"type": "function",
                                                       "function": {"name": "get_time"}}, None)
    assert named.structured().json == TIME["function"]["parameters"]
    req = ToolContext.from_request([WEATHER, TIME], "required", False).structured()
    assert req.json["maxItems"] == 1 and len(req.json["items"]["anyOf"]) == 2
    for spec in (named.structured(), req):
        check_structured_outputs(spec)


def test_finished_outputs_become_calls() -> None:
    named = ToolContext.from_request([WEATHER], {"type": "function",
                                                 "function": {"name": "get_weather"}}, None)
    content, calls = named.parse('{"city": "Paris"}')
    assert content is None and calls[0]["function"] == {"name": "get_weather",
                                                        "arguments": '{"city": "Paris"}'}
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert named.finish_reason(calls, "stop") == "stop"  # forced: the engine's reason
    assert named.parse('{"city": "Pa') == ('{"city": "Pa', [])  # cut by max_tokens

    req = ToolContext.from_request([WEATHER, TIME], "required", None)
    content, calls = req.parse('[{"name": "get_time", "parameters": {"zone": "UTC"}}, '
                               '{"name": "get_weather", "parameters": {"city": "Oslo"}}]')
    assert content is None and [c["function"]["name"] for c in calls] == ["get_time",
                                                                          "get_weather"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Oslo"}
    assert req.finish_reason(calls, "stop") == "tool_calls"


def test_hermes_blocks_of_known_functions_become_calls() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call>\n<tool_call>{"name": "get_time", '
            '"arguments": {"zone": "CET"}}</tool_call>')
    content, calls = parse_hermes(text, {"get_weather", "get_time"})
    assert content == "Let me check."
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"},
                                                                       {"zone": "CET"}]
    assert parse_hermes("no calls here", {"get_weather"}) == ("no calls here", [])
    bad = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert parse_hermes(bad, {"get_weather"}) == (bad, [])  # unknown function: text
    broken = "<tool_call>{not json}</tool_call>"
    assert parse_hermes(broken, {"get_weather"}) == (broken, [])


def _stream(ctx: ToolContext, text: str, size: int) -> tuple[str, list[dict]]:
    ts = ToolStream(ctx)
    shown = "".join(ts.feed(text[i:i + size]) for i in range(0, len(text), size))
    rest, calls = ts.finish()
    return shown + rest, calls


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_streaming_holds_back_the_call_and_shows_the_rest(size: int) -> None:
    auto = ToolContext.from_request([WEATHER], "auto", None)
    text = ('Sure, one moment <tool_call>{"name": "get_weather", "arguments": '
            '{"city": "Rome"}}</tool_call>')
    ts = ToolStream(auto)
    shown = ""
    for i in range(0, len(text), size):
        shown += ts.feed(text[i:i + size])
        assert "<" not in shown  # never a piece of the tag
    rest, calls = ts.finish()
    assert (shown + rest).strip() == "Sure, one moment"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome"}
    # No call: everything is content, including a '<' that only looked like the tag.
    assert _stream(auto, "a < b and <tool", size) == ("a < b and <tool", [])
    named = ToolContext.from_request([WEATHER], {"type": "function",
                                                 "function": {"name": "get_weather"}}, None)
    ts, text = ToolStream(named), '{"city": "Rome"}'
    frags = [ts.named_fragment(text[i:i + size]) for i in range(0, len(text), size)]
    assert frags[0]["id"].startswith("call_") and frags[0]["function"]["name"] == "get_weather"
    assert all("id" not in f and "name" not in f["function"] for f in frags[1:])
    assert "".join(f["function"]["arguments"] for f in frags) == text
    assert ts.named_fragment("") is None


def test_template_messages_give_templates_arguments_as_objects() -> None:
    msgs = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    out = template_messages(msgs)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == '{"city": "Rome"}'  # untouched
    assert out[1] == msgs[1]


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_llama3_json_calls_in_auto(size: int) -> None:
    """Llama 3.x writes the call as the whole output (maybe after <|python_tag|>)."""
    auto = ToolContext.from_request([WEATHER, TIME], "auto", None)
    one = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    for text in (one, "<|python_tag|>" + one, f"[{one}, " + '{"name": "get_time", '
                 '"parameters": {"zone": "UTC"}}]'):
        content, calls = auto.parse(text)
        assert content is None and calls[0]["function"]["name"] == "get_weather"
        assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
        shown, streamed = _stream(auto, text, size)  # nothing shown: it was a call
        assert shown == "" and [c["function"] for c in streamed] == [
            c["function"] for c in calls]
    assert parse_json_calls('{"name": "unknown", "parameters": {}}', {"get_weather"}) == []
    assert parse_json_calls('{"city": "Oslo"}', {"get_weather"}) == []
    # JSON that is no call is content after all, streamed whole at the end.
    assert _stream(auto, '{"answer": 42}', size) == ('{"answer": 42}', [])
    assert _stream(auto, "<|im_start|> hi", size) == ("<|im_start|> hi", [])


def _short_id(call: dict) -> bool:
    return len(call["id"]) == 9 and call["id"].isalnum()


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_mistral_tool_calls_in_both_formats(size: int) -> None:
    """7B v0.3 writes ``[TOOL_CALLS] [{...}, ...]``; later models one
    ``[TOOL_CALLS]name[ARGS]{...}`` per call. Calls get 9-character ids."""
    auto = ToolContext.from_request([WEATHER, TIME], "auto", None, mistral=True)
    assert auto.keeps_special_tokens
    assert not ToolContext.from_request([WEATHER], "auto", None).keeps_special_tokens
    assert not ToolContext.from_request([WEATHER], "none", None, mistral=True
                                        ).keeps_special_tokens
    v03 = ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
           '{"name": "get_time", "arguments": {"zone": "UTC"}}]')
    v11 = ('Checking both.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'
           '[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}')
    for text, content in ((v03, None), (v11, "Checking both.")):
        got, calls = auto.parse(text)
        assert got == content
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in calls] == [("get_weather", {"city": "Oslo"}), ("get_time",
                                                                         {"zone": "UTC"})]
        assert all(_short_id(c) for c in calls)
        assert auto.finish_reason(calls, "stop") == "tool_calls"
        shown, streamed = _stream(auto, text, size)
        assert shown == (content or "")  # nothing of the marker or the calls shown
        assert [c["function"] for c in streamed] == [c["function"] for c in calls]
    # Variants later templates write: no [ARGS], and a [CALL_ID] before it.
    _, calls = parse_mistral('[TOOL_CALLS]get_time{"zone": "CET"}', {"get_time"})
    assert json.loads(calls[0]["function"]["arguments"]) == {"zone": "CET"}
    _, calls = parse_mistral('[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"zone": "CET"}',
                             {"get_time"})
    assert calls[0]["function"]["name"] == "get_time"
    # An unknown function, arguments that are no JSON object, or a call cut short by
    # max_tokens: the whole text stays content.
    for bad in ('[TOOL_CALLS]rm_rf[ARGS]{}', '[TOOL_CALLS]get_time[ARGS]{"zone": "C',
                '[TOOL_CALLS]get_time[ARGS][1]', 'Hi [TOOL_CALLS] [{"name": "x"}]',
                '[TOOL_CALLS]'):
        assert parse_mistral(bad, {"get_time"}) == (bad, [])
        assert _stream(auto, bad, size) == (bad, [])
    assert _stream(auto, "a [TOOL", size) == ("a [TOOL", [])  # only looked like the marker
    named = ToolContext.from_request([WEATHER], {"type": "function",
                                                 "function": {"name": "get_weather"}},
                                     None, mistral=True)
    assert _short_id(named.parse('{"city": "Rome"}')[1][0])
    assert _short_id(ToolStream(named).named_fragment("{"))


def test_mistral_calls_survive_incremental_detokenisation() -> None:
    """A tokenizer with Mistral's special tokens (SmolLM2's, with ``[TOOL_CALLS]`` and
    ``[ARGS]`` added): the calls reach the parser through the engine's incremental
    detokeniser only when special tokens are kept, which a Mistral tool request does."""
    from pagedserve.cluster.detokenizer import IncrementalDetokenizer
    from pagedserve.worker.loaders import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(None))
    assert not mistral_tool_format(tok)
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    assert mistral_tool_format(tok)
    auto = ToolContext.from_request([WEATHER], "auto", None, mistral=mistral_tool_format(tok))
    text = 'Let me look.[TOOL_CALLS]get_weather[ARGS]{"city": "São Paulo"}'
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.convert_tokens_to_ids("[TOOL_CALLS]") in ids
    prompt = tok.encode("Weather?", add_special_tokens=False)
    for keep in (True, False):
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=not keep)
        ts, shown = ToolStream(auto), ""
        for t in ids:
            before = len(detok.text)
            detok.add_tokens([t])
            shown += ts.feed(detok.text[before:])
        rest, calls = ts.finish()
        if keep:
            assert (shown + rest).strip() == "Let me look."
            assert json.loads(calls[0]["function"]["arguments"]) == {"city": "São Paulo"}
        else:  # the markers are gone: plain text, no call
            assert calls == [] and "[TOOL_CALLS]" not in shown + rest
