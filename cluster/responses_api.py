"""``POST /v1/responses``: OpenAI's Responses API on the chat path.

The body becomes a chat completion (``responses_protocol``), which runs like any
other (template, tools, reasoning parser, output constraints, routing, failover);
its answer is reshaped into a ``response`` whose ``output`` holds a reasoning item
(with a reasoning parser), a message with one ``output_text`` part, and function
calls. Streamed, the chat deltas become the Responses events in their order:
``response.created``, ``response.in_progress``, each item's ``output_item.added``,
its part and text deltas and their ``done`` events, and last
``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut the
answer) carrying the whole response; an error after the first event is an
``error`` event. Every event has a ``sequence_number``. With the responses store
(``--enable-responses-store``), a finished response is stored before the client
sees it, and ``background`` ones run on in this replica (``responses_stored``).

The route lives on an ``APIRouter`` bound to this mixin; ``OpenAIServer`` inherits it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedserve.cluster.protocol import APIError
from pagedserve.cluster.response_store import ACTIVE
from pagedserve.cluster.responses import Formatter, ResponseState, now, started
from pagedserve.cluster.responses_protocol import (
    ResponsesRequest,
    response_object,
    responses_error,
    responses_usage,
)
from pagedserve.cluster.responses_stored import start_background

router = APIRouter()
Saver = Callable[[dict[str, Any]], Awaitable[None]]


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _output_text(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


class ResponseBuilder:
    """One response's output items and events, from the chat path's state and chunks."""

    def __init__(self, body: ResponsesRequest, rid: str, model: str, fmt: Formatter,
                 stored: bool = False) -> None:
        self.body, self.id, self.model, self.fmt = body, rid, model, fmt
        self.stored = stored  # echoed as ``store``
        self.created = now()
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # in output order, as they stand
        self.open: dict[str, Any] | None = None  # the reasoning or message item in progress
        self.text: list[str] = []  # of the open item
        self.logprobs: list[dict[str, Any]] = []  # of the message
        self.backlog: list[dict[str, Any]] = []  # logprobs not sent yet
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool call index -> item
        self.final: dict[str, Any] | None = None  # the streamed response, once finished

    # ---- whole responses --------------------------------------------------------------

    def response(self, st: ResponseState, status: str | None = None) -> dict[str, Any]:
        """The ``response`` object: queued or in progress (no output yet), or finished
        from ``st``."""
        if status in ACTIVE:
            return response_object(self.id, self.body, self.model, self.created, status,
                                   [], None, stored=self.stored)
        (choice,) = self.fmt.full_response(st)["choices"]
        message = choice["message"]
        cut = choice["finish_reason"] == "length"
        done = "incomplete" if cut else "completed"
        thought = message.get("reasoning")
        output: list[dict[str, Any]] = []
        if thought:
            output.append({"type": "reasoning", "id": self._item_id("reasoning"),
                           "summary": [], "status": done,
                           "content": [{"type": "reasoning_text", "text": thought}]})
        content = message.get("content")
        if content or not message.get("tool_calls"):
            lps = (choice["logprobs"] or {}).get("content")
            output.append({"type": "message", "id": self._item_id("message"), "status": done,
                           "role": "assistant", "content": [_output_text(content or "", lps)]})
        for k, call in enumerate(message.get("tool_calls") or []):
            item = self.calls.get(k, {})
            output.append({"type": "function_call", "id": item.get("id") or _id("fc"),
                           "call_id": item.get("call_id") or call["id"],
                           "name": call["function"]["name"],
                           "arguments": call["function"]["arguments"], "status": "completed"})
        reasoning_tokens = len(self.fmt.tok.encode(thought, add_special_tokens=False)) \
            if thought else 0
        return response_object(self.id, self.body, self.model, self.created, done, output,
                               responses_usage(st.usage(), reasoning_tokens),
                               "max_output_tokens" if cut else None, self.stored)

    def failed(self, e: APIError) -> dict[str, Any]:
        """A background response that ended in an error."""
        r = response_object(self.id, self.body, self.model, self.created, "failed", [],
                            None, stored=self.stored)
        err = responses_error(e)
        return {**r, "error": {"code": str(err.code), "message": err.message}}

    def _item_id(self, kind: str) -> str:
        """A streamed item keeps its id in the final response."""
        for item in self.items:
            if item["type"] == kind:
                return str(item["id"])
        return _id("rs" if kind == "reasoning" else "msg")

    # ---- events -----------------------------------------------------------------------

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    def start(self, st: ResponseState) -> list[str]:
        r = self.response(st, "in_progress")
        return [self.event("response.created", response=r),
                self.event("response.in_progress", response=r)]

    def feed(self, chunk: dict[str, Any]) -> list[str]:
        """Events for one chat chunk's delta."""
        out: list[str] = []
        delta = chunk["choices"][0]["delta"]
        # A delta's logprobs cover all its tokens (a thought's too, and an end-of-text
        # token with no text): the message's part carries them all, as unstreamed.
        self.backlog += (chunk["choices"][0].get("logprobs") or {}).get("content") or []
        if delta.get("reasoning"):
            out += self._text_delta("reasoning", delta["reasoning"], None)
        if delta.get("content") or (self.backlog and not delta.get("reasoning")
                                    and not self.calls and not delta.get("tool_calls")):
            lps, self.backlog = self.backlog, []
            out += self._text_delta("message", delta.get("content") or "", lps)
        for call in delta.get("tool_calls") or []:
            out += self._call_delta(call)
        return out

    def finish(self, st: ResponseState) -> list[str]:
        out = self._close()
        for item in self.calls.values():
            idx = self.items.index(item)
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=idx, arguments=item["arguments"]))
            item["status"] = "completed"
            out.append(self.event("response.output_item.done", output_index=idx, item=item))
        r = self.final = self.response(st)
        kind = "response.incomplete" if r["status"] == "incomplete" else "response.completed"
        return [*out, self.event(kind, response=r)]

    def _text_delta(self, kind: str, text: str, lps: list[dict[str, Any]] | None) -> list[str]:
        out: list[str] = []
        if self.open is None or self.open["type"] != kind:
            out += self._close()
            item: dict[str, Any] = {"type": kind, "id": _id("rs" if kind == "reasoning"
                                                          else "msg"),
                                    "status": "in_progress"}
            if kind == "reasoning":
                item.update(summary=[], content=[])
                part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
            else:
                item.update(role="assistant", content=[])
                part = _output_text("", None)
            self.items.append(item)
            self.open, self.text = item, []
            idx = len(self.items) - 1
            out.append(self.event("response.output_item.added", output_index=idx, item=item))
            out.append(self.event("response.content_part.added", item_id=item["id"],
                                  output_index=idx, content_index=0, part=part))
        idx = self.items.index(self.open)
        self.text.append(text)
        if kind == "reasoning":
            out.append(self.event("response.reasoning_text.delta", item_id=self.open["id"],
                                  output_index=idx, content_index=0, delta=text))
        else:
            self.logprobs += lps or []
            out.append(self.event("response.output_text.delta", item_id=self.open["id"],
                                  output_index=idx, content_index=0, delta=text,
                                  logprobs=lps or []))
        return out

    def _close(self) -> list[str]:
        """Close the reasoning or message item in progress."""
        item = self.open
        if item is None:
            return []
        self.open = None
        idx, text = self.items.index(item), "".join(self.text)
        if item["type"] == "reasoning":
            part: dict[str, Any] = {"type": "reasoning_text", "text": text}
            out = [self.event("response.reasoning_text.done", item_id=item["id"],
                              output_index=idx, content_index=0, text=text)]
        else:
            part = _output_text(text, self.logprobs)
            out = [self.event("response.output_text.done", item_id=item["id"],
                              output_index=idx, content_index=0, text=text,
                              logprobs=self.logprobs)]
        out.append(self.event("response.content_part.done", item_id=item["id"],
                              output_index=idx, content_index=0, part=part))
        item.update(status="completed", content=[part])
        out.append(self.event("response.output_item.done", output_index=idx, item=item))
        return out

    def _call_delta(self, call: dict[str, Any]) -> list[str]:
        out: list[str] = []
        item = self.calls.get(call["index"])
        fn = call.get("function") or {}
        if item is None:
            out += self._close()
            item = {"type": "function_call", "id": _id("fc"), "call_id": call.get("id"),
                    "name": fn.get("name"), "arguments": "", "status": "in_progress"}
            self.calls[call["index"]] = item
            self.items.append(item)
            out.append(self.event("response.output_item.added",
                                  output_index=len(self.items) - 1, item=dict(item)))
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                  output_index=self.items.index(item), delta=fn["arguments"]))
        return out


async def render_responses(builder: ResponseBuilder, st: ResponseState,
                           chunks: AsyncIterator[tuple[int, Any]], stream: bool,
                           save: Saver | None = None) -> Response:
    """The response body, or its events (the first chunk awaited before the 200, so an
    early error is a plain HTTP error, as on the other routes); ``save`` stores the
    finished response before the client sees it, so a next turn can name it at once."""
    fmt = builder.fmt
    if not stream:
        async for i, c in chunks:
            fmt.add(st, i, c)
        r = builder.response(st)
        if save is not None:
            await save(r)
        return JSONResponse(r)
    chunks = await started(chunks)

    async def events() -> AsyncIterator[str]:
        try:
            for ev in builder.start(st):
                yield ev
            async for i, c in chunks:
                for chunk in fmt.stream_chunks(st, i, c, False):
                    for ev in builder.feed(chunk):
                        yield ev
            last = builder.finish(st)
            if save is not None and builder.final is not None:
                await save(builder.final)
            for ev in last:
                yield ev
        except APIError as e:
            err = responses_error(e)
            yield builder.event("error", code=str(err.code), message=err.message,
                                param=err.param)
        finally:
            await chunks.aclose()

    return StreamingResponse(events(), media_type="text/event-stream")


class ResponsesEndpoint:
    """Mixed into ``OpenAIServer``, which provides the chat path (``_chat_request``,
    ``_start``), ``_authorize``, ``fmt``, ``served_name`` and ``responses_store``."""

    @router.post("/v1/responses")
    async def responses(self, body: ResponsesRequest, raw: Request) -> Response:
        self._authorize(raw)
        rid = _id("resp")
        store = self.responses_store
        try:
            stored = body.check_storage(store is not None)
            items = body.input_items()
            history = [] if store is None or body.previous_response_id is None \
                else await store("conversation", body.previous_response_id)
            chat = body.to_chat(history + items)
            req, tools, closed = await self._chat_request(rid, chat)
        except APIError as e:
            raise responses_error(e) from None
        st, chunks = self._start(rid, [req], "chat.completion", chat.logprobs, tools=tools,
                                 thought_closed=closed)
        lora = req.lora
        builder = ResponseBuilder(body, rid, lora[0] if lora else self.served_name, self.fmt,
                                  stored)
        if store is None or not stored:
            return await render_responses(builder, st, chunks, body.stream)
        if body.background:
            return await start_background(store, builder, st, chunks, items)

        async def save(r: dict[str, Any]) -> None:
            await store("put", r, items, body.previous_response_id)

        return await render_responses(builder, st, chunks, body.stream, save)
