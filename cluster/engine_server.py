"""The engine replica deployment: one ``AsyncEngine`` per Serve replica.

Each replica owns its engine (and, for tensor parallelism, its rank actors in
the replica's placement group), sends per-step deltas to the ingress over its
channel (``run`` and ``subscribe``; see ``channel``), and answers the
ingress's stats and probe calls. With ``stream_interval_ms`` > 0
(Ray Serve LLM's ``stream_batching_interval_ms``), the tokens of one request
after its first are sent at most once per interval, merged, and the interval
stretches so that all of the replica's streams together stay within
``stream_messages_per_s`` (see ``StreamPacer``): every streamed message costs
CPU in the replica, the ingress, the proxy and the client, and at high
concurrency that cost competes with the forward pass (the channel makes the
replica-to-ingress leg one message per step; the ingress, proxy and client
still pay per stream). A non-streamed request sends only its final chunk, or,
when the ingress resumes requests of dead replicas (``EngineRequest.checkpoint``),
a checkpoint of its tokens every ``checkpoint_interval_ms`` too, so that a
request of a replica that dies goes on elsewhere instead of starting again. A
cancelled call (the client went away) closes the engine stream, which aborts the
request in the scheduler before the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import ray
from ray import serve

from pagedserve.cluster.beam_search import BeamSearchParams
from pagedserve.cluster.channel import Outboxes
from pagedserve.cluster.config import EngineConfig
from pagedserve.cluster.disagg import PREFILL_PARAMS, RemotePrefillConfig, RemotePrefiller
from pagedserve.cluster.engine_lifecycle import EngineSleepingError
from pagedserve.cluster.metrics import RequestTimer, ServerMetrics
from pagedserve.cluster.placement import stream_message_budget
from pagedserve.cluster.pooling import probe_pooling
from pagedserve.cluster.wire import (
    DeltaTracker,
    EngineChunk,
    EngineRequest,
    ReplicaCall,
    StreamPacer,
    chunk_to_wire,
    pace_deltas,
)
from pagedserve.scheduler.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

ENGINE_DEPLOYMENT = "EngineServer"
INGRESS_CHECK_S = 3.0  # how often an ingress with requests in flight is asked if it lives


@serve.deployment(name=ENGINE_DEPLOYMENT, graceful_shutdown_timeout_s=5)
class EngineServer:
    """One engine replica: an ``AsyncEngine`` and its per-replica metrics."""

    def __init__(self, engine_kwargs: dict[str, Any], stream_interval_ms: float = 50.0,
                 stream_messages_per_s: float | None = None, prefill: Any = None,
                 remote_prefill: RemotePrefillConfig | None = None,
                 checkpoint_interval_ms: float = 1000.0) -> None:
        """``prefill`` (a handle to the ``PrefillServer`` pool) makes this a decode
        replica of a disaggregated app (see ``disagg``)."""
        from pagedserve.cluster.async_engine import AsyncEngine

        self.pacer = StreamPacer(stream_interval_ms / 1000.0,
                                 stream_message_budget(stream_messages_per_s),
                                 checkpoint_interval_ms / 1000.0)
        self.outboxes = Outboxes()
        self._watchdog: asyncio.Task[None] | None = None
        self.engine = AsyncEngine(EngineConfig(**engine_kwargs))
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.node_id = ray.get_runtime_context().get_node_id()  # which node, for operators
        self.metrics = ServerMetrics()
        self._probe_ids = list(self.engine.tokenizer.encode("ping")[:4]) or [0]
        self.remote_prefill = (RemotePrefiller(prefill, remote_prefill or RemotePrefillConfig())
                               if prefill is not None else None)

    def info(self) -> dict[str, Any]:
        core = self.engine.engine
        sched = core.scheduler
        return {"model_id": core.model_id, "block_size": sched.block_size,
                "max_model_len": core.max_model_len,
                # What one request can hold (a hybrid model's sliding tables take some).
                "pool_tokens": sched.max_request_tokens(),
                "long_rope_from": sched.cache_config.long_rope_from,
                "vocab_size": int(core.model_info["vocab_size"]), "replica": self.replica_id,
                "node_id": self.node_id,
                # A multimodal model's image tokens (None: it takes no images).
                "image": core.images.info if core.images is not None else None,
                # Whether prompts may come as embeddings, and of what width.
                "prompt_embeds": core.config.enable_prompt_embeds,
                # A sequence classifier's labels and activations (None: not one).
                "classifier": core.model_info.get("classifier"),
                # A ColBERT / BGE-M3 file's tasks and whether it scores by MaxSim.
                "multi_vector": core.model_info.get("multi_vector"),
                "matryoshka": core.model_info.get("matryoshka"),  # (widths ``dimensions`` takes)
                # A BERT-family encoder: truncation keeps its first token (``text_pairs``).
                "encoder": bool(core.model_info.get("encoder")),
                "hidden_size": int(core.model_info["hidden_size"])}

    async def run(self, req: EngineRequest) -> int:
        """Serve one request whose chunks go to the caller's channel; returns how many.

        The ingress's path (see ``channel``): an ack naming this replica, then the paced
        deltas, as :func:`chunk_to_wire` tuples. Cancelling this call aborts the request.
        """
        if req.channel is None:
            raise ValueError("EngineServer.run needs EngineRequest.channel")
        sent, terminal = 0, False
        with self.outboxes.sending(req.channel) as send:
            async with contextlib.aclosing(self._chunks(req)) as chunks:
                async for chunk in chunks:
                    send(chunk_to_wire(chunk))
                    sent += 1
                    terminal = chunk.finished or chunk.error is not None
                    if not terminal and self.outboxes.abandoned(req.channel):
                        logger.warning("aborting %s: its ingress is gone",
                                       req.request_id)
                        break  # closing the stream aborts it and frees its blocks
            if not terminal:  # never leave the ingress waiting for an end that won't come
                send(chunk_to_wire(EngineChunk(req.request_id, self.replica_id,
                                               error="engine stream ended early",
                                               status=500)))
                sent += 1
        return sent

    async def embed(self, req: EngineRequest) -> dict[str, Any]:
        """Embed one input (``req.pooling`` set); cancelling this call aborts it.

        Returns ``{"embedding", "prompt_tokens", "replica"}``, or an error dict
        (see :meth:`_answer`).
        """
        if req.pooling is None:
            raise ValueError("EngineServer.embed needs EngineRequest.pooling")

        async def work(lora: Any) -> dict[str, Any]:
            last = None
            async for out in self.engine.generate(req.engine_prompt(), req.params,
                                                  req.request_id, req.cache_salt, lora,
                                                  req.priority, req.pooling):
                last = out
            if last is None or last.embedding is None:
                raise RuntimeError("embedding request ended without an embedding")
            return {"embedding": last.embedding, "prompt_tokens": len(last.prompt_token_ids)}

        return await self._answer(req, work)

    async def prefill(self, req: EngineRequest) -> dict[str, Any]:
        """Run a prompt for a decode replica (disaggregated prefill): one token, thrown
        away, and the K/V of the prompt's full blocks. Returns ``{"kv": KVPayload,
        "prompt_tokens", "replica"}``, or an error dict (see :meth:`_answer`)."""

        async def work(lora: Any) -> dict[str, Any]:
            last = None
            async for out in self.engine.generate(req.engine_prompt(), PREFILL_PARAMS,
                                                  req.request_id, req.cache_salt, lora,
                                                  req.priority, export_kv=True,
                                                  images=req.images):
                last = out
            if last is None or last.kv_transfer is None:
                raise RuntimeError("prefill ended without its KV")
            return {"kv": last.kv_transfer, "prompt_tokens": len(req.prompt_token_ids)}

        return await self._answer(req, work)

    async def beam_search(self, req: EngineRequest, params: BeamSearchParams
                          ) -> dict[str, Any]:
        """Beam search for one prompt (``use_beam_search``); cancelling this call aborts it.

        Returns ``{"sequences": [{"token_ids", "text", "cumulative_logprob",
        "finish_reason"}, ...] (best first, generated tokens only), "prompt_tokens",
        "replica"}``, or an error dict (see :meth:`_answer`).
        """

        async def work(lora: Any) -> dict[str, Any]:
            seqs = await self.engine.beam_search(req.engine_prompt(), params, lora,
                                                 req.cache_salt, req.priority, req.images)
            tok, skip = self.engine.tokenizer, req.params.skip_special_tokens
            return {"sequences": [
                {"token_ids": s.completion_token_ids,
                 "text": tok.decode(s.completion_token_ids, skip_special_tokens=skip),
                 "cumulative_logprob": s.cum_logprob, "finish_reason": s.finish_reason}
                for s in seqs], "prompt_tokens": len(req.prompt_token_ids)}

        return await self._answer(req, work)

    async def _answer(self, req: EngineRequest,
                      work: Callable[[Any], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        """Run a one-answer call (``work(lora)``) with this replica's metrics.

        Errors are answers too: ``{"error", "status", "retryable", "replica"}`` with 400
        for the request itself, 503 (retryable) when the engine failed.
        """
        from pagedserve.cluster.async_engine import EngineDeadError

        timer, reason = RequestTimer(), "abort"
        self.metrics.in_flight += 1
        try:
            lora = self.engine.engine.loras.resolve(*req.lora) if req.lora else None
            result = await work(lora)
            reason = "stop"
            return {**result, "replica": self.replica_id}
        except ValueError as e:
            reason = "rejected"
            return {"error": str(e), "status": 400, "retryable": False,
                    "replica": self.replica_id}
        except EngineSleepingError as e:  # another replica may be awake
            return {"error": f"replica {self.replica_id}: {e}", "status": 503,
                    "retryable": True, "replica": self.replica_id}
        except (EngineDeadError, RuntimeError) as e:
            reason = "error"
            logger.error("request %s failed on replica %s: %s", req.request_id,
                         self.replica_id, e)
            return {"error": f"engine replica failed: {e}", "status": 503, "retryable": True,
                    "replica": self.replica_id}
        finally:
            self.metrics.in_flight -= 1
            self.metrics.on_end(timer, reason)

    async def subscribe(self, call: ReplicaCall, channel: str,
                        owner: Any = None) -> AsyncIterator[list[tuple]]:
        """One ingress's chunks from this replica, a list per message (see ``channel``).

        ``owner`` is the ingress's actor handle: while it has requests in flight here,
        it is pinged, and if it died they are aborted (``Outboxes.abandoned``).
        """
        if owner is not None and (self._watchdog is None or self._watchdog.done()):
            self._watchdog = asyncio.get_running_loop().create_task(self._watch_ingresses())
        async for batch in self.outboxes.subscribe(channel, owner):
            yield batch

    async def _watch_ingresses(self) -> None:
        """Every ``INGRESS_CHECK_S``, ask each ingress with requests in flight if it lives."""
        async def check(channel: str, owner: Any) -> None:
            try:
                await asyncio.wait_for(owner.__ray_ready__.remote(), INGRESS_CHECK_S)
            except ray.exceptions.ActorDiedError:
                logger.warning("ingress of channel %s died: aborting its requests", channel)
                self.outboxes.mark_owner_dead(channel)
            except Exception as e:  # slow or unreachable for now: alive until known dead
                logger.debug("ingress of channel %s did not answer: %r", channel, e)

        while True:
            await asyncio.sleep(INGRESS_CHECK_S)
            await asyncio.gather(*(check(ch, o) for ch, o in self.outboxes.watched()))

    async def generate(self, req: EngineRequest) -> AsyncIterator[tuple]:
        """Stream one request on its own (``stream=True`` handle): ack, then deltas.

        For other deployments composing this one; items are :func:`chunk_to_wire` tuples.
        """
        async with contextlib.aclosing(self._chunks(req)) as chunks:
            async for chunk in chunks:
                yield chunk_to_wire(chunk)

    async def _chunks(self, req: EngineRequest) -> AsyncIterator[EngineChunk]:
        from pagedserve.cluster.async_engine import EngineDeadError

        rid, timer, tracker = req.request_id, RequestTimer(), DeltaTracker(req.params.n)
        reason = "abort"
        self.metrics.in_flight += 1
        yield EngineChunk(rid, self.replica_id, prompt_tokens=len(req.prompt_token_ids))
        try:
            lora = self.engine.engine.loras.resolve(*req.lora) if req.lora else None
            if self.remote_prefill is not None and not req.resumed_token_ids:
                await self.remote_prefill.run(self.engine, req, lora)
            outs = self.engine.generate(req.engine_prompt(), req.params, rid, req.cache_salt,
                                        lora, req.priority,
                                        resumed_token_ids=req.resumed_token_ids,
                                        output_kind="delta", images=req.images)
            async with contextlib.AsyncExitStack() as stack:
                pacing: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
                if req.stream:
                    pacing = self.pacer.streaming()
                elif req.checkpoint:
                    pacing = self.pacer.checkpointing()
                interval = stack.enter_context(pacing)
                paced = await stack.enter_async_context(contextlib.aclosing(pace_deltas(
                    outs, tracker, interval, lambda n: self.metrics.on_tokens(timer, n),
                    checkpoints=not req.stream)))
                lps_sent = False  # prompt logprobs are complete once a token is out
                async for deltas, out in paced:
                    if out.finished:
                        reason = out.outputs[0].finish_reason or "stop"
                    first_lps = first_ranks = None
                    if deltas and not lps_sent:
                        first_lps, lps_sent = out.prompt_logprobs, True
                        first_ranks = out.prompt_logprob_ranks
                    yield EngineChunk(rid, self.replica_id, deltas, len(out.prompt_token_ids),
                                      out.num_cached_tokens, out.finished,
                                      prompt_logprobs=first_lps, prompt_ranks=first_ranks)
        except ValueError as e:
            reason = "rejected"
            yield EngineChunk(rid, self.replica_id, error=str(e), status=400)
        except EngineSleepingError as e:  # another replica may be awake
            yield EngineChunk(rid, self.replica_id, error=f"replica {self.replica_id}: {e}",
                              status=503, retryable=True)
        except (EngineDeadError, RuntimeError) as e:
            reason = "error"
            logger.error("request %s failed on replica %s: %s", rid, self.replica_id, e)
            yield EngineChunk(rid, self.replica_id, error=f"engine replica failed: {e}",
                              status=503, retryable=True)
        finally:
            self.metrics.in_flight -= 1
            self.metrics.on_end(timer, reason)

    def stats(self, call: ReplicaCall | None = None) -> dict[str, Any]:
        pacer = self.pacer
        pd = self.remote_prefill
        return {**self.engine.get_stats(), "replica": self.replica_id, "node_id": self.node_id,
                **({"remote_prefill": dict(pd.stats)} if pd is not None else {}),
                "server": self.metrics.snapshot(),
                "streams": {"open": pacer.active, "interval_ms": 1000 * pacer.interval(),
                            "checkpointing": pacer.checkpoints,
                            "checkpoint_interval_ms": 1000 * pacer.checkpoint_interval(),
                            "messages_per_s_budget": pacer.budget_per_s,
                            **self.outboxes.stats()}}

    async def probe(self, call: ReplicaCall | None = None) -> dict[str, Any]:
        """Prove this replica still generates: one greedy token through the whole engine
        (an embedding model embeds the probe instead, a classifier classifies it)."""
        t0 = time.monotonic()
        level = self.engine.engine.sleep_level
        if level:  # asleep on purpose: healthy, and nothing to generate with
            return {"replica": self.replica_id, "ok": True, "sleeping": level,
                    "latency_s": 0.0}
        params = SamplingParams(max_tokens=1, temperature=0.0)
        info = self.engine.engine.model_info
        pooling = probe_pooling(info)

        async def one() -> None:
            async for _ in self.engine.generate(self._probe_ids, params,
                                                f"probe-{uuid.uuid4().hex}", "__probe__",
                                                pooling_params=pooling):
                pass

        await asyncio.wait_for(one(), call.timeout_s if call else 30.0)
        return {"replica": self.replica_id, "ok": True, "latency_s": time.monotonic() - t0}

    def tp_workers(self) -> list[Any]:
        """This replica's tensor-parallel rank actors (none in-process), for operators."""
        return list(getattr(self.engine.engine.executor, "workers", []))

    # ---- sleep mode and weights (the ingress's admin endpoints) ------------------------

    async def sleep(self, call: ReplicaCall) -> dict[str, Any]:
        """Drain (up to the call's timeout), then sleep at ``args["level"]``."""
        level = int(call.args.get("level", 1))
        drain = float(call.args.get("drain_timeout_s", call.timeout_s))
        return await self._control(self.engine.sleep(level, drain_timeout_s=drain))

    async def wake_up(self, call: ReplicaCall) -> dict[str, Any]:
        return await self._control(self.engine.wake_up())

    async def update_weights(self, call: ReplicaCall) -> dict[str, Any]:
        """Drain, then load ``args["model"]`` (a path on this replica's node)."""
        drain = float(call.args.get("drain_timeout_s", call.timeout_s))
        return await self._control(self.engine.update_weights(str(call.args["model"]),
                                                              drain_timeout_s=drain))

    def reset_prefix_cache(self, call: ReplicaCall) -> dict[str, Any]:
        dropped = self.engine.engine.reset_prefix_cache()
        return {"ok": True, "dropped_blocks": dropped, **self._sleep_state()}

    def sleep_state(self, call: ReplicaCall) -> dict[str, Any]:
        return {"ok": True, **self._sleep_state()}

    def _sleep_state(self) -> dict[str, Any]:
        core = self.engine.engine
        return {"sleep_level": core.sleep_level, "model_path": core.model_info["model_path"]}

    async def _control(self, op: Awaitable[None]) -> dict[str, Any]:
        """An admin call's answer: ``{"ok": True, ...state}`` or ``{"ok": False, "error"}``
        when the engine refused it (busy, already asleep, another architecture)."""
        try:
            await op
        except ValueError as e:
            return {"ok": False, "error": str(e), **self._sleep_state()}
        return {"ok": True, **self._sleep_state()}

    async def check_health(self) -> None:
        """Serve's periodic check: a dead rank or engine loop gets this replica replaced."""
        await self.engine.check_health()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.engine.engine.shutdown()
