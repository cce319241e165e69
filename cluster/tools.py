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
  maybe after ``<|python_tag|>``) becomes calls too; so do Mistral's
  ``[TOOL_CALLS]`` calls, both the JSON list of Mistral 7B v0.3 and the
  ``name[ARGS]{...}`` form of later models (the marker is a special token, so
  a Mistral tokenizer's requests keep special tokens in the text, as vLLM's
  Mistral parser does, and their calls get the 9-character alphanumeric ids that
  Mistral's chat templates require when the calls come back in ``messages``);
- ``"none"``: plain text (the tools still reach the chat template).

Streams carry content as it comes. A named function's arguments stream as
``tool_calls`` fragments while they are written (the first carries the id and
name); other calls go out whole in one ``tool_calls`` delta when the choice
ends (OpenAI's clients accumulate deltas, so both are valid). Under ``auto``
the text from ``<tool_call>`` (or ``[TOOL_CALLS]``) on is held back, and so is a
tail that could be the start of either, and an output that starts like a JSON call.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Any

from pagedserve.cluster.protocol import APIError
from pagedserve.scheduler.sampling_params import StructuredOutputs

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_CALL_MARKERS = (TOOL_CALL_OPEN, MISTRAL_CALLS)
_ALNUM = string.ascii_letters + string.digits
_HERMES = re.compile(re.escape(TOOL_CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(TOOL_CALL_CLOSE),
                     re.DOTALL)


def _call(name: str, arguments: Any, short_id: bool = False) -> dict[str, Any]:
    """An OpenAI tool call; ``short_id``: Mistral's 9 alphanumeric characters."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    cid = "".join(secrets.choice(_ALNUM) for _ in range(9)) if short_id \
        else f"call_{uuid.uuid4().hex[:24]}"
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def mistral_tool_format(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` has Mistral's ``[TOOL_CALLS]`` special token (its models
    call tools after it, and its templates want 9-character call ids)."""
    special = getattr(tokenizer, "all_special_tokens", None) or []
    added = getattr(tokenizer, "get_added_vocab", lambda: {})()
    return MISTRAL_CALLS in special or MISTRAL_CALLS in added


def _first_marker(text: str) -> int:
    """Where the first ``<tool_call>`` or ``[TOOL_CALLS]`` starts, -1 for none."""
    found = [i for i in (text.find(m) for m in _CALL_MARKERS) if i >= 0]
    return min(found, default=-1)


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
    mistral: bool = False  # the model writes [TOOL_CALLS]; its call ids are 9 characters

    @classmethod
    def from_request(cls, tools: list[dict[str, Any]] | None, tool_choice: Any,
                     parallel: bool | None, mistral: bool = False) -> ToolContext | None:
        """None when the request has no tools (``tool_choice`` is then an error unless
        it is ``"none"``). ``mistral``: the model's tokenizer is Mistral's
        (:func:`mistral_tool_format`)."""
        if not tools:
            if tool_choice not in (None, "none"):
                raise APIError("tool_choice needs tools", param="tool_choice")
            return None
        schemas = check_tools(tools)
        parallel = True if parallel is None else parallel
        if tool_choice is None or tool_choice in ("auto", "none", "required"):
            return cls(tool_choice or "auto", schemas, None, parallel, mistral)
        fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or tool_choice.get("type", "function") != "function":
            raise APIError("tool_choice must be none, auto, required or {'type': 'function', "
                           "'function': {'name': ...}}", param="tool_choice")
        if name not in schemas:
            raise APIError(f"tool_choice names {name!r}, which is not in tools",
                           param="tool_choice")
        return cls("named", schemas, name, parallel, mistral)

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the output must keep special tokens for :meth:`parse` to see the
        calls (Mistral's ``[TOOL_CALLS]`` under ``auto``)."""
        return self.mistral and self.mode == "auto"

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
            return None, [_call(self.name, text, self.mistral)]
        if self.mode == "required":
            try:
                items = json.loads(text)
                return None, [_call(it["name"], it["parameters"], self.mistral)
                              for it in items]
            except (ValueError, TypeError, KeyError):
                return text, []
        names = set(self.schemas)
        content, calls = parse_hermes(text, names, self.mistral)
        if not calls:
            content, calls = parse_mistral(text, names)
        if not calls:
            calls = parse_json_calls(text, names, self.mistral)
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


def parse_hermes(text: str, names: set[str], short_ids: bool = False
                 ) -> tuple[str | None, list[dict[str, Any]]]:
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
        calls.append(_call(name, args, short_ids))
    if not calls:
        return text, []
    content = text[: text.index(TOOL_CALL_OPEN)].strip()
    return content or None, calls


def parse_mistral(text: str, names: set[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """Mistral's calls of known functions after ``[TOOL_CALLS]``: a JSON list of
    ``{"name", "arguments"}`` (7B v0.3), or one ``name[ARGS]{...}`` per marker (later
    models; ``name{...}`` and a ``[CALL_ID]`` before ``[ARGS]`` are read too). The text
    before the first marker is the content; anything that does not parse leaves the
    whole text as content."""
    at = text.find(MISTRAL_CALLS)
    if at < 0:
        return text, []
    calls: list[dict[str, Any]] = []
    for part in text[at:].split(MISTRAL_CALLS)[1:]:
        part = part.strip()
        if part[:1] in ("[", "{"):
            got = parse_json_calls(part, names, True)
            if not got:
                return text, []
            calls.extend(got)
            continue
        name, sep, body = part.partition(MISTRAL_ARGS)
        if not sep:
            brace = part.find("{")
            name, body = (part[:brace], part[brace:]) if brace >= 0 else (part, "")
        name = name.partition(MISTRAL_CALL_ID)[0].strip()
        try:
            args = json.loads(body)
        except ValueError:
            return text, []
        if name not in names or not isinstance(args, dict):
            return text, []
        calls.append(_call(name, args, True))
    content = text[:at].strip()
    return (content or None, calls) if calls else (text, [])


def parse_json_calls(text: str, names: set[str], short_ids: bool = False
                     ) -> list[dict[str, Any]]:
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
        calls.append(_call(it["name"], args, short_ids))
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
            self._named = _call(self.ctx.name, "", self.ctx.mistral)
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
        at = _first_marker(self.text)
        limit = at if at >= 0 else len(self.text)
        if at < 0:  # hold back a tail that may be a marker's beginning
            longest = max(len(m) for m in _CALL_MARKERS) - 1
            for k in range(min(longest, len(self.text)), 0, -1):
                if any(m.startswith(self.text[-k:]) for m in _CALL_MARKERS):
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
        at = _first_marker(self.text)
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


def template_extra(tools: list[dict[str, Any]] | None, template_kwargs: dict[str, Any] | None,
                   continue_final_message: bool) -> dict[str, Any]:
    """What ``apply_chat_template`` takes beyond the messages: the request's template
    variables, its tools, and ``continue_final_message`` when set."""
    extra = dict(template_kwargs or {})
    if tools:
        extra["tools"] = tools
    if continue_final_message:
        extra["continue_final_message"] = True
    return extra


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool,
                    tools: list[dict[str, Any]] | None,
                    template_kwargs: dict[str, Any] | None = None,
                    continue_final_message: bool = False) -> list[int]:
    """The prompt the chat template makes of ``messages`` (and ``tools``, and extra
    template variables such as Qwen3's ``enable_thinking``; with
    ``continue_final_message``, the last message left open for the model to go on
    with, as transformers renders it); a template that cannot render them is a 400
    on ``messages``."""
    extra = template_extra(tools, template_kwargs, continue_final_message)
    try:
        return list(tokenizer.apply_chat_template(
            template_messages(messages), tokenize=True,
            add_generation_prompt=add_generation_prompt, return_dict=False, **extra))
    except Exception as e:
        raise APIError(f"cannot apply the chat template: {e}", param="messages") from None
