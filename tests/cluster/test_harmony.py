"""GPT-OSS's harmony format (``cluster/harmony.py``, ``--reasoning-parser openai_gptoss``):
whole answers split into reasoning, content and tool calls; any chunking of a stream
gives the same split (markers cut across deltas are held back, never shown); the chat
and Responses shapes built from it, streamed or not; constrained requests refused."""

from __future__ import annotations

import itertools
import json
import random
from typing import Any

import pytest

from pagedserve.cluster.chat_protocol import ChatCompletionRequest
from pagedserve.cluster.harmony import (
    HARMONY,
    HarmonyStream,
    harmony_message,
    harmony_params,
    split_harmony,
)
from pagedserve.cluster.protocol import APIError
from pagedserve.cluster.reasoning import ReasoningStream, defer_constraint, split_reasoning
from pagedserve.cluster.responses import Formatter, ResponseState
from pagedserve.cluster.tools import ToolContext
from pagedserve.cluster.wire import EngineChunk, SampleDelta
from pagedserve.scheduler.sampling_params import StructuredOutputs

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}
THINK = "<|channel|>analysis<|message|>The user wants Paris.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>Paris is the capital.<|return|>"
CALL_AFTER = ("<|start|>assistant<|channel|>commentary to=functions.get_weather "
              '<|constrain|>json<|message|>{"city":"Paris"}<|call|>')
CALL_BEFORE = ('<|start|>assistant to=functions.get_weather<|channel|>commentary json'
               '<|message|>{"city": "Paris"}<|call|>')

CASES: list[tuple[str, str | None, str | None, list[tuple[str, str]]]] = [
    # (answer, reasoning, content, [(function, arguments)])
    (THINK + FINAL, "The user wants Paris.", "Paris is the capital.", []),
    (THINK + FINAL[:-len("<|return|>")], "The user wants Paris.", "Paris is the capital.",
     []),  # the end-of-answer token's text left out
    (THINK + CALL_AFTER, "The user wants Paris.", None, [("get_weather", '{"city":"Paris"}')]),
    (THINK + CALL_BEFORE, "The user wants Paris.", None,
     [("get_weather", '{"city": "Paris"}')]),
    # a call first: the recipient stands right after the prompt's <|start|>assistant
    (' to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Oslo"}<|call|>',
     None, None, [("get_weather", '{"city":"Oslo"}')]),
    # a preamble (commentary to no one) is content; the call follows it
    ("<|channel|>commentary<|message|>Let me look that up.<|end|>" + CALL_AFTER, None,
     "Let me look that up.", [("get_weather", '{"city":"Paris"}')]),
    ("<|channel|>final<|message|>Paris.<|return|>", None, "Paris.", []),
    # two thoughts are joined by a newline, as in vLLM
    (THINK + "<|start|>assistant<|channel|>analysis<|message|>Easy.<|end|>" + FINAL,
     "The user wants Paris.\nEasy.", "Paris is the capital.", []),
    # cut short by max_tokens: what it had stays where it was
    ("<|channel|>analysis<|message|>The user wa", "The user wa", None, []),
    (THINK + "<|start|>assistant<|channel|>fin", "The user wants Paris.", None, []),
    (THINK + '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>'
     'json<|message|>{"city": "Par', "The user wants Paris.", '{"city": "Par', []),
    ("<|channel|>commentary to=functions.ping<|message|><|call|>", None, None,
     [("ping", "{}")]),
    # a built-in tool's call (browser, python) is not the client's: dropped
    (THINK + "<|start|>assistant<|channel|>commentary to=browser.search <|constrain|>json"
     '<|message|>{"query":"Paris"}<|call|>', "The user wants Paris.", None, []),
    # other markers inside a body are stripped
    ("<|channel|>final<|message|>Par<|reserved_200013|>is<|return|>", None, "Paris", []),
    # no harmony at all: plain content, marker-like text included
    ("Paris is the capital.", None, "Paris is the capital.", []),
    ("a <| b |> c <|x", None, "a <| b |> c <|x", []),
    ("to=be or not", None, "to=be or not", []),
    ("to", None, "to", []),
    ("", None, "", []),
]


def _calls(calls: list[dict[str, Any]]) -> list[tuple[str, str]]:
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), CASES)
def test_whole_answers_split_into_reasoning_content_and_calls(
        text: str, reasoning: str | None, content: str | None,
        calls: list[tuple[str, str]]) -> None:
    got_reasoning, got_content, got_calls = split_harmony(text)
    assert (got_reasoning, got_content, _calls(got_calls)) == (reasoning, content, calls)
    assert split_reasoning(HARMONY, text) == (reasoning, content)  # the parser's dispatch


def _stream(pieces: list[str]) -> tuple[str, str, list[tuple[str, str]]]:
    s = ReasoningStream(HARMONY)
    thought = answer = ""
    for p in pieces:
        r, c = s.feed(p)
        thought, answer = thought + r, answer + c
    r, c = s.finish()
    return thought + r, answer + c, _calls(s.calls)


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), CASES)
def test_every_chunking_gives_the_same_split(text: str, reasoning: str | None,
                                             content: str | None,
                                             calls: list[tuple[str, str]]) -> None:
    """Cut at every character boundary (one and two cuts, each character alone, and
    random cuts): the same split as the whole answer, and no marker ever shown."""
    want = (reasoning or "", content or "", calls)
    cuts = range(1, len(text))
    splits = [[c] for c in cuts] + [list(cuts)]
    splits += [list(c) for c in itertools.combinations(cuts, 2)][::7]
    rng = random.Random(0)
    splits += [sorted(rng.sample(cuts, min(len(cuts), 6))) for _ in range(30)]
    for cut in splits:
        bounds = [0, *cut, len(text)]
        pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
        assert _stream(pieces) == want, pieces


def test_a_marker_cut_across_deltas_is_held_back() -> None:
    s = HarmonyStream()
    assert s.feed("<|chan") == ("", "")  # the answer's start is undecided
    assert s.feed("nel|>analysis<|message|>abc<|en") == ("abc", "")
    assert s.feed("d|><|start|>assistant<|channel|>final<|message|>Hi <") == ("", "Hi ")
    assert s.feed("|ret") == ("", "")
    assert s.feed("urn|>") == ("", "")
    assert s.finish() == ("", "")
    plain = HarmonyStream()
    assert plain.feed(" t") == ("", "")  # may be a recipient (" to=functions...")
    assert plain.feed("oday") == ("", " today")
    assert plain.feed(" 1 <") == ("", " 1 ")
    assert plain.feed("2") == ("", "<2")
    assert plain.finish() == ("", "")


def test_chat_message_shapes_and_finish_reasons() -> None:
    auto = ToolContext.from_request([WEATHER], "auto", None)
    none = ToolContext.from_request([WEATHER], "none", None)
    message, finish = harmony_message(THINK + CALL_AFTER, auto, True, "stop")
    assert finish == "tool_calls" and message["content"] is None
    assert message["reasoning"] == message["reasoning_content"] == "The user wants Paris."
    assert _calls(message["tool_calls"]) == [("get_weather", '{"city":"Paris"}')]
    for tools in (None, none):  # no tools offered, or none to call: no calls
        message, finish = harmony_message(THINK + CALL_AFTER, tools, True, "stop")
        assert finish == "stop" and "tool_calls" not in message
    message, finish = harmony_message(THINK + FINAL, auto, False, "stop")
    assert message == {"role": "assistant", "content": "Paris is the capital."}
    assert finish == "stop"


def _chat(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw)


@pytest.mark.parametrize(("fields", "param"), [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"guided_choice": ["a", "b"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "[0-9]+"}}, "structured_outputs"),
    ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function",
                                          "function": {"name": "get_weather"}}},
     "tool_choice"),
])
def test_constrained_requests_are_refused_naming_the_field(fields: dict[str, Any],
                                                           param: str) -> None:
    """A grammar under harmony would have to start after the final channel's header,
    which it cannot: a 400 naming the field, not a wrong answer."""
    body = _chat(**fields)
    tools = ToolContext.from_request(body.tools, body.tool_choice, None)
    params = body.sampling_params(16, None, None, tools.structured() if tools else None)
    with pytest.raises(APIError) as e:
        defer_constraint(params, HARMONY, False, body)
    assert e.value.param == param and HARMONY in e.value.message


def test_harmony_requests_keep_special_tokens() -> None:
    body = _chat(response_format={"type": "text"})
    params = harmony_params(body.sampling_params(16, None), body)
    assert params.skip_special_tokens is False and params.structured_outputs is None
    other = defer_constraint(_chat().sampling_params(16, None), "qwen3", False, None)
    assert other.skip_special_tokens is True


def test_a_grammar_cannot_skip_a_harmony_thought() -> None:
    with pytest.raises(ValueError, match=r"structured_outputs\.reasoning"):
        StructuredOutputs(regex="[0-9]", reasoning=HARMONY)


def test_the_parser_is_a_serve_option_and_a_cli_flag() -> None:
    from pagedserve.cluster.cli import build_parser
    from pagedserve.cluster.serve_args import ServeArgs

    assert ServeArgs(reasoning_parser=HARMONY).reasoning_parser == HARMONY
    ns = build_parser().parse_args(["serve", "--reasoning-parser", "openai_gptoss"])
    assert ServeArgs.parse(ns).reasoning_parser == HARMONY


class _Tok:
    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(range(len(text.split())))


def _chunks(text: str, size: int) -> list[EngineChunk]:
    """``text`` as engine chunks of ``size`` characters (a token per character)."""
    parts = [text[i:i + size] for i in range(0, len(text), size)]
    return [EngineChunk("r", "rep", [SampleDelta(0, p, [0] * len(p), finish_reason=(
        "stop" if k == len(parts) - 1 else None))], 3, 0, k == len(parts) - 1)
        for k, p in enumerate(parts)]


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_chat_responses_agree_streamed_or_not(size: int) -> None:
    """The Formatter's whole message and its streamed deltas carry the same thought,
    content and calls; no marker reaches the client either way."""
    text = (THINK + "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
            + CALL_AFTER)
    tools = ToolContext.from_request([WEATHER], "auto", None)
    fmt = Formatter(_Tok(), "m")
    whole = ResponseState("chat.completion", "a", [(3, 1)], False, tools=tools,
                          reasoning=HARMONY)
    for c in _chunks(text, size):
        fmt.add(whole, 0, c)
    choice = fmt.full_response(whole)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert (msg["reasoning"], msg["content"]) == ("The user wants Paris.", "Checking.")
    streamed = ResponseState("chat.completion", "b", [(3, 1)], False, tools=tools,
                             reasoning=HARMONY)
    events = [e for c in _chunks(text, size) for e in fmt.stream_chunks(streamed, 0, c, False)]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("reasoning") or "" for d in deltas) == msg["reasoning"]
    assert "".join(d.get("content") or "" for d in deltas) == msg["content"]
    calls = [c for d in deltas for c in d.get("tool_calls") or []]
    assert [(c["index"], c["function"]) for c in calls] == [
        (k, c["function"]) for k, c in enumerate(msg["tool_calls"])]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert "<|" not in json.dumps(events) + json.dumps(choice)


def test_responses_api_items_from_a_harmony_answer() -> None:
    """The Responses API shares the chat path: a reasoning item, the preamble's
    message, then the function call, streamed or not."""
    from pagedserve.cluster.responses_api import ResponseBuilder
    from pagedserve.cluster.responses_protocol import ResponsesRequest

    text = THINK + "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>" \
        + CALL_AFTER
    body = ResponsesRequest(model="m", input="Weather in Paris?", tools=[
        {"type": "function", "name": "get_weather", "parameters": WEATHER["function"][
            "parameters"]}])
    tools = ToolContext.from_request([WEATHER], "auto", None)
    fmt = Formatter(_Tok(), "m")
    st = ResponseState("chat.completion", "r", [(3, 1)], False, tools=tools, reasoning=HARMONY)
    builder = ResponseBuilder(body, "resp_1", "m", fmt)
    for c in _chunks(text, 4):
        for chunk in fmt.stream_chunks(st, 0, c, False):
            builder.feed(chunk)
    builder.finish(st)
    out = builder.final["output"]
    assert [o["type"] for o in out] == ["reasoning", "message", "function_call"]
    assert out[0]["content"][0]["text"] == "The user wants Paris."
    assert out[1]["content"][0]["text"] == "Checking."
    assert (out[2]["name"], out[2]["arguments"]) == ("get_weather", '{"city":"Paris"}')
    whole = ResponseState("chat.completion", "w", [(3, 1)], False, tools=tools,
                          reasoning=HARMONY)
    for c in _chunks(text, 1000):
        fmt.add(whole, 0, c)
    again = ResponseBuilder(body, "resp_2", "m", fmt).response(whole)
    assert [o["type"] for o in again["output"]] == ["reasoning", "message", "function_call"]
    assert again["status"] == "completed"


def test_a_gpt_oss_checkpoint_defaults_to_harmony(tmp_path) -> None:
    """GPT-OSS's chat answers are always harmony messages: its app parses them without
    ``--reasoning-parser`` (as vLLM does); other files, or none, keep no parser."""
    import json

    from pagedserve.cluster.harmony import default_parser

    for model_type, want in (("gpt_oss", "openai_gptoss"), ("llama", None)):
        d = tmp_path / model_type
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": model_type}))
        assert default_parser(str(d)) == want
    assert default_parser(str(tmp_path / "missing")) is None
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("[")
    assert default_parser(str(tmp_path / "bad")) is None
