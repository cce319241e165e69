"""The reasoning parsers (``cluster/reasoning.py``): whole outputs split as vLLM's
``qwen3`` and ``deepseek_r1`` parsers do, and any chunking of a stream gives the same
split (tags cut across deltas are held back, never leaked into content); extra chat
template variables reach the template."""

from __future__ import annotations

import itertools
import random

import pytest

from pagedserve.cluster.reasoning import ReasoningStream, split_reasoning

CASES = [
    # (parser, output, reasoning, content)
    ("qwen3", "<think>\nthe user wants Paris\n</think>\n\nParis.", "\nthe user wants Paris\n",
     "\n\nParis."),
    ("qwen3", "Paris.", None, "Paris."),  # thinking off: no tags at all
    ("qwen3", "<think>cut short by max_tok", "cut short by max_tok", None),
    ("qwen3", "<think>all thought</think>", "all thought", None),
    ("qwen3", "a <think>b</think> c", None, "a <think>b</think> c"),  # not at the start
    ("qwen3", "<thin", None, "<thin"),  # a tag's beginning that never completes
    ("qwen3", "", None, ""),
    ("deepseek_r1", "opened by the template</think>answer", "opened by the template", "answer"),
    ("deepseek_r1", "<think>own tag</think>answer", "own tag", "answer"),
    ("deepseek_r1", "never closed", "never closed", None),
    ("deepseek_r1", "a</thi", "a</thi", None),
    ("deepseek_r1", "x</think>y</think>z", "x", "y</think>z"),  # only the first closes
]


@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), CASES)
def test_whole_outputs_split_like_vllm(parser: str, text: str, reasoning: str | None,
                                       content: str | None) -> None:
    assert split_reasoning(parser, text) == (reasoning, content)


def _stream(parser: str, pieces: list[str]) -> tuple[str, str, bool]:
    s = ReasoningStream(parser)
    thought = answer = ""
    for p in pieces:
        r, c = s.feed(p)
        thought, answer = thought + r, answer + c
    r, c = s.finish()
    return thought + r, answer + c, s.thought


@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), CASES)
def test_every_chunking_gives_the_same_split(parser: str, text: str, reasoning: str | None,
                                             content: str | None) -> None:
    want = (reasoning or "", content or "")
    cuts = range(1, len(text))
    splits = [list(c) for n in (1, 2) for c in itertools.combinations(cuts, n)]
    rng = random.Random(0)
    splits += [sorted(rng.sample(cuts, min(len(cuts), 5))) for _ in range(20)]
    for cut in splits:
        bounds = [0, *cut, len(text)]
        pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
        thought, answer, thinking = _stream(parser, pieces)
        assert (thought, answer) == want, pieces
        assert thinking == (reasoning is not None)
    assert _stream(parser, list(text))[:2] == want  # one character at a time


def test_a_tag_split_across_deltas_is_held_back() -> None:
    s = ReasoningStream("qwen3")
    assert s.feed("<th") == ("", "")
    assert s.feed("ink>why") == ("why", "")
    assert s.feed(" so</th") == (" so", "")
    assert s.feed("ink>Because") == ("", "Because")
    assert s.finish() == ("", "")


def test_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="reasoning_parser"):
        ReasoningStream("granite")


def test_template_kwargs_reach_the_chat_template() -> None:
    from pagedserve.cluster.tools import chat_prompt_ids
    from pagedserve.worker.loaders import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(None))
    tok.chat_template = ("{% if enable_thinking is defined and not enable_thinking %}"
                         "<think></think>{% endif %}{{ messages[0]['content'] }}")
    msgs = [{"role": "user", "content": "hi"}]
    on = chat_prompt_ids(tok, msgs, True, None)
    off = chat_prompt_ids(tok, msgs, True, None, {"enable_thinking": False})
    assert tok.decode(on) == "hi" and tok.decode(off) == "<think></think>hi"


def test_beam_search_answers_are_split_too() -> None:
    import json

    from pagedserve.cluster.beam_serving import beam_response, beam_stream_events

    results = [{"prompt_tokens": 3, "sequences": [
        {"token_ids": [1, 2], "text": "<think>hm</think>Paris", "finish_reason": "stop"},
        {"token_ids": [3], "text": "Rome", "finish_reason": "length"}]}]
    out = beam_response("chat.completion", "id", "m", results, "qwen3")
    first, second = (c["message"] for c in out["choices"])
    assert (first["reasoning"], first["content"]) == ("hm", "Paris")
    assert (second["reasoning"], second["content"]) == (None, "Rome")
    events = [json.loads(e[len("data: "):]) for e in beam_stream_events(out, False)
              if e.startswith("data: {")]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Paris",
                                                "reasoning": "hm", "reasoning_content": "hm"}
    hidden = beam_response("chat.completion", "id", "m", results, "qwen3", False)
    assert hidden["choices"][0]["message"] == {"role": "assistant", "content": "Paris"}


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_a_prompt_that_closed_the_thought_leaves_only_content(parser: str) -> None:
    from pagedserve.cluster.reasoning import defer_constraint, thought_closed
    from pagedserve.scheduler.sampling_params import SamplingParams, StructuredOutputs
    from pagedserve.worker.loaders import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(None))
    closed = tok.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert thought_closed(tok, closed) and not thought_closed(tok, tok.encode("assistant\n"))
    assert split_reasoning(parser, "answer</think>x", closed=True) == (None, "answer</think>x")
    s = ReasoningStream(parser, closed=True)
    assert s.feed("<thi") == ("", "<thi") and s.finish() == ("", "")
    spec = StructuredOutputs(regex="a")
    assert defer_constraint(SamplingParams(structured_outputs=spec), parser, True
                            ).structured_outputs.reasoning is None
    assert defer_constraint(SamplingParams(structured_outputs=spec), parser, False
                            ).structured_outputs.reasoning == parser


def test_offline_chat_takes_template_kwargs(smol_llm) -> None:
    from pagedserve.cluster import SamplingParams

    tok = smol_llm.get_tokenizer()
    saved = tok.chat_template
    tok.chat_template = ("{% if enable_thinking is defined and not enable_thinking %}"
                         "<think></think>{% endif %}{{ messages[0]['content'] }}")
    try:
        msgs = [{"role": "user", "content": "hi"}]
        params = SamplingParams(max_tokens=1, temperature=0.0)
        on = smol_llm.chat(msgs, params)[0]
        off = smol_llm.chat(msgs, params, chat_template_kwargs={"enable_thinking": False})[0]
    finally:
        tok.chat_template = saved
    assert tok.decode(on.prompt_token_ids) == "hi"
    assert tok.decode(off.prompt_token_ids) == "<think></think>hi"
