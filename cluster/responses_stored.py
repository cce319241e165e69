"""Stored responses over HTTP: background runs, and OpenAI's ``GET`` / ``DELETE
/v1/responses/{id}``, ``POST /v1/responses/{id}/cancel`` and ``GET
/v1/responses/{id}/input_items``.

A background response is answered ``queued`` at once; the ingress replica that took
it keeps generating in a task of its own (the HTTP request is over), writes
``in_progress`` at the first tokens and the finished response (or ``failed``) at
the end, and beats meanwhile (the store fails it when the beats stop: its replica
died). A cancel or a delete, reaching any ingress replica, marks the record in the
store, which releases the task's wait on it: the task then cancels its generation
as a client that went away would, so the engine aborts the request and frees its
blocks before its next step. Streamed (``background`` and ``stream``), the task
appends its events to the store as it makes them and the client follows them
there (``follow``), so a lost connection loses nothing: ``GET
/v1/responses/{id}?stream=true&starting_after=N`` picks the stream up again.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from pagedserve.cluster.protocol import APIError
from pagedserve.cluster.response_store import HEARTBEAT_S, StoreClient
from pagedserve.cluster.responses import ResponseState
from pagedserve.cluster.responses_protocol import responses_error

if TYPE_CHECKING:
    from pagedserve.cluster.responses_api import ResponseBuilder

logger = logging.getLogger(__name__)
router = APIRouter()
# Running background responses: the loop holds tasks weakly, these must not vanish.
_RUNNING: set[asyncio.Task[None]] = set()
FOLLOW_WAIT_S = 10.0  # one long poll of a followed response's events


async def start_background(store: StoreClient, builder: ResponseBuilder, st: ResponseState,
                           chunks: AsyncIterator[tuple[int, Any]],
                           items: list[dict[str, Any]]) -> Response:
    """Store the response as ``queued`` and generate it in a task; answer the queued
    response, or (``stream``) follow the task's events, which go on without us."""
    queued = builder.response(st, "queued")
    streamed = builder.body.stream
    await store("put", queued, items, builder.body.previous_response_id, True,
                serve.get_replica_context().replica_id.unique_id, streamed)
    # A fresh context: in the request's, Serve would cancel the task's calls to the
    # replicas with the request, when a streaming client goes away.
    task = asyncio.get_running_loop().create_task(_run(store, builder, st, chunks),
                                                  context=contextvars.Context())
    _RUNNING.add(task)
    task.add_done_callback(_RUNNING.discard)
    if streamed:
        return await follow(store, builder.id, -1)
    return JSONResponse(queued)


async def follow(store: StoreClient, rid: str, after: int) -> StreamingResponse:
    """The stored events of ``rid`` after sequence number ``after``, then the new ones
    as they come, until it ends (the first batch fetched before the 200, so an unknown
    id is a plain 404)."""
    first = await store.wait_events(rid, after, 0.0)

    async def events() -> AsyncIterator[str]:
        nonlocal after
        got = first
        try:
            while True:
                for ev in got["events"]:
                    yield ev
                after += len(got["events"])
                if got["done"] and not got["events"]:
                    return
                got = await store.wait_events(rid, after, FOLLOW_WAIT_S)
        except APIError as e:  # deleted meanwhile
            yield "event: error\ndata: " + json.dumps(
                {"type": "error", "code": str(e.code), "message": e.message,
                 "param": e.param}) + "\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def _run(store: StoreClient, builder: ResponseBuilder, st: ResponseState,
               chunks: AsyncIterator[tuple[int, Any]]) -> None:
    streamed = builder.body.stream

    async def generate() -> tuple[dict[str, Any], list[str]]:
        started = False
        if streamed:
            await store("append", builder.id, builder.start(st))
        async for i, c in chunks:
            if not started:
                started = True
                await store("update", builder.response(st, "in_progress"))
            if not streamed:
                builder.fmt.add(st, i, c)
                continue
            events = [ev for chunk in builder.fmt.stream_chunks(st, i, c, False)
                      for ev in builder.feed(chunk)]
            if events:
                await store("append", builder.id, events)
        if not streamed:
            return builder.response(st), []
        last = builder.finish(st)
        return builder.final or builder.response(st), last

    def failed(e: APIError) -> tuple[dict[str, Any], list[str]]:
        err = responses_error(e)
        return builder.failed(e), [builder.event("error", code=str(err.code),
                                                 message=err.message, param=err.param)]

    async def beat() -> None:
        while await store("beat", builder.id):
            await asyncio.sleep(HEARTBEAT_S)

    gen = asyncio.ensure_future(generate())
    stop = asyncio.ensure_future(store.wait_cancelled(builder.id))
    alive = asyncio.ensure_future(beat())
    try:
        await asyncio.wait({gen, stop}, return_when=asyncio.FIRST_COMPLETED)
        if gen.done():
            try:
                final, last = gen.result()
            except APIError as e:
                final, last = failed(e)
            except Exception as e:  # the record must not stay in_progress
                logger.exception("background response %s failed", builder.id)
                final, last = failed(APIError(f"internal error: {e}", status=500,
                                              type="server_error"))
            await store("update", final, last if streamed else None)
    except Exception:  # a store that went away: nothing left to tell
        logger.exception("background response %s could not be stored", builder.id)
    finally:
        for t in (gen, stop, alive):
            t.cancel()
        await asyncio.gather(gen, stop, alive, return_exceptions=True)
        await chunks.aclose()  # aborts the engine request if it still runs


class StoredResponsesEndpoints:
    """Mixed into ``OpenAIServer``, which provides ``_authorize`` and ``responses_store``."""

    def _store(self) -> StoreClient:
        store: StoreClient | None = self.responses_store
        if store is None:
            raise APIError("this server does not store responses (serve with "
                           "--enable-responses-store)", status=404,
                           code="response_not_found")
        return store

    @router.get("/v1/responses/{response_id}")
    async def retrieve_response(self, response_id: str, raw: Request, stream: bool = False,
                                starting_after: int = -1) -> Response:
        """The response; with ``stream`` (a streamed background one), its events after
        ``starting_after`` and then the rest as they come: how a client that lost the
        stream resumes it."""
        self._authorize(raw)
        if stream:
            return await follow(self._store(), response_id, starting_after)
        return JSONResponse(await self._store()("get", response_id))

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(self, response_id: str, raw: Request) -> JSONResponse:
        self._authorize(raw)
        return JSONResponse(await self._store()("delete", response_id))

    @router.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(self, response_id: str, raw: Request) -> JSONResponse:
        self._authorize(raw)
        return JSONResponse(await self._store()("cancel", response_id))

    @router.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(self, response_id: str, raw: Request, limit: int = 20,
                                   order: str = "desc", after: str | None = None
                                   ) -> JSONResponse:
        self._authorize(raw)
        return JSONResponse(await self._store()("input_items", response_id, limit, order,
                                                after))
