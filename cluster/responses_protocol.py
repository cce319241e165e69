"""OpenAI's Responses API (``POST /v1/responses``) as a chat completion, and back.

Why a translation: a response is one chat turn with other names (``input`` for
``messages``, ``instructions`` for a system message, ``max_output_tokens``,
flat function tools, ``text.format`` for ``response_format``), and an answer
whose output is a list of items (a reasoning item, a message with
``output_text``, function calls) instead of choices. Running it through the chat
path keeps one implementation of templates, tools, reasoning parsers, output
constraints, routing and failover; only the shapes differ. With the responses
store (``response_store``), ``previous_response_id`` prepends the stored
conversation's items to ``input``; without it (the default, as vLLM's) ``store``
is answered ``false`` and ``previous_response_id`` and ``background`` are refused.
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from pagedserve.cluster.chat_protocol import ChatCompletionRequest
from pagedserve.cluster.protocol import MAX_LOGPROBS, APIError

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# Chat fields that carry a Responses field under another name (for error messages).
_PARAM_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                "max_tokens": "max_output_tokens", "response_format": "text"}


class ResponsesRequest(BaseModel):
    """The body of ``POST /v1/responses`` (text in, text and function calls out)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    truncation: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # vLLM's extras, as on chat completions.
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    priority: int = 0
    cache_salt: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None

    def logprobs(self) -> bool:
        return self.top_logprobs is not None or LOGPROBS_INCLUDE in (self.include or [])

    def check_storage(self, has_store: bool) -> bool:
        """Whether this response is stored; a 400 for what needs a store it cannot have."""
        if not has_store:
            if self.previous_response_id is not None:
                raise APIError("previous_response_id needs stored responses, which this "
                               "server does not keep (serve with --enable-responses-store), "
                               "or send the whole conversation in input",
                               param="previous_response_id")
            if self.background:
                raise APIError("background responses need the responses store (serve "
                               "with --enable-responses-store)", param="background")
            return False
        if self.background and self.store is False:
            raise APIError("background responses must be stored (store: true)",
                           param="background")
        return self.store is not False

    def input_items(self) -> list[dict[str, Any]]:
        """``input`` as items with ids (a string is one user message), as stored and as
        ``GET /v1/responses/{id}/input_items`` lists them."""
        items = [{"type": "message", "role": "user",
                  "content": [{"type": "input_text", "text": self.input}]}] \
            if isinstance(self.input, str) else self.input
        if not items:
            raise APIError("input must not be empty", param="input")
        out = []
        for item in items:
            kind = item.get("type", "message")
            prefix = {"message": "msg", "function_call": "fc",
                      "function_call_output": "fco", "reasoning": "rs"}.get(kind, "item")
            out.append({"id": f"{prefix}_{uuid.uuid4().hex}", **item, "type": kind})
        return out

    def to_chat(self, items: list[dict[str, Any]] | None = None) -> ChatCompletionRequest:
        """The chat completion this response runs as (over ``items``: a stored
        conversation's and this input's; this input's alone when None); a 400 naming
        the Responses field when it cannot be one."""
        if self.truncation not in (None, "disabled"):
            raise APIError("truncation must be 'disabled'", param="truncation")
        unknown = sorted(set(self.include or []) - {LOGPROBS_INCLUDE})
        if unknown:
            raise APIError(f"include may only hold {LOGPROBS_INCLUDE!r}, got {unknown}",
                           param="include")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise APIError(f"top_logprobs must be in [0, {MAX_LOGPROBS}]",
                           param="top_logprobs")
        body: dict[str, Any] = {
            "model": self.model,
            "messages": self._messages(self.input_items() if items is None else items),
            "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p, "seed": self.seed,
            "repetition_penalty": self.repetition_penalty, "stop": self.stop,
            "ignore_eos": self.ignore_eos, "stream": self.stream,
            "tools": self._tools(), "tool_choice": self._tool_choice(),
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": self._format(), "logprobs": self.logprobs(),
            "top_logprobs": (self.top_logprobs or 0) if self.logprobs() else None,
            "priority": self.priority, "cache_salt": self.cache_salt,
            "chat_template_kwargs": self.chat_template_kwargs, "user": self.user,
            "structured_outputs": self.structured_outputs,
            "reasoning_effort": (self.reasoning or {}).get("effort")}
        try:
            chat = ChatCompletionRequest.model_validate(
                {k: v for k, v in body.items() if v is not None})
            chat.check()
        except ValidationError as e:
            loc = e.errors()[0]["loc"]
            if loc and loc[0] == "reasoning_effort":
                raise APIError("reasoning.effort must be 'low', 'medium' or 'high'",
                               param="reasoning") from None
            raise APIError(f"input: {e.errors()[0]['msg']} at {list(loc)}",
                           param="input") from None
        except APIError as e:
            raise responses_error(e) from None
        return chat

    def _messages(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Chat messages: the instructions as a system message, then the items
        (messages; function calls and their outputs as assistant tool calls and tool
        turns; earlier reasoning items dropped, as chat templates drop thoughts)."""
        out: list[dict[str, Any]] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
        for item in items:
            kind = item.get("type", "message")
            if kind == "message":
                out.append({"role": item.get("role"), "content": _text_of(item.get("content"))})
            elif kind == "function_call":
                call = {"id": item.get("call_id"), "type": "function",
                        "function": {"name": item.get("name"),
                                     "arguments": item.get("arguments", "")}}
                if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                    out[-1]["tool_calls"].append(call)
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif kind == "function_call_output":
                output = item.get("output")
                out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                            "content": output if isinstance(output, str) else _text_of(output)})
            elif kind != "reasoning":
                raise APIError(f"input items of type {kind!r} are not supported (message, "
                               "function_call, function_call_output, reasoning)",
                               param="input")
        return out

    def _tools(self) -> list[dict[str, Any]] | None:
        """Responses' flat function tools as chat tools; built-in tools are refused."""
        if not self.tools:
            return None
        chat = []
        for t in self.tools:
            if t.get("type") != "function" or not isinstance(t.get("name"), str):
                raise APIError("only function tools ({'type': 'function', 'name': ...}) are "
                               f"supported, got {t.get('type')!r}", param="tools")
            fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
            chat.append({"type": "function", "function": fn})
        return chat

    def _tool_choice(self) -> str | dict[str, Any] | None:
        tc = self.tool_choice
        if isinstance(tc, dict):
            if tc.get("type") != "function" or not isinstance(tc.get("name"), str):
                raise APIError("tool_choice must be auto, none, required or "
                               "{'type': 'function', 'name': ...}", param="tool_choice")
            return {"type": "function", "function": {"name": tc["name"]}}
        return tc

    def _format(self) -> dict[str, Any] | None:
        """``text.format`` as chat's ``response_format``."""
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return None
        if not isinstance(fmt, dict):
            raise APIError("text.format must be an object", param="text")
        if fmt.get("type") == "json_schema":
            return {"type": "json_schema",
                    "json_schema": {"name": fmt.get("name", "response"),
                                    "schema": fmt.get("schema"),
                                    "strict": fmt.get("strict", False)}}
        return {"type": fmt.get("type")}


def _text_of(content: Any) -> str | list[dict[str, Any]]:
    """A Responses message's content for chat: a string, or its text and image parts
    (``input_image`` with an ``image_url``: chat's ``image_url`` part)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError("a message's content must be a string or a list of text parts",
                       param="input")
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise APIError("an input_image part needs an image_url string (file_id is "
                               "not supported)", param="input")
            parts.append({"type": "image_url", "image_url": {"url": url}})
            continue
        if kind not in ("input_text", "output_text", "text"):
            raise APIError(f"only text and input_image content is supported, got {kind!r}",
                           param="input")
        parts.append({"type": "text", "text": part.get("text", "")})
    return parts


def responses_error(e: APIError) -> APIError:
    """A chat-side error, renamed to the Responses field that caused it."""
    message = e.message
    for chat_name, name in _PARAM_NAMES.items():
        message = message.replace(chat_name, name)
    return APIError(message, e.status, e.type, _PARAM_NAMES.get(e.param or "", e.param),
                    e.code, e.headers)


def response_object(rid: str, body: ResponsesRequest, model: str, created: int,
                    status: str, output: list[dict[str, Any]],
                    usage: dict[str, Any] | None, incomplete: str | None = None,
                    stored: bool = False) -> dict[str, Any]:
    """The ``response`` object, echoing the request's settings as OpenAI does."""
    fmt = (body.text or {}).get("format") or {"type": "text"}
    return {
        "id": rid, "object": "response", "created_at": created, "status": status,
        "model": model, "output": output, "usage": usage, "error": None,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "tools": body.tools or [], "tool_choice": body.tool_choice or "auto",
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "text": {"format": fmt}, "reasoning": body.reasoning, "store": stored,
        "previous_response_id": body.previous_response_id, "metadata": body.metadata or {},
        "user": body.user, "top_logprobs": body.top_logprobs, "truncation": "disabled",
        "background": bool(body.background)}


def responses_usage(chat_usage: dict[str, Any], reasoning_tokens: int) -> dict[str, Any]:
    """Chat's usage in the Responses shape."""
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {
                "cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": chat_usage["total_tokens"]}
