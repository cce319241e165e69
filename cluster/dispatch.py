"""Dispatch from the ingress: one request's chunks from the engine replicas, with failover.

``stream_from_replicas`` sends a request through the deployment handle (whose
``PrefixAffinityRouter`` picks the replica, see ``router``) and reads its chunks from
the ingress's channel (see ``channel``). A replica that dies before sending a token gets
the request retried on another; one that dies mid-stream gets the stream resumed
on another from the tokens already sent (see ``resume``), and so does a non-streamed
request from its last checkpoint.
``merge_streams`` interleaves the streams of a request's prompts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError

from pagedserve.cluster.channel import ChannelClient
from pagedserve.cluster.protocol import APIError
from pagedserve.cluster.resume import StreamCursor, resumable
from pagedserve.cluster.router import known_replicas
from pagedserve.cluster.wire import EngineChunk, EngineRequest

MAX_ATTEMPTS = 3  # a request whose replica died moves on (resumed, past its first token)
CHANNEL_GRACE_S = 30.0  # after its call returned, a request's last chunks must arrive by then
# A retried or resumed request's first chunk must arrive by then (the default of
# ``FailoverPolicy.wait_s``): a dead replica's replacement takes seconds; a cluster that
# cannot start one must not hang its clients.
FAILOVER_WAIT_S = 60.0
# Meanwhile, this often: is the application being deleted (no replacement will come)?
SHUTDOWN_POLL_S = 1.0

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FailoverPolicy:
    """What the ingress does when an engine replica dies under a request.

    ``resume``: a request that has sent tokens goes on from another replica (else its
    stream ends with an error event). ``wait_s``: how long a moved request waits for a
    replica to take it, e.g. the replacement of the only one (a large model's replica
    can take minutes to load), before it fails with a 503.
    """

    resume: bool = True
    wait_s: float = FAILOVER_WAIT_S


@dataclass
class _CallEnded:
    """The request's ``run`` call returned (``error`` None) or failed."""

    error: BaseException | None = None


async def _watch(response: Any, q: asyncio.Queue[Any]) -> None:
    try:
        await response
    except asyncio.CancelledError:
        raise
    except Exception as e:  # the reader decides what each failure means
        q.put_nowait(_CallEnded(e))
    else:
        q.put_nowait(_CallEnded())


async def stream_from_replicas(client: ChannelClient, handle: Any, req: EngineRequest,
                               on_failover: Callable[[str], None] | None = None,
                               policy: FailoverPolicy = FailoverPolicy(),
                               cursor: StreamCursor | None = None
                               ) -> AsyncIterator[EngineChunk]:
    """One request's chunks: routed by ``router.PrefixAffinityRouter``, received on
    ``client``'s channel.

    The ``run`` call carries routing, load accounting and cancellation; its chunks arrive
    through the channel (see ``channel``). A replica that dies (or whose TP group fails)
    before sending a token gets the request retried on another replica; one that dies
    after gets the stream resumed on another from the tokens already sent (see
    ``resume``; an ``n > 1`` stream as one request per unfinished sample), unless
    ``policy.resume`` is False: then the error ends the stream. A moved request waits
    ``policy.wait_s`` for a replica to take it. ``cursor``: the stream of
    one sample ``split`` off such a request (its ``req`` resumes already).
    ``on_failover("retry" | "resume")`` counts each. Leaving early (the caller cancelled
    or stopped iterating) cancels the call, which aborts the request in the replica's
    scheduler.
    """
    exclude = list(req.exclude_replicas)
    if cursor is None and policy.resume and resumable(req):
        cursor = StreamCursor(req.params.n)
    attempt_req, sent = req, False
    for attempt in range(MAX_ATTEMPTS):
        # A non-streamed request sends checkpoints only where they can be resumed from.
        r = replace(attempt_req, channel=client.channel, exclude_replicas=tuple(exclude),
                    checkpoint=cursor is not None)
        replica, retry, done = None, False, False
        with client.receiving(req.request_id) as q:
            client.ensure_subscribed()
            response = handle.run.remote(r)
            watcher = asyncio.ensure_future(_watch(response, q))
            # A retry waits for a replica to take it (the dead one's replacement, if it
            # was the only one), but not forever.
            loop = asyncio.get_running_loop()
            deadline = loop.time() + policy.wait_s if attempt else None
            lost = "no engine replica took the request over" if attempt else ""
            try:
                while True:
                    if deadline is None:
                        item = await client.next_chunk(q)
                    else:  # every chunk is sent: it is on its way, or it is lost
                        item = await _next_before(client, q, deadline, lost, handle)
                    if isinstance(item, _CallEnded):
                        if item.error is not None:
                            raise item.error
                        deadline, lost = loop.time() + CHANNEL_GRACE_S, ""
                        continue
                    if item.replica in exclude:
                        continue  # a late chunk of an attempt already given up
                    if lost:  # taken over: from here on it streams as any request does
                        deadline, lost = None, ""
                    replica = item.replica
                    if item.error is not None:
                        if (item.retryable and (cursor is not None or not sent)
                                and attempt + 1 < MAX_ATTEMPTS
                                and _another_replica(handle, [*exclude, replica])):
                            retry = done = True
                            break
                        raise APIError(item.error, status=item.status,
                                       type="invalid_request_error" if item.status == 400
                                       else "service_unavailable")
                    if cursor is not None:
                        if cursor.resuming:  # a resumed attempt repeats them first
                            trimmed = cursor.trim(item)
                            if trimmed is None:
                                continue
                            item = trimmed
                        cursor.record(item)
                    sent = sent or bool(item.deltas)
                    yield item
                    if item.finished:
                        done = True
                        break
            except BackPressureError as e:
                raise overloaded_error(e) from None
            except (RayActorError, ActorUnavailableError) as e:
                # Serve drops a dead replica from the router at once, so the next attempt
                # goes to another one, or waits for the replacement of the only one.
                if (cursor is None and sent) or attempt + 1 >= MAX_ATTEMPTS:
                    raise replica_failed_error(e) from None
                retry = True
            finally:
                if not done:
                    # Cancels the assignment or the replica's task (-> abort in the
                    # scheduler).
                    with contextlib.suppress(Exception):
                        response.cancel()
                    watcher.cancel()
        if not retry:
            return
        resumed = cursor is not None and cursor.num_tokens > 0
        logger.warning("request %s: replica %s failed, %s", req.request_id, replica,
                       f"resuming after {cursor.num_tokens} tokens" if resumed else "retrying")
        if on_failover is not None:
            on_failover("resume" if resumed else "retry")
        if replica is not None:
            exclude.append(replica)
        if resumed and cursor is not None:
            if len(cursor.samples) > 1:
                req = replace(req, exclude_replicas=tuple(exclude))
                async with contextlib.aclosing(_resumed_samples(
                        client, handle, cursor.split(req), on_failover, policy)) as split:
                    async for c in split:
                        yield c
                return
            attempt_req = cursor.resume(req)


async def _resumed_samples(client: ChannelClient, handle: Any,
                           samples: list[tuple[int, EngineRequest, StreamCursor]],
                           on_failover: Callable[[str], None] | None,
                           policy: FailoverPolicy) -> AsyncIterator[EngineChunk]:
    """The split samples of an ``n > 1`` stream, each numbered as it was."""
    streams = [stream_from_replicas(client, handle, r, on_failover, policy, cur)
               for _, r, cur in samples]
    async with contextlib.aclosing(_interleave(streams)) as chunks:
        async for k, c in chunks:
            i = samples[k][0]
            yield replace(c, deltas=[replace(d, index=i) for d in c.deltas])


async def _next_before(client: ChannelClient, q: asyncio.Queue[Any], deadline: float,
                       lost: str, handle: Any) -> Any:
    """The next item by ``deadline``, else a 503. While a moved request waits for a
    replica to take it (``lost``), a deleted application (a shutdown) ends the wait at
    once: its replicas are gone and none will replace them."""
    loop = asyncio.get_running_loop()
    while True:
        until = min(deadline, loop.time() + SHUTDOWN_POLL_S) if lost else deadline
        try:
            async with asyncio.timeout_at(until):
                return await client.next_chunk(q)
        except TimeoutError:
            if loop.time() >= deadline:
                raise APIError(lost or "engine replica's stream was lost", status=503,
                               type="service_unavailable") from None
            if await _app_deleting(handle):
                raise APIError("the server is shutting down: no engine replica is left",
                               status=503, type="service_unavailable") from None


async def _app_deleting(handle: Any) -> bool:
    """Whether ``handle``'s application is being deleted (False when it cannot tell)."""
    name = getattr(handle, "app_name", None)
    if not name:
        return False
    from ray import serve

    try:
        status = await asyncio.to_thread(serve.status)
    except Exception:  # the controller is out of reach: keep waiting for it
        return False
    app = status.applications.get(name)
    return app is None or app.status == "DELETING"


def _another_replica(handle: Any, tried: list[str]) -> bool:
    """Whether a replica not yet tried is up (the router would otherwise send the retry
    back to one that refused it, whose answers this reader skips as stale)."""
    name = getattr(handle, "deployment_name", None)
    if name is None:
        return True
    known = known_replicas(name, getattr(handle, "app_name", None))
    return not known or bool(set(known) - set(tried))


def overloaded_error(e: BackPressureError) -> APIError:
    """Serve's backpressure as the 503 clients retry after a second."""
    return APIError(f"server overloaded, retry later: {e.message}", status=503,
                    type="server_overloaded", code="overloaded", headers={"Retry-After": "1"})


def replica_failed_error(e: Exception) -> APIError:
    """A replica (or its actor) that died under a request, after the last retry."""
    return APIError(f"engine replica failed: {e}", status=503, type="service_unavailable")


async def merge_streams(client: ChannelClient, handle: Any, reqs: list[EngineRequest],
                        on_failover: Callable[[str], None] | None = None,
                        policy: FailoverPolicy = FailoverPolicy()
                        ) -> AsyncIterator[tuple[int, EngineChunk]]:
    """Chunks of several prompts' streams, interleaved as they come."""
    async for i, c in _interleave([stream_from_replicas(client, handle, r, on_failover,
                                                        policy) for r in reqs]):
        yield i, c


async def _interleave(streams: list[AsyncGenerator[EngineChunk, None]]
                      ) -> AsyncIterator[tuple[int, EngineChunk]]:
    """Items of several streams as they come, tagged with the stream's index; the first
    error ends them all."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for c in only:
                yield 0, c
        return
    q: asyncio.Queue[tuple[int, EngineChunk | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncGenerator[EngineChunk, None]) -> None:
        try:
            async for c in stream:
                q.put_nowait((i, c))
            q.put_nowait((i, None))
        except Exception as e:
            q.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, st)) for i, st in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await q.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
