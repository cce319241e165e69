"""One multiplexed stream per (ingress, engine replica) for every request's chunks.

A Ray streamed item costs about 0.4 ms of CPU to send and 0.5 ms to receive
here, however small it is, and a 32-stream burst flushes 32 of them together
in the same engine step: that step ran about 30 ms longer than its
neighbours (replica and ingress share the node's cores with the forward). So
each request is a plain call (``EngineServer.run``), which keeps Serve's
routing, load accounting and cancellation (cancelling it aborts the request),
while its chunks go into the replica's ``Outboxes`` under the caller's
channel id. The ingress holds one ``subscribe`` stream per replica
(``ChannelClient``), and each of its items is the list of every chunk the
replica produced for that ingress since the last one: one message per step,
not one per request. Chunks of a request stay in order (one stream carries
them); a replica buffers them until the ingress subscribes, and ends an idle
subscription so that it never holds up a replica's graceful shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from pagedserve.cluster.wire import ReplicaCall, chunk_from_wire

logger = logging.getLogger(__name__)

# A replica ends a subscription idle this long with nothing in flight. Serve counts a
# subscription as an ongoing request, so a replica being stopped waits for it: short, so
# that an idle replica stops at once; a request after a pause subscribes again.
SUBSCRIPTION_IDLE_S = 0.25
ORPHAN_S = 60.0  # chunks nobody subscribed to for this long are dropped (the ingress died)
ABANDONED_S = 10.0  # a request whose chunks nobody has taken for this long is aborted
RESUBSCRIBE_EVERY_S = 0.5  # a waiting request re-checks its ingress's subscriptions this often


@dataclass
class _Box:
    items: list[Any] = field(default_factory=list)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    in_flight: int = 0
    subscribers: int = 0
    since: float = field(default_factory=time.monotonic)  # unsubscribed since
    pending_since: float = 0.0  # when the oldest chunk not yet taken was sent
    owner: Any = None  # the subscribing ingress's actor handle, to ask if it still lives
    owner_dead: bool = False


class Outboxes:
    """Replica side: the chunks waiting for each ingress channel."""

    def __init__(self, idle_s: float = SUBSCRIPTION_IDLE_S, orphan_s: float = ORPHAN_S) -> None:
        self.idle_s = idle_s
        self.orphan_s = orphan_s
        self._boxes: dict[str, _Box] = {}
        self.chunks_sent = 0
        self.messages_sent = 0

    def _box(self, channel: str) -> _Box:
        box = self._boxes.get(channel)
        if box is None:
            self._sweep()
            box = self._boxes[channel] = _Box()
        return box

    def _sweep(self) -> None:
        """Forget channels whose ingress never came back for their chunks."""
        now = time.monotonic()
        for ch, box in list(self._boxes.items()):
            if box.subscribers == 0 and box.in_flight == 0 and (
                    not box.items or now - box.since > self.orphan_s):
                del self._boxes[ch]

    @contextlib.contextmanager
    def sending(self, channel: str) -> Iterator[Callable[[Any], None]]:
        """Count one request in flight on ``channel``; yields the function that sends a chunk."""
        box = self._box(channel)
        box.in_flight += 1

        def send(item: Any) -> None:
            if not box.items:
                box.pending_since = time.monotonic()
            box.items.append(item)
            box.event.set()
            self.chunks_sent += 1

        try:
            yield send
        finally:
            box.in_flight -= 1

    async def subscribe(self, channel: str, owner: Any = None) -> AsyncIterator[list[Any]]:
        """Batches of ``channel``'s chunks, in order, until it is idle with nothing in flight.

        ``owner`` is whatever the caller can later check the ingress's life with (see
        ``watched``).
        """
        box = self._box(channel)
        if owner is not None:
            box.owner = owner
        box.subscribers += 1
        try:
            while True:
                if not box.items:
                    box.event.clear()
                    try:
                        async with asyncio.timeout(self.idle_s):
                            await box.event.wait()
                    except TimeoutError:
                        if box.in_flight == 0 and not box.items:
                            return
                        continue
                # The step that produced this chunk woke its other streams too: let them
                # add theirs, so the whole step goes out as one message.
                await asyncio.sleep(0)
                items, box.items = box.items, []
                self.messages_sent += 1
                yield items
        finally:
            box.subscribers -= 1
            box.since = time.monotonic()

    def abandoned(self, channel: str, after_s: float = ABANDONED_S) -> bool:
        """Whether ``channel``'s ingress is gone: known dead, or its chunks have waited,
        unsubscribed, for over ``after_s``.

        Ray neither cancels a running actor call nor ends a streamed one when its caller
        dies, so without this an orphaned request would hold its blocks and a batch slot
        to its last token. A live ingress re-subscribes within ``RESUBSCRIBE_EVERY_S``
        while it has a request waiting; a killed one is found by ``watched``'s pings.
        """
        box = self._boxes.get(channel)
        return box is not None and (box.owner_dead or (
            box.subscribers == 0 and bool(box.items)
            and time.monotonic() - box.pending_since > after_s))

    def watched(self) -> list[tuple[str, Any]]:
        """``(channel, owner)`` of every channel with a request in flight whose ingress
        is not yet known dead: the ones worth checking (``mark_owner_dead``)."""
        return [(ch, b.owner) for ch, b in self._boxes.items()
                if b.in_flight and b.owner is not None and not b.owner_dead]

    def mark_owner_dead(self, channel: str) -> None:
        box = self._boxes.get(channel)
        if box is not None:
            box.owner_dead = True

    def stats(self) -> dict[str, int]:
        return {"channels": len(self._boxes), "chunks_sent": self.chunks_sent,
                "messages_sent": self.messages_sent,
                "subscribed": sum(1 for b in self._boxes.values() if b.subscribers),
                "buffered_chunks": sum(len(b.items) for b in self._boxes.values())}


class ChannelClient:
    """Ingress side: one subscription per engine replica, chunks handed to their requests.

    ``replicas`` lists the engine replicas this ingress knows (its router's view);
    ``ensure_subscribed`` is cheap and runs before every dispatch and, while a request
    waits, every ``RESUBSCRIBE_EVERY_S``, so a replica that was just added or that
    ended an idle subscription is picked up.
    """

    def __init__(self, handle: Any, replicas: Callable[[], list[str]], owner: Any = None) -> None:
        """``owner``: this ingress's own actor handle, which replicas ping to learn that
        it died with requests in flight (``Outboxes.abandoned``)."""
        self.channel = uuid.uuid4().hex
        self._owner = owner
        self._stream = handle.options(stream=True)
        self._replicas = replicas
        self._subs: dict[str, asyncio.Task[None]] = {}
        self._queues: dict[str, asyncio.Queue[Any]] = {}

    def ensure_subscribed(self) -> None:
        for rid in self._replicas():
            if rid not in self._subs:
                self._subs[rid] = asyncio.get_running_loop().create_task(self._pump(rid))

    async def _pump(self, replica: str) -> None:
        ended_idle = False
        try:
            gen = self._stream.subscribe.remote(ReplicaCall(replica), self.channel,
                                                self._owner)
            async for batch in gen:
                for raw in batch:
                    chunk = chunk_from_wire(raw)
                    q = self._queues.get(chunk.request_id)
                    if q is not None:
                        q.put_nowait(chunk)
            ended_idle = True
        except Exception as e:  # the replica died: its requests' calls fail on their own
            logger.debug("subscription to replica %s ended: %r", replica, e)
        finally:
            if self._subs.get(replica) is asyncio.current_task():
                del self._subs[replica]
                # The replica saw nothing in flight, but a request may have been sent
                # since: subscribe again at once rather than at its next wait.
                if ended_idle and self._queues:
                    self.ensure_subscribed()

    @contextlib.contextmanager
    def receiving(self, request_id: str) -> Iterator[asyncio.Queue[Any]]:
        """The queue ``request_id``'s chunks arrive on, for as long as the block runs.

        The caller may put its own markers on it too (the end of its call).
        """
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already receiving")
        q: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[request_id] = q
        try:
            yield q
        finally:
            self._queues.pop(request_id, None)

    async def next_chunk(self, q: asyncio.Queue[Any]) -> Any:
        """The request's next item; meanwhile keep this ingress subscribed everywhere."""
        while True:
            try:
                async with asyncio.timeout(RESUBSCRIBE_EVERY_S):
                    return await q.get()
            except TimeoutError:
                self.ensure_subscribed()
