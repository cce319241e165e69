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
blocks before its next step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from ray import serve

from pagedserve.cluster.protocol import APIError
from pagedserve.cluster.response_store import HEARTBEAT_S, StoreClient
from pagedserve.cluster.responses import ResponseState

if TYPE_CHECKING:
    from pagedserve.cluster.responses_api import ResponseBuilder

logger = logging.getLogger(__name__)
router = APIRouter()
# Running background responses: the loop holds tasks weakly, these must not vanish.
_RUNNING: set[asyncio.Task[None]] = set()


async def start_background(store: StoreClient, builder: ResponseBuilder, st: ResponseState,
                           chunks: AsyncIterator[tuple[int, Any]],
                           items: list[dict[str, Any]]) -> JSONResponse:
    """Store the response as ``queued``, answer that, and generate it in a task."""
    queued = builder.response(st, "queued")
    await store("put", queued, items, builder.body.previous_response_id, True,
                serve.get_replica_context().replica_id.unique_id)
    task = asyncio.get_running_loop().create_task(_run(store, builder, st, chunks))
    _RUNNING.add(task)
    task.add_done_callback(_RUNNING.discard)
    return JSONResponse(queued)


async def _run(store: StoreClient, builder: ResponseBuilder, st: ResponseState,
               chunks: AsyncIterator[tuple[int, Any]]) -> None:
    async def generate() -> dict[str, Any]:
        started = False
        async for i, c in chunks:
            if not started:
                started = True
                await store("update", builder.response(st, "in_progress"))
            builder.fmt.add(st, i, c)
        return builder.response(st)

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
                final = gen.result()
            except APIError as e:
                final = builder.failed(e)
            except Exception as e:  # the record must not stay in_progress
                logger.exception("background response %s failed", builder.id)
                final = builder.failed(APIError(f"internal error: {e}", status=500,
                                                type="server_error"))
            await store("update", final)
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
    async def retrieve_response(self, response_id: str, raw: Request) -> JSONResponse:
        self._authorize(raw)
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
