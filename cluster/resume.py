"""Mid-stream failover: a stream whose replica died goes on from another replica.

A replica that dies (its actor, its node, one of its tensor-parallel ranks) takes
its requests' KV blocks with it, but not what the ingress has already forwarded
to the client: the output token ids. So instead of ending an open stream with an
error, the ingress sends the request again, to a replica not yet tried, with
``EngineRequest.resumed_token_ids`` set to those tokens. That replica recomputes
their KV as it would for a request preempted in recompute mode (one prefill,
prefix-cache hits included) and samples on. Greedy requests continue with the
tokens the dead replica would have produced, and so do seeded ones: a seeded
draw depends only on the seed and the output position (``seeded_uniform``), not
on generator state the dead replica held. Unseeded requests continue with a
valid sample of the same distribution.

The new replica's outputs carry the resumed tokens and their text again (as
``LLMEngine.add_request`` documents); :class:`StreamCursor` drops that repeat, so
the client sees one stream, each token once. The samples of an ``n > 1`` request
shared their prompt's blocks on the dead replica; each unfinished one goes on as
a request of its own (``StreamCursor.split``: sample ``i`` with ``seed + i``, the
rule its tokens were drawn by), and finished ones are done.

A non-streamed request's replica sends the ingress checkpoints instead of a
stream (its tokens so far, every ``checkpoint_interval_ms``; see
``StreamPacer``): nothing of it reached the client, but its tokens reached the
ingress, so it resumes from them as a stream does, and loses at most one
interval of decoding instead of all of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pagedserve.cluster.wire import EngineChunk, EngineRequest, SampleDelta


def resumable(req: EngineRequest) -> bool:
    """Whether a stream of ``req`` can go on elsewhere after tokens were sent (every
    generation can; an embedding has no stream)."""
    return req.pooling is None


@dataclass
class _Sample:
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    finished: bool = False


class StreamCursor:
    """What a stream forwarded so far, per sample, and the repeat a resumed attempt
    starts with (its first tokens and their text) to drop."""

    def __init__(self, n: int = 1) -> None:
        self.samples = [_Sample() for _ in range(n)]
        self.resuming = False  # set once an attempt resumes: its chunks go through trim
        self._skip_tokens = 0
        self._skip_text = ""

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples)

    def record(self, chunk: EngineChunk) -> None:
        """Note a chunk on its way to the client."""
        for d in chunk.deltas:
            s = self.samples[d.index]
            s.token_ids.extend(d.token_ids)
            s.text.append(d.text)
            s.finished = s.finished or d.finish_reason is not None

    def resume(self, req: EngineRequest) -> EngineRequest:
        """A single-sample ``req`` continuing from what was forwarded; the next attempt's
        repeat of it will be dropped. Prompt logprobs went out with the first tokens."""
        assert len(self.samples) == 1, "an n > 1 stream resumes per sample (split)"
        s = self.samples[0]
        self.resuming = True
        self._skip_tokens = len(s.token_ids)
        self._skip_text = "".join(s.text)
        return replace(req, resumed_token_ids=list(s.token_ids),
                       params=replace(req.params, prompt_logprobs=None))

    def split(self, req: EngineRequest) -> list[tuple[int, EngineRequest, StreamCursor]]:
        """Each unfinished sample of an ``n > 1`` ``req`` as a request of its own
        (``request_id-s{i}``, ``params.for_child(i)``) resuming from its tokens, with
        the cursor that follows it: ``(i, request, cursor)``."""
        out = []
        for i, s in enumerate(self.samples):
            if s.finished:
                continue
            cur = StreamCursor()
            cur.samples[0] = _Sample(list(s.token_ids), list(s.text))
            child = replace(req, request_id=f"{req.request_id}-s{i}",
                            params=req.params.for_child(i))
            out.append((i, cur.resume(child), cur))
        return out

    def trim(self, chunk: EngineChunk) -> EngineChunk | None:
        """``chunk`` of a resumed attempt without what the client already has; None if
        nothing is left (the attempt's acknowledgement, or a pure repeat).

        The repeated text must be what was sent: a replica that decoded the same
        tokens to other text would corrupt the stream, so that is an error.
        """
        deltas = []
        for d in chunk.deltas:
            if d.index == 0 and (self._skip_tokens or self._skip_text):
                d = self._trim_delta(d)
                if not (d.token_ids or d.text or d.finish_reason):
                    continue
            deltas.append(d)
        if not deltas and not chunk.finished and chunk.error is None:
            return None
        return replace(chunk, deltas=deltas, prompt_logprobs=None, prompt_ranks=None)

    def _trim_delta(self, d: SampleDelta) -> SampleDelta:
        k = min(self._skip_tokens, len(d.token_ids))
        t = min(len(self._skip_text), len(d.text))
        if d.text[:t] != self._skip_text[:t]:
            raise RuntimeError("a resumed stream repeated other text than was sent")
        self._skip_tokens -= k
        self._skip_text = self._skip_text[t:]
        return replace(d, text=d.text[t:], token_ids=d.token_ids[k:],
                       logprobs=None if d.logprobs is None else d.logprobs[k:],
                       sampled_logprobs=None if d.sampled_logprobs is None
                       else d.sampled_logprobs[k:])
