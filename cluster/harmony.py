"""OpenAI's harmony format (GPT-OSS), vLLM's ``--reasoning-parser openai_gptoss``.

A GPT-OSS answer is a run of messages after the prompt's ``<|start|>assistant``,
each a header, ``<|message|>``, a body and an end marker::

    <|channel|>analysis<|message|>THOUGHT<|end|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>
    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{...}<|call|>

(the recipient ``to=`` may also stand before ``<|channel|>``). The body of an
``analysis`` message is reasoning; of a ``final`` one, and of a ``commentary``
one with no recipient (a preamble), content; a message to ``functions.NAME`` is a
tool call whose body is its JSON arguments. Messages to other recipients (the
built-in browser and python tools, which this server does not run) are dropped,
as vLLM drops them, unless on the analysis channel. Several messages of one kind
are joined by newlines, as in vLLM.

Why parse text rather than tokens (vLLM runs ``openai_harmony``'s token parser):
that package downloads its encoding at first use, and the text already holds
every marker once the request keeps special tokens (``harmony_params``), the way
a Mistral tool request keeps ``[TOOL_CALLS]``. Every ``<|...|>`` marker is
stripped; none reaches the client.

The parser reads the text delta by delta and gives the same split whole or
streamed: a tail that may be the start of a marker is held back until the next
delta shows what it is. An answer cut short (``max_tokens``) keeps what it had:
a thought stays reasoning; a call whose arguments are not JSON (cut, or just
malformed) is no call and its text is content, the repository's rule for tool
calls that do not parse. An answer with no harmony header is plain content.

Output constraints are refused under this parser: the grammar would have to
start after ``<|channel|>final<|message|>``, which the worker's grammar cannot
express today (its thought grammars are the ``<think>`` formats).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pagedserve.cluster.protocol import APIError
from pagedserve.cluster.tools import _call
from pagedserve.scheduler.sampling_params import SamplingParams

HARMONY = "openai_gptoss"
MESSAGE, START, CHANNEL = "<|message|>", "<|start|>", "<|channel|>"
# What ends a message: <|return|> and <|call|> end the answer too (EOS ids).
_ENDS = frozenset({"<|end|>", "<|return|>", "<|call|>", "<|endoftext|>"})
_MARKER = re.compile(r"<\|[A-Za-z0-9_]{1,40}\|>")
_PARTIAL = re.compile(r"<(?:\|[A-Za-z0-9_]{0,40}\|?)?\Z")  # a marker's beginning, at the end
_RECIPIENT = re.compile(r"(?:^|[\s>])to=([^\s<]+)")
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
_HEADER_START = re.compile(r"\s*to=")  # an answer may open with its recipient
_MAYBE_HEADER_START = re.compile(r"\s*(?:to?)?")
FUNCTIONS = "functions."
_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
           "guided_choice", "guided_grammar")


class HarmonyStream:
    """One choice's harmony text, split into reasoning, content and tool calls as it
    arrives (``feed``, then ``finish``)."""

    def __init__(self) -> None:
        self.state = "start"  # then "header" (until <|message|>) or "body"
        self.held = ""  # text not parsed yet: the undecided start, or a marker's beginning
        self.header = ""  # the open message's header so far
        self.route = "content"  # where the open body goes: reasoning, content, call, drop
        self.name = ""  # the open call's function
        self.args: list[str] = []  # the open call's body
        self.opened = False  # whether the open body has shown text yet
        self.shown = {"reasoning": False, "content": False}
        self.marked = False  # whether any marker has been read
        self.thought = False  # whether the answer has an analysis message
        self.calls: list[dict[str, Any]] = []  # OpenAI tool calls, in order

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and content ``text`` adds (either may be empty)."""
        buf, self.held = self.held + text, ""
        out: dict[str, list[str]] = {"reasoning": [], "content": []}
        if self.state == "start" and not self._decide(buf, final=False):
            self.held = buf
            return "", ""
        pos = 0
        for m in _MARKER.finditer(buf):
            self._text(buf[pos:m.start()], out)
            self._marker(m.group(), out)
            pos = m.end()
        rest = buf[pos:]
        partial = _PARTIAL.search(rest)
        cut = partial.start() if partial else len(rest)
        self._text(rest[:cut], out)
        self.held = rest[cut:]
        return "".join(out["reasoning"]), "".join(out["content"])

    def finish(self) -> tuple[str, str]:
        """What the held tail and the open message add once the answer has ended."""
        rest, self.held = self.held, ""
        out: dict[str, list[str]] = {"reasoning": [], "content": []}
        if self.state == "start":
            self._decide(rest, final=True)
        self._text(rest, out)  # (no marker can complete now: it is text)
        if self.state == "body":
            self._close(out)
        elif not self.marked:
            self._emit("content", self.header, out)  # "to=..." that was only text
        self.state, self.header = "header", ""
        return "".join(out["reasoning"]), "".join(out["content"])

    def _decide(self, buf: str, final: bool) -> bool:
        """Whether the answer's beginning shows what it is: a header (a marker, or a
        recipient first) or plain text; until then (``<|cha``, ``to``) it waits."""
        if _MARKER.match(buf) or _HEADER_START.match(buf):
            self.state = "header"
        elif not final and (_PARTIAL.match(buf) or _MAYBE_HEADER_START.fullmatch(buf)):
            return False
        else:
            self.state = "body"  # no header: a plain answer, all content
        return True

    def _text(self, text: str, out: dict[str, list[str]]) -> None:
        if not text:
            return
        if self.state == "header":
            self.header += text
        elif self.route == "call":
            self.args.append(text)
        elif self.route != "drop":
            self._emit(self.route, text, out)

    def _emit(self, route: str, text: str, out: dict[str, list[str]]) -> None:
        """Show ``text`` as ``route``; a message's first text after an earlier message
        of the same kind starts on a new line."""
        if not text:
            return
        if not self.opened and self.shown[route]:
            out[route].append("\n")
        out[route].append(text)
        self.opened = self.shown[route] = True

    def _marker(self, marker: str, out: dict[str, list[str]]) -> None:
        self.marked = True
        if self.state == "body":
            if marker in _ENDS or marker in (START, CHANNEL):  # (a missed <|end|>)
                self._close(out)
                self.state, self.header = "header", marker if marker == CHANNEL else ""
            return  # any other marker inside a body is dropped
        if marker == MESSAGE:
            self._open()
        elif marker in _ENDS or marker == START:  # a new message, or a header cut off
            self.header = ""
        else:  # <|channel|>, <|constrain|>: part of the header
            self.header += marker

    def _open(self) -> None:
        """Read the header just closed by ``<|message|>``: where its body goes."""
        recipient = _RECIPIENT.search(self.header)
        channel = _CHANNEL_NAME.search(self.header)
        to = recipient.group(1) if recipient else None
        if to is not None and to.startswith(FUNCTIONS):
            self.route, self.name, self.args = "call", to[len(FUNCTIONS):], []
        elif channel is not None and channel.group(1) == "analysis":
            self.route, self.thought = "reasoning", True
        else:  # final, a preamble (commentary to no one); a built-in tool's: dropped
            self.route = "drop" if to is not None else "content"
        self.state, self.header, self.opened = "body", "", False

    def _close(self, out: dict[str, list[str]]) -> None:
        """End the open body; a call becomes one if its arguments are JSON."""
        if self.route == "call":
            text = "".join(self.args)
            args = text.strip() or "{}"
            try:
                json.loads(args)
            except ValueError:
                self._emit("content", text, out)
            else:
                self.calls.append(_call(self.name, args))
            self.args = []
        self.route = "content"


def split_harmony(text: str) -> tuple[str | None, str | None, list[dict[str, Any]]]:
    """A whole answer's ``(reasoning, content, tool_calls)``: reasoning None when the
    model did not think, content None when a thought or calls are all there is."""
    stream = HarmonyStream()
    r1, c1 = stream.feed(text)
    r2, c2 = stream.finish()
    if not stream.thought and not stream.calls:
        return None, c1 + c2, []
    return (r1 + r2 if stream.thought else None), (c1 + c2) or None, stream.calls


def calls_allowed(tools: Any) -> bool:
    """Whether a harmony answer's calls become ``tool_calls``: only where the request
    offered tools for the model to choose (``auto``); with no tools, or ``none``, they
    are dropped, as vLLM does without its tool parser."""
    return tools is not None and tools.mode == "auto"


def harmony_message(text: str, tools: Any, include_reasoning: bool, finish: str | None
                    ) -> tuple[dict[str, Any], str | None]:
    """A whole chat answer's message (``reasoning``/``reasoning_content`` when
    ``include_reasoning``, ``content``, ``tool_calls``) and its finish reason
    (``tool_calls`` when it called)."""
    reasoning, content, calls = split_harmony(text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if include_reasoning:
        message["reasoning"] = message["reasoning_content"] = reasoning
    if calls and calls_allowed(tools):
        message["tool_calls"] = calls
        finish = tools.finish_reason(calls, finish)
    return message, finish


def harmony_stream_calls(calls: list[dict[str, Any]], tools: Any, delta: dict[str, Any],
                         finish: str | None) -> str | None:
    """At a streamed choice's end, its calls go into ``delta`` whole (as the other
    parsers' ``auto`` calls do); returns the finish reason."""
    if not finish or not calls or not calls_allowed(tools):
        return finish
    delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
    return tools.finish_reason(calls, finish)


def constraint_field(request: Any) -> str:
    """The request field that constrains the output (``tool_choice`` when only a
    required or named tool call does)."""
    for name in _FIELDS:
        value = getattr(request, name, None)
        if value is not None and not (name == "response_format"
                                      and value.get("type", "text") == "text"):
            return name
    return "tool_choice"


def harmony_params(params: SamplingParams, request: Any = None) -> SamplingParams:
    """A chat request's params under the harmony parser: special tokens stay in the
    text, so the parser sees the markers; an output constraint is a 400 naming its
    field (``request``'s), since it would have to start after the final channel's
    header, which the grammar cannot express."""
    if params.structured_outputs is not None:
        field = constraint_field(request)
        what = "tool_choice 'required' or a named function" if field == "tool_choice" \
            else field
        raise APIError(f"{what} is not supported with the {HARMONY} reasoning parser: the "
                       "output constraint would have to start after the harmony "
                       "'<|channel|>final<|message|>' header" +
                       ("; use tool_choice 'auto'" if field == "tool_choice" else ""),
                       param=field)
    params.skip_special_tokens = False
    return params


def default_parser(model_path: str) -> str | None:
    """``openai_gptoss`` for a GPT-OSS checkpoint (its chat answers are always harmony
    messages: vLLM serves them so whatever ``--reasoning-parser`` says), else None."""
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return HARMONY if isinstance(cfg, dict) and cfg.get("model_type") == "gpt_oss" else None
