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
the client sees one stream, each token once. Only single-sample requests
(``n == 1``) resume: the samples of an ``n > 1`` request share their prompt's
blocks and would each need their own continuation. Non-streamed requests need
none of this: nothing reached their client, so the ingress simply retries them.
"""

from __future__ import annotations

from dataclasses import replace

from pagedserve.cluster.wire import EngineChunk, EngineRequest, SampleDelta


def resumable(req: EngineRequest) -> bool:
    """Whether a stream of ``req`` can go on elsewhere after tokens were sent."""
    return req.params.n == 1 and req.pooling is None


class StreamCursor:
    """What a single-sample stream forwarded so far, and the repeat a resumed attempt
    starts with (its first ``len(token_ids)`` tokens and their text) to drop."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self._text: list[str] = []
        self._skip_tokens = 0
        self._skip_text = ""

    def record(self, chunk: EngineChunk) -> None:
        """Note a chunk on its way to the client."""
        for d in chunk.deltas:
            if d.index == 0:
                self.token_ids.extend(d.token_ids)
                self._text.append(d.text)

    def resume(self, req: EngineRequest) -> EngineRequest:
        """``req`` continuing from what was forwarded; the next attempt's repeat of it
        will be dropped. Prompt logprobs went out with the first tokens already."""
        self._skip_tokens = len(self.token_ids)
        self._skip_text = "".join(self._text)
        return replace(req, resumed_token_ids=list(self.token_ids),
                       params=replace(req.params, prompt_logprobs=None))

    def trim(self, chunk: EngineChunk) -> EngineChunk | None:
        """``chunk`` without what the client already has; None if nothing is left
        (a resumed attempt's acknowledgement, or a pure repeat).

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
        return replace(chunk, deltas=deltas, prompt_logprobs=None)

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
