"""Stored responses for the Responses API: ``store``, ``previous_response_id``,
``background``, and the ``GET`` / ``DELETE`` / ``cancel`` / ``input_items`` routes.

Why a deployment of its own: with several ingress replicas a conversation's next
turn, a poll of a background response or its cancel may reach any of them, so the
records live in one place every ingress replica calls (``ResponseStoreServer``, one
replica, no CPU reserved). Each record keeps the response as it stands, its own
input items and the id of the response it continued; a conversation is found by
walking those links, so a long chat costs one copy of each turn, not one per turn.
Memory is bounded: past ``max_entries`` the least recently used finished record is
dropped (a conversation that continues it then gets a 404 naming it), as a server
without a database must. A record lives as long as the store's replica: a restart
of the app loses them. A background response's task beats every few seconds; one
whose beats stopped for ``stale_s`` (its ingress replica died) reads as ``failed``,
never ``in_progress`` for ever. A streamed background response keeps its events
(``wait_events``: a client that lost the stream resumes it after the last
sequence number it saw) until ``EVENTS_KEEP_S`` after it ended.

``ResponseStore`` holds the logic (tested without Ray); the deployment wraps it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from ray import serve

from pagedserve.cluster.protocol import APIError

STORE_DEPLOYMENT = "ResponseStore"
ACTIVE = ("queued", "in_progress")
HEARTBEAT_S = 2.0  # a background task's beat
STALE_S = 15.0  # beats missed this long: its ingress replica is gone
EVENTS_KEEP_S = 600.0  # a finished streamed response's events, for late resumes


def not_found(rid: str, param: str | None = None) -> APIError:
    return APIError(f"response with id {rid!r} not found", status=404, param=param,
                    code="response_not_found")


@dataclass
class Record:
    """One stored response: the object as it stands, its input items, the one it continued."""

    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    previous: str | None
    background: bool = False
    owner: str | None = None  # the ingress replica generating a background response
    seen: float = field(default_factory=time.monotonic)  # its last beat
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    events: list[str] | None = None  # a streamed background response's, in order
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # replaced per change

    def notify(self) -> None:
        """Wake whoever follows the events (a new event, or the end)."""
        self.changed.set()
        self.changed = asyncio.Event()


class ResponseStore:
    """Responses by id, least recently used first, at most ``max_entries`` of them."""

    def __init__(self, max_entries: int = 10_000, stale_s: float = STALE_S) -> None:
        if max_entries < 1:
            raise ValueError(f"responses_store_max_entries must be >= 1, got {max_entries}")
        self.max_entries, self.stale_s = max_entries, stale_s
        self.records: OrderedDict[str, Record] = OrderedDict()
        self.ended_streams: deque[tuple[float, str]] = deque()  # (when, id), oldest first

    def _record(self, rid: str, param: str | None = None) -> Record:
        rec = self.records.get(rid)
        if rec is None:
            raise not_found(rid, param)
        self.records.move_to_end(rid)
        self._expire(rec)
        return rec

    def _expire(self, rec: Record) -> None:
        """A background response nobody generates any more is failed, not in progress."""
        if rec.response["status"] in ACTIVE and rec.background \
                and time.monotonic() - rec.seen > self.stale_s:
            rec.response = {**rec.response, "status": "failed", "error": {
                "code": "server_error",
                "message": f"the ingress replica {rec.owner} generating this response "
                           "stopped; create it again"}}
            self._ended(rec)

    def _ended(self, rec: Record) -> None:
        """``rec`` is no longer generated: release its task's wait and its followers."""
        rec.cancelled.set()
        rec.notify()
        if rec.events is not None:
            self.ended_streams.append((time.monotonic(), rec.response["id"]))

    def put(self, response: dict[str, Any], input_items: list[dict[str, Any]],
            previous: str | None, background: bool = False, owner: str | None = None,
            streamed: bool = False) -> None:
        """Store a new response (finished, or a background one just queued by ``owner``,
        whose events are kept when ``streamed``)."""
        rec = Record(response, input_items, previous, background, owner)
        rec.events = [] if streamed else None
        self.records[response["id"]] = rec
        self.records.move_to_end(response["id"])
        self._evict()
        now = time.monotonic()
        while self.ended_streams and now - self.ended_streams[0][0] > EVENTS_KEEP_S:
            old = self.records.get(self.ended_streams.popleft()[1])
            if old is not None:
                old.events = None

    def beat(self, rid: str) -> bool:
        """A background task is alive; False once its response no longer runs."""
        rec = self.records.get(rid)
        if rec is None or rec.response["status"] not in ACTIVE:
            return False
        rec.seen = time.monotonic()
        return True

    def stats(self) -> dict[str, int]:
        """What the store holds, for ``/v1/stats`` and ``/metrics``."""
        recs = list(self.records.values())
        return {"entries": len(recs), "max_entries": self.max_entries,
                "background_running": sum(r.background and r.response["status"] in ACTIVE
                                          for r in recs),
                "events_kept": sum(len(r.events) for r in recs if r.events is not None)}

    def owner(self, rid: str) -> str | None:
        """The ingress replica that generates (or generated) a background response."""
        return self._record(rid).owner

    def _evict(self) -> None:
        """Drop the least recently used finished records past the bound (a running
        background response is kept: its task still writes to it)."""
        excess = len(self.records) - self.max_entries
        if excess <= 0:
            return
        for rec in self.records.values():
            self._expire(rec)
        for rid in [r for r, rec in self.records.items()
                    if rec.response["status"] not in ACTIVE][:excess]:
            del self.records[rid]

    def update(self, response: dict[str, Any], events: list[str] | None = None) -> bool:
        """A background response's progress or end (with its last ``events`` when
        streamed); False (and nothing written) once it was cancelled or deleted, so a
        cancel is never overwritten by the answer."""
        rec = self.records.get(response["id"])
        if rec is None or rec.response["status"] not in ACTIVE:
            return False  # cancelled, or failed for missed beats
        rec.seen = time.monotonic()
        rec.response = response
        if events and rec.events is not None:
            rec.events += events
            rec.notify()
        if response["status"] not in ACTIVE:
            self._ended(rec)  # its task's wait then reads False: finished, not cancelled
            self._evict()
        return True

    def append(self, rid: str, events: list[str]) -> bool:
        """A streamed background response's new events; False once it no longer runs."""
        rec = self.records.get(rid)
        if rec is None or rec.response["status"] not in ACTIVE or rec.events is None:
            return False
        rec.seen = time.monotonic()
        rec.events += events
        rec.notify()
        return True

    async def wait_events(self, rid: str, after: int, timeout_s: float) -> dict[str, Any]:
        """The events after sequence number ``after`` (waiting up to ``timeout_s`` for
        one), and whether the response has ended."""
        rec = self._record(rid)
        if rec.events is None:
            why = "are no longer kept (GET it without stream)" if rec.background \
                and rec.response["status"] not in ACTIVE else \
                "are only kept for responses created with background and stream"
            raise APIError(f"the events of response {rid!r} {why}", param="stream")
        if len(rec.events) <= after + 1 and rec.response["status"] in ACTIVE:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(rec.changed.wait(), timeout_s)
            rec = self._record(rid)  # deleted meanwhile: a 404
        return {"events": (rec.events or [])[after + 1:],
                "done": rec.response["status"] not in ACTIVE}

    def get(self, rid: str) -> dict[str, Any]:
        return self._record(rid).response

    def delete(self, rid: str) -> dict[str, Any]:
        rec = self._record(rid)
        del self.records[rid]
        rec.cancelled.set()  # a deleted background response stops generating
        rec.notify()
        return {"id": rid, "object": "response", "deleted": True}

    def cancel(self, rid: str) -> dict[str, Any]:
        """OpenAI's cancel: only background responses; idempotent once cancelled."""
        rec = self._record(rid)
        status = rec.response["status"]
        if not rec.background:
            raise APIError("only background responses can be cancelled", param="response_id")
        if status == "cancelled":
            return rec.response
        if status not in ACTIVE:
            raise APIError(f"cannot cancel a response that is {status}", param="response_id")
        rec.response = {**rec.response, "status": "cancelled"}
        self._ended(rec)
        return rec.response

    async def wait_cancelled(self, rid: str) -> bool:
        """Returns once ``rid`` ends: True when cancelled or deleted, False when it finished."""
        rec = self.records.get(rid)
        if rec is None:
            return True
        await rec.cancelled.wait()
        now = self.records.get(rid)
        return now is None or now.response["status"] == "cancelled"

    def conversation(self, rid: str) -> list[dict[str, Any]]:
        """The items a response continuing ``rid`` starts from: each earlier turn's input
        items and output, oldest first; a 404 naming ``previous_response_id`` when a link
        is gone, a 400 while ``rid`` is still running."""
        chain: list[Record] = []
        seen: set[str] = set()
        at: str | None = rid
        while at is not None and at not in seen:
            seen.add(at)
            rec = self._record(at, "previous_response_id")
            if rec.response["status"] in ACTIVE:
                raise APIError(f"response {at!r} is still {rec.response['status']}",
                               param="previous_response_id")
            chain.append(rec)
            at = rec.previous
        items: list[dict[str, Any]] = []
        for rec in reversed(chain):
            items += rec.input_items + rec.response["output"]
        return items

    def input_items(self, rid: str, limit: int = 20, order: str = "desc",
                    after: str | None = None) -> dict[str, Any]:
        """One page of ``rid``'s input items, as OpenAI lists them."""
        if not 1 <= limit <= 100:
            raise APIError("limit must be in [1, 100]", param="limit")
        if order not in ("asc", "desc"):
            raise APIError("order must be 'asc' or 'desc'", param="order")
        items = list(self._record(rid).input_items)
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [i.get("id") for i in items]
            if after not in ids:
                raise APIError(f"no input item {after!r} in response {rid!r}", param="after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return {"object": "list", "data": page,
                "first_id": page[0].get("id") if page else None,
                "last_id": page[-1].get("id") if page else None,
                "has_more": len(items) > limit}


def _answer(fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """An ``APIError`` crosses the handle as data: the ingress raises it again."""
    try:
        return {"ok": fn(*args, **kwargs)}
    except APIError as e:
        return _error(e)


def _error(e: APIError) -> dict[str, Any]:
    return {"error": {"message": e.message, "status": e.status, "type": e.type,
                      "param": e.param, "code": e.code}}


@serve.deployment(name=STORE_DEPLOYMENT, num_replicas=1, max_ongoing_requests=100_000,
                  ray_actor_options={"num_cpus": 0})
class ResponseStoreServer:
    """The store, one replica for every ingress replica (background waits are long
    calls, hence the large bound on ongoing requests)."""

    def __init__(self, max_entries: int = 10_000) -> None:
        self.store = ResponseStore(max_entries)

    async def call(self, method: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if method not in ("put", "update", "append", "beat", "owner", "get", "delete",
                          "cancel", "conversation", "input_items", "stats"):
            raise ValueError(f"unknown store method {method!r}")
        return _answer(getattr(self.store, method), *args, **kwargs)

    async def wait_cancelled(self, rid: str) -> bool:
        return await self.store.wait_cancelled(rid)

    async def wait_events(self, rid: str, after: int, timeout_s: float) -> dict[str, Any]:
        try:
            return {"ok": await self.store.wait_events(rid, after, timeout_s)}
        except APIError as e:
            return _error(e)


class StoreClient:
    """The ingress's side: the store's methods as coroutines raising the ``APIError``
    the store answered."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def __call__(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _unwrap(await self.handle.call.remote(method, *args, **kwargs))

    async def wait_events(self, rid: str, after: int, timeout_s: float) -> dict[str, Any]:
        return _unwrap(await self.handle.wait_events.remote(rid, after, timeout_s))

    async def wait_cancelled(self, rid: str) -> bool:
        return bool(await self.handle.wait_cancelled.remote(rid))


def _unwrap(answer: dict[str, Any]) -> Any:
    if "error" in answer:
        raise APIError(**answer["error"])
    return answer["ok"]
