"""Reasoning outputs (vLLM's ``--reasoning-parser``): what a thinking model writes
between ``<think>`` and ``</think>`` goes to the chat message's ``reasoning`` (and
``reasoning_content``, vLLM's earlier name), the rest to ``content``.

Two parsers, as vLLM names them: ``qwen3`` (Qwen3 writes ``<think>`` itself; an
output that does not begin with it, e.g. with ``chat_template_kwargs:
{"enable_thinking": false}``, is all content) and ``deepseek_r1`` (DeepSeek-R1
and QwQ, whose templates may already open the thought in the prompt: everything
up to ``</think>`` is reasoning, a leading ``<think>`` dropped). A thought cut
short by ``max_tokens`` stays reasoning. A prompt that already closed the thought
(``thought_closed``: Qwen3's template with ``enable_thinking: false``) makes the
whole answer content, with either parser.

The split works on text, one stream per choice, so streamed and whole answers
agree: a delta that may be the start of a tag is held back until the next one
shows what it is. Tool calls are parsed from the content only. Output
constraints (``response_format``, structured outputs, a forced tool call) start
after the thought, as in vLLM (``defer_constraint``).

A third parser, ``openai_gptoss`` (GPT-OSS's harmony messages: an ``analysis``
channel, a ``final`` one, tool calls to ``functions.NAME``), is ``harmony``'s;
the stream and the split hand over to it, and its requests keep special tokens
and take no output constraint (``harmony_params``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pagedserve.cluster.harmony import HARMONY, HarmonyStream, harmony_params, split_harmony
from pagedserve.scheduler.sampling_params import REASONING_FORMATS, SamplingParams

REASONING_PARSERS = REASONING_FORMATS
START, END = "<think>", "</think>"


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """One choice's text, split into reasoning and content as it arrives."""

    def __init__(self, parser: str, closed: bool = False) -> None:
        """``closed``: the prompt already ended the thought; all of it is content."""
        if parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {list(REASONING_PARSERS)}, "
                             f"got {parser!r}")
        self.parser = parser
        self.mode = "content" if closed else "start"  # then "reasoning" or "content"
        self.held = ""
        self.thought = False  # whether any of the output is reasoning
        self.harmony = HarmonyStream() if parser == HARMONY else None

    @property
    def calls(self) -> list[dict[str, Any]]:
        """The tool calls a harmony answer made (none in the ``<think>`` formats)."""
        return self.harmony.calls if self.harmony is not None else []

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and content ``text`` adds (either may be empty)."""
        if self.harmony is not None:
            out = self.harmony.feed(text)
            self.thought = self.harmony.thought
            return out
        buf, self.held = self.held + text, ""
        reasoning = content = ""
        while buf:
            if self.mode == "start":
                if buf.startswith(START):
                    buf, self.mode, self.thought = buf[len(START):], "reasoning", True
                elif START.startswith(buf):
                    self.held = buf  # "<th": wait for the rest
                    break
                elif self.parser == "deepseek_r1":
                    self.mode, self.thought = "reasoning", True
                else:
                    self.mode = "content"
            elif self.mode == "reasoning":
                end = buf.find(END)
                if end >= 0:
                    reasoning += buf[:end]
                    buf, self.mode = buf[end + len(END):], "content"
                    continue
                keep = _partial_tag(buf, END)
                reasoning += buf[:len(buf) - keep]
                self.held = buf[len(buf) - keep:]
                break
            else:
                content += buf
                break
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, once the output has ended."""
        if self.harmony is not None:
            out = self.harmony.finish()
            self.thought = self.harmony.thought
            return out
        rest, self.held = self.held, ""
        if self.mode == "reasoning" or (self.mode == "start" and self.parser == "deepseek_r1"):
            self.thought = self.thought or bool(rest)
            return rest, ""
        return "", rest


def thought_closed(tokenizer: Any, prompt_ids: list[int]) -> bool:
    """Whether the prompt ends with a closed thought (Qwen3's template with
    ``enable_thinking: false`` writes an empty ``<think></think>`` itself)."""
    return tokenizer.decode(prompt_ids[-8:]).rstrip().endswith(END)


def defer_constraint(params: SamplingParams, parser: str | None, closed: bool,
                     request: Any = None) -> SamplingParams:
    """Under a reasoning parser, let a constrained chat answer think first (the
    grammar starts after ``</think>``), unless the prompt already ``closed`` it.
    Under ``openai_gptoss``, keep special tokens and refuse a constraint with a 400
    naming ``request``'s field (``harmony_params``)."""
    if parser == HARMONY:
        return harmony_params(params, request)
    spec = params.structured_outputs
    if parser is None or closed or spec is None or spec.reasoning is not None:
        return params
    params.structured_outputs = dataclasses.replace(spec, reasoning=parser)
    return params


def split_reasoning(parser: str, text: str, closed: bool = False
                    ) -> tuple[str | None, str | None]:
    """A whole output's ``(reasoning, content)``: reasoning None when the model did not
    think; content None when a thought is all there is (vLLM's shapes). A harmony
    answer's tool calls are ``harmony.split_harmony``'s."""
    if parser == HARMONY:
        return split_harmony(text)[:2]
    stream = ReasoningStream(parser, closed)
    r1, c1 = stream.feed(text)
    r2, c2 = stream.finish()
    if not stream.thought:
        return None, c1 + c2
    return r1 + r2, (c1 + c2) or None
