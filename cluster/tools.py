"""Tool calling for chat completions: OpenAI's ``tools`` and ``tool_choice``.

How each choice is honoured (vLLM's approach):

- a named function (``{"type": "function", "function": {"name": ...}}``): the
  output is constrained to that function's ``parameters`` JSON schema and
  becomes the call's ``arguments``;
- ``"required"``: the output is constrained to a JSON array of
  ``{"name": ..., "parameters": ...}`` objects, one schema per tool (a single
  item when ``parallel_tool_calls`` is false), each item becoming a call;
- ``"auto"`` (the default when tools are given): the model writes freely and
  ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks in its text
  (the Hermes format that Qwen2.5 / Qwen3 chat templates teach) become calls,
  the text before them the message content; an output that is as a whole a JSON
  call or list of calls (Llama 3.x's ``{"name": ..., "parameters": ...}``,
  maybe after ``<|python_tag|>``) becomes calls too;
- ``"none"``: plain text (the tools still reach the chat template).

Streams carry content as it comes. A named function's arguments stream as
``tool_calls`` fragments while they are written (the first carries the id and
name); other calls go out whole in one ``tool_calls`` delta when the choice
ends (OpenAI's clients accumulate deltas, so both are valid). Under ``auto``
the text from ``<tool_call>`` on is held back, and so is a tail that could be
the start of that tag, and an output that starts like a JSON call.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from pagedserve.cluster.protocol import APIError
from pagedserve.scheduler.sampling_params import StructuredOutputs

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES = re.compile(re.escape(TOOL_CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(TOOL_CALL_CLOSE),
                     re.DOTALL)


def _call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": args}}


def check_tools(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Function name -> its ``parameters`` schema; a 400 naming ``tools`` otherwise."""
    out: dict[str, dict[str, Any]] = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(
                fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(f"tools[{i}] must be {{'type': 'function', 'function': "
                           "{'name': ..., 'parameters': {...}}}", param="tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise APIError(f"tools[{i}].function.parameters must be a JSON schema object",
                           param="tools")
        if fn["name"] in out:
            raise APIError(f"tools: function {fn['name']!r} is defined twice", param="tools")
        out[fn["name"]] = params
    return out


@dataclass
class ToolContext:
    """One request's tools and how the output must call them."""

    mode: str  # "none" | "auto" | "required" | "named"
    schemas: dict[str, dict[str, Any]] = field(default_factory=dict)
    name: str | None = None
    parallel: bool = True

    @classmethod
    def from_request(cls, tools: list[dict[str, Any]] | None, tool_choice: Any,
                     parallel: bool | None) -> ToolContext | None:
        """None when the request has no tools (``tool_choice`` is then an error unless
        it is ``"none"``)."""
        if not tools:
            if tool_choice not in (None, "none"):
                raise APIError("tool_choice needs tools", param="tool_choice")
            return None
        schemas = check_tools(tools)
        parallel = True if parallel is None else parallel
        if tool_choice is None or tool_choice in ("auto", "none", "required"):
            return cls(tool_choice or "auto", schemas, None, parallel)
        fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or tool_choice.get("type", "function") != "function":
            raise APIError("tool_choice must be none, auto, required or {'type': 'function', "
                           "'function': {'name': ...}}", param="tool_choice")
        if name not in schemas:
            raise APIError(f"tool_choice names {name!r}, which is not in tools",
                           param="tool_choice")
        return cls("named", schemas, name, parallel)

    def structured(self) -> StructuredOutputs | None:
        """The output constraint for ``named`` and ``required``."""
        if self.mode == "named":
            assert self.name is not None
            return StructuredOutputs(json=self.schemas[self.name])
        if self.mode != "required":
            return None
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [n]},
                                                   "parameters": s},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for n, s in self.schemas.items()]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputs(json=schema)

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """``(content, tool_calls)`` of a finished output. Output that does not parse (cut
        by ``max_tokens``) stays content with no calls."""
        if self.mode == "none":
            return text, []
        if self.mode == "named":
            try:
                json.loads(text)
            except ValueError:
                return text, []
            assert self.name is not None
            return None, [_call(self.name, text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
                return None, [_call(it["name"], it["parameters"]) for it in items]
            except (ValueError, TypeError, KeyError):
                return text, []
        content, calls = parse_hermes(text, set(self.schemas))
        if not calls:
            calls = parse_json_calls(text, set(self.schemas))
            if calls:
                content = None
        return content, calls

    def finish_reason(self, calls: list[dict[str, Any]], engine_reason: str | None
                      ) -> str | None:
        """OpenAI's: ``tool_calls`` when the model chose to call (auto, required); a
        forced function keeps the engine's reason."""
        if calls and self.mode in ("auto", "required"):
            return "tool_calls"
        return engine_reason


def parse_hermes(text: str, names: set[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """Hermes-style ``<tool_call>`` blocks of known functions become calls; the text
    before the first block is the content. A block that is not a JSON call of a
    known function leaves the whole text as content."""
    calls = []
    for m in _HERMES.finditer(text):
        try:
            obj = json.loads(m.group(1))
            name, args = obj["name"], obj.get("arguments", obj.get("parameters", {}))
        except (ValueError, TypeError, KeyError):
            return text, []
        if name not in names:
            return text, []
        calls.append(_call(name, args))
    if not calls:
        return text, []
    content = text[: text.index(TOOL_CALL_OPEN)].strip()
    return content or None, calls


def parse_json_calls(text: str, names: set[str]) -> list[dict[str, Any]]:
    """Llama 3.x's format: the whole output is a JSON call (``{"name": ...,
    "parameters": ...}``, optionally after ``<|python_tag|>``), or a list of them,
    of known functions; anything else is no call."""
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].lstrip()
    try:
        obj = json.loads(body)
    except ValueError:
        return []
    items = obj if isinstance(obj, list) else [obj]
    calls = []
    for it in items:
        if not isinstance(it, dict) or it.get("name") not in names:
            return []
        args = it.get("parameters", it.get("arguments", {}))
        if not isinstance(args, dict):
            return []
        calls.append(_call(it["name"], args))
    return calls


class ToolStream:
    """Splits one streamed choice into content deltas now and tool calls at its end."""

    def __init__(self, ctx: ToolContext) -> None:
        self.ctx = ctx
        self.text = ""  # everything generated so far
        self.sent = 0  # characters already emitted as content
        self._named: dict[str, Any] | None = None  # the named call, once announced

    def named_fragment(self, delta: str) -> dict[str, Any] | None:
        """A named function's arguments as they are written: a ``tool_calls`` delta
        entry (the first one carries the call's id and name), or None for nothing new."""
        assert self.ctx.mode == "named" and self.ctx.name is not None
        self.text += delta
        if self._named is None:
            self._named = _call(self.ctx.name, "")
            return {"index": 0, "id": self._named["id"], "type": "function",
                    "function": {"name": self.ctx.name, "arguments": delta}}
        return {"index": 0, "function": {"arguments": delta}} if delta else None

    def feed(self, delta: str) -> str:
        """The content that can be shown now."""
        self.text += delta
        if self.ctx.mode in ("named", "required"):
            return ""  # the whole output is the call
        if self.ctx.mode == "none":
            out, self.sent = self.text[self.sent:], len(self.text)
            return out
        head = self.text.lstrip()
        if head[:1] in ("{", "[") or (head and PYTHON_TAG.startswith(head[:len(PYTHON_TAG)])):
            return ""  # may be a whole-output JSON call: decided at the end
        at = self.text.find(TOOL_CALL_OPEN)
        limit = at if at >= 0 else len(self.text)
        if at < 0:  # hold back a tail that may be the tag's beginning
            for k in range(min(len(TOOL_CALL_OPEN) - 1, len(self.text)), 0, -1):
                if TOOL_CALL_OPEN.startswith(self.text[-k:]):
                    limit = len(self.text) - k
                    break
        out = self.text[self.sent:limit] if limit > self.sent else ""
        self.sent = max(self.sent, limit)
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """``(content not yet shown, tool_calls)`` once the choice has ended."""
        _, calls = self.ctx.parse(self.text)
        if not calls:
            rest, self.sent = self.text[self.sent:], len(self.text)
            return rest, []
        at = self.text.find(TOOL_CALL_OPEN)
        if self.ctx.mode != "auto" or at < 0:  # (a whole-output JSON call has no content)
            return "", calls
        # (content is what came before the first call, right-stripped as ``parse`` does)
        return self.text[self.sent:at].rstrip(), calls


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant ``tool_calls`` with their JSON ``arguments`` strings as objects, as chat
    templates (Qwen2.5's, Llama 3.1's) expect them."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = dict(m)
            fixed = []
            for c in calls:
                c = json.loads(json.dumps(c))
                fn = c.get("function") or {}
                if isinstance(fn.get("arguments"), str):
                    with contextlib.suppress(ValueError):  # else rendered as the string
                        fn["arguments"] = json.loads(fn["arguments"])
                fixed.append(c)
            m["tool_calls"] = fixed
        out.append(m)
    return out


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool,
                    tools: list[dict[str, Any]] | None,
                    template_kwargs: dict[str, Any] | None = None,
                    continue_final_message: bool = False) -> list[int]:
    """The prompt the chat template makes of ``messages`` (and ``tools``, and extra
    template variables such as Qwen3's ``enable_thinking``; with
    ``continue_final_message``, the last message left open for the model to go on
    with, as transformers renders it); a template that cannot render them is a 400
    on ``messages``."""
    extra = dict(template_kwargs or {})
    if tools:
        extra["tools"] = tools
    if continue_final_message:
        extra["continue_final_message"] = True
    try:
        return list(tokenizer.apply_chat_template(
            template_messages(messages), tokenize=True,
            add_generation_prompt=add_generation_prompt, return_dict=False, **extra))
    except Exception as e:
        raise APIError(f"cannot apply the chat template: {e}", param="messages") from None
