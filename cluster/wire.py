"""What travels between the ingress and the engine replicas, and how it is folded.

``EngineRequest`` goes out (tokenised prompt, sampling params, prefix-cache
hashes for the router); ``EngineChunk`` comes back once per step with one
``SampleDelta`` per sample that advanced. ``DeltaTracker`` turns the engine's
cumulative snapshots into those deltas, and ``merge_deltas`` folds several
steps into one message for non-streaming requests. ``pace_deltas`` decides
when a replica sends: every step, once per stream interval, or once at the end;
``StreamPacer`` sets that interval from how many streams the replica serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from pagedserve.cluster.outputs import RequestOutput
from pagedserve.scheduler.pooling_params import PoolingParams
from pagedserve.scheduler.sampling_params import SamplingParams


@dataclass
class EngineRequest:
    """A tokenised request on its way to an engine replica (the router reads the hashes)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    block_hashes: list[bytes] = field(default_factory=list)
    cache_salt: str | None = None
    exclude_replicas: tuple[str, ...] = ()
    stream: bool = True  # False: the replica sends only the ack and the final chunk ...
    checkpoint: bool = False  # ... and, if True, its tokens so far now and then (``resume``)
    channel: str | None = None  # the ingress channel its chunks go to (``EngineServer.run``)
    lora: tuple[str, str] | None = None  # (adapter name, PEFT directory); None: base model
    priority: int = 0  # lower runs first, under the replicas' priority policy
    pooling: PoolingParams | None = None  # an embedding request (``EngineServer.embed``)
    # Outputs a dead replica already streamed: the request goes on after them (``resume``).
    resumed_token_ids: list[int] | None = None
    # The prompt's images, decoded by the ingress (PIL images; ``image_chat``).
    images: list[Any] | None = None
    # A prompt given as input embeddings (a CPU tensor ``[tokens, hidden]``, decoded by
    # the ingress; ``prompt_embeds``): ``prompt_token_ids`` are its placeholders.
    prompt_embeds: Any = None

    def engine_prompt(self) -> Any:
        """What ``LLMEngine.add_request`` takes as the prompt: its token ids, or its
        embeddings as an ``EmbedsPrompt``."""
        if self.prompt_embeds is None:
            return self.prompt_token_ids
        from pagedserve.cluster.prompt_embeds import EmbedsPrompt

        return EmbedsPrompt(self.prompt_embeds)


@dataclass
class ReplicaCall:
    """A control call (stats, health probe, sleep...) that must reach one named replica;
    ``args`` are the call's own (a sleep level, a model path)."""

    target_replica: str
    timeout_s: float = 30.0
    args: dict[str, Any] = field(default_factory=dict)


# ---- ingress <-> engine replica wire format --------------------------------------------


@dataclass
class SampleDelta:
    """What one sample gained in one engine step."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    sampled_logprobs: list[float | None] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class EngineChunk:
    """One streamed item from an engine replica: deltas, or an error before any token.

    ``retryable`` errors (a dead tensor-parallel group) move the request to another
    replica: retried if nothing was sent to the client yet, else resumed (``resume``).
    """

    request_id: str
    replica: str
    deltas: list[SampleDelta] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finished: bool = False
    error: str | None = None
    status: int = 200
    retryable: bool = False
    prompt_logprobs: list[dict[int, float] | None] | None = None  # with the first tokens
    prompt_ranks: list[int | None] | None = None  # each prompt token's rank, with them


def chunk_to_wire(c: EngineChunk) -> tuple:
    """``EngineChunk`` as nested tuples of plain values, the only thing sent per step.

    Ray serialises plain values with msgpack; a dataclass takes its cloudpickle
    path, which per streamed token costs the replica GIL time its forward pass
    needs (and the ingress as much again to load). Logprob dicts travel as
    (token, logprob) pairs.
    """
    deltas = tuple(
        (d.index, d.text, d.token_ids,
         None if d.logprobs is None else [list(lp.items()) for lp in d.logprobs],
         d.sampled_logprobs, d.finish_reason, d.stop_reason)
        for d in c.deltas)
    prompt_lps = None if c.prompt_logprobs is None else [
        None if lp is None else list(lp.items()) for lp in c.prompt_logprobs]
    return (c.request_id, c.replica, deltas, c.prompt_tokens, c.cached_tokens, c.finished,
            c.error, c.status, c.retryable, prompt_lps, c.prompt_ranks)


def chunk_from_wire(t: tuple | list) -> EngineChunk:
    """Inverse of :func:`chunk_to_wire` (msgpack may hand back lists for tuples)."""
    (rid, replica, deltas, prompt_tokens, cached, finished, error, status, retryable, plps,
     ranks) = t
    return EngineChunk(
        rid, replica,
        [SampleDelta(i, text, list(ids),
                     None if lps is None else [{int(k): v for k, v in lp} for lp in lps],
                     None if sampled is None else list(sampled), fr, sr)
         for i, text, ids, lps, sampled, fr, sr in deltas],
        prompt_tokens, cached, finished, error, status, retryable,
        None if plps is None else [None if lp is None else {int(k): v for k, v in lp}
                                   for lp in plps],
        None if ranks is None else list(ranks))


def merge_deltas(acc: dict[int, SampleDelta], new: list[SampleDelta]) -> None:
    """Fold step deltas into one delta per sample (for requests nobody streams)."""
    for d in new:
        a = acc.get(d.index)
        if a is None:
            acc[d.index] = SampleDelta(d.index, d.text, list(d.token_ids),
                                       None if d.logprobs is None else list(d.logprobs),
                                       None if d.sampled_logprobs is None
                                       else list(d.sampled_logprobs),
                                       d.finish_reason, d.stop_reason)
            continue
        a.text += d.text
        a.token_ids.extend(d.token_ids)
        if a.logprobs is not None and d.logprobs is not None:
            a.logprobs.extend(d.logprobs)
        if a.sampled_logprobs is not None and d.sampled_logprobs is not None:
            a.sampled_logprobs.extend(d.sampled_logprobs)
        a.finish_reason, a.stop_reason = d.finish_reason, d.stop_reason


class DeltaTracker:
    """Turns the engine's outputs into per-sample deltas (sent once each): cumulative
    snapshots by what was sent before, ``delta`` outputs as they are."""

    def __init__(self, n: int) -> None:
        self._sent_text = [0] * n
        self._sent_tokens = [0] * n
        self._done = [False] * n

    def deltas(self, out: RequestOutput) -> list[SampleDelta]:
        result = []
        for o in out.outputs:
            i = o.index
            if self._done[i]:
                continue
            k0, c0 = (0, 0) if out.delta else (self._sent_tokens[i], self._sent_text[i])
            new_ids = o.token_ids[k0:]
            text = o.text[c0:]
            if not new_ids and not text and o.finish_reason is None:
                continue
            lps = sampled = None
            if o.logprobs is not None:
                lps = o.logprobs[k0:]
                sampled = [d.get(t) for d, t in zip(lps, new_ids)]  # the engine always has it
            result.append(SampleDelta(i, text, list(new_ids), lps, sampled, o.finish_reason,
                                      o.stop_reason))
            self._sent_tokens[i] = len(o.token_ids)
            self._sent_text[i] = len(o.text)
            self._done[i] = o.finish_reason is not None
        return result


MAX_STREAM_INTERVAL_S = 1.0


class StreamPacer:
    """One replica's stream interval: a floor, stretched to keep a message budget.

    Every streamed message costs CPU in the replica, the ingress, the HTTP
    proxy and the client, one to two milliseconds in all. With many concurrent
    streams that cost grows with the stream count while the forward's does
    not, and on a CPU node it runs on the cores the forward needs. So beside
    the per-stream floor (``floor_s``, Ray Serve LLM's 50 ms batching
    interval) a replica keeps a budget of ``budget_per_s`` messages a second
    across all its streams: each stream's interval is ``active /
    budget_per_s``, never under the floor nor over ``MAX_STREAM_INTERVAL_S``
    (unless the floor is). First and final tokens are never held. A budget of
    0 turns the stretch off.

    Non-streamed requests send checkpoints: their tokens so far, every
    ``checkpoint_s`` (see ``checkpointing``), so that the ingress can resume
    one whose replica dies instead of computing it again.
    """

    def __init__(self, floor_s: float, budget_per_s: float, checkpoint_s: float = 1.0) -> None:
        if floor_s < 0:
            raise ValueError(f"stream interval must be >= 0, got {floor_s}")
        if budget_per_s < 0:
            raise ValueError(f"stream message budget must be >= 0, got {budget_per_s}")
        if checkpoint_s < 0:
            raise ValueError(f"checkpoint interval must be >= 0, got {checkpoint_s}")
        self.floor_s = floor_s
        self.budget_per_s = budget_per_s
        self.checkpoint_s = checkpoint_s
        self.active = 0
        self.checkpoints = 0  # non-streamed requests sending checkpoints

    def interval(self) -> float:
        if self.budget_per_s <= 0:
            return self.floor_s
        stretched = min(MAX_STREAM_INTERVAL_S, self.active / self.budget_per_s)
        return max(self.floor_s, stretched)

    @contextlib.contextmanager
    def streaming(self) -> Iterator[Callable[[], float]]:
        """Count one stream while it is open; yields the interval to pace it by."""
        self.active += 1
        try:
            yield self.interval
        finally:
            self.active -= 1

    def checkpoint_interval(self) -> float:
        """A non-streamed request's checkpoint interval: ``checkpoint_s``, stretched so
        that checkpoints alone stay within the budget (they are counted with the streams,
        but never stretch them; no cap, since no client waits on them)."""
        if self.budget_per_s <= 0:
            return self.checkpoint_s
        return max(self.checkpoint_s, (self.active + self.checkpoints) / self.budget_per_s)

    @contextlib.contextmanager
    def checkpointing(self) -> Iterator[Callable[[], float] | None]:
        """Count one checkpointing request while it runs; yields the interval to pace it
        by (None when checkpoints are off: one message at the end)."""
        if self.checkpoint_s <= 0:
            yield None
            return
        self.checkpoints += 1
        try:
            yield self.checkpoint_interval
        finally:
            self.checkpoints -= 1


async def pace_deltas(
    outs: AsyncIterator[RequestOutput],
    tracker: DeltaTracker,
    interval_s: float | Callable[[], float] | None,
    on_tokens: Callable[[int], None] | None = None,
    checkpoints: bool = False,
) -> AsyncIterator[tuple[list[SampleDelta], RequestOutput]]:
    """What an engine replica sends, and when: (deltas, latest snapshot) per message.

    ``interval_s`` None (nobody streams): one message at the end. Otherwise
    the first tokens go at once, then at most one merged message per
    interval (0: every step; a callable is asked afresh at each decision, so
    the interval follows the replica's load). Held tokens go out when the
    interval ends even if the next step is slow (a long prefill in the same
    batch), not only with the next token. Closing this generator closes
    ``outs``, which aborts the request in the engine. ``checkpoints`` (a non-streamed
    request's, whose client waits for the end anyway): the first tokens wait an interval
    too, and held tokens go out with the first step after the interval, not on a timer
    (which would cost a task and a timed wait per step).
    """
    current: Callable[[], float] | None = (
        None if interval_s is None else interval_s if callable(interval_s)
        else (lambda: interval_s))
    pending: dict[int, SampleDelta] = {}
    latest: RequestOutput | None = None
    sent_tokens, last_sent, deadline = checkpoints, 0.0, None
    if checkpoints:
        last_sent = time.monotonic()
    nxt: asyncio.Future[RequestOutput] | None = None
    try:
        while True:
            if pending and deadline is not None:
                # Only a held message needs a timed wait (and so a task for the next step).
                if nxt is None:
                    nxt = asyncio.ensure_future(anext(outs))
                done, _ = await asyncio.wait({nxt}, timeout=deadline - time.monotonic())
                if not done and latest is not None:
                    yield [pending[i] for i in sorted(pending)], latest
                    pending, deadline = {}, None
                    continue
            try:
                out = await (nxt if nxt is not None else anext(outs))
            except StopAsyncIteration:
                return
            nxt, latest = None, out
            deltas = tracker.deltas(out)
            if on_tokens is not None:
                on_tokens(max((len(d.token_ids) for d in deltas), default=0))
            gap = None if current is None else current()
            if not out.finished and (gap is None or (
                    sent_tokens and time.monotonic() < last_sent + gap)):
                merge_deltas(pending, deltas)
                if gap is not None and deadline is None and not checkpoints:
                    deadline = last_sent + gap
                continue
            if pending:
                merge_deltas(pending, deltas)
                deltas, pending, deadline = [pending[i] for i in sorted(pending)], {}, None
            sent_tokens = sent_tokens or any(d.token_ids for d in deltas)
            last_sent = time.monotonic()
            yield deltas, out
    finally:
        if nxt is not None:
            nxt.cancel()
            with contextlib.suppress(BaseException):
                await nxt
        aclose = getattr(outs, "aclose", None)
        if aclose is not None:
            await aclose()
