"""The async engine: a background step loop and one output stream per request.

The loop runs ``schedule`` and ``process`` on the event loop thread and only
the forward (``execute``) in a worker thread, so an abort (a client that went
away, a cancelled Serve call) lands between phases: its blocks are freed at
once, and the step already running simply has its result for it ignored.
With pipeline stages the loop keeps one plan per stage in flight
(``LLMEngine.submit_plans``) and waits only for the oldest.

An idle engine woken by a request first waits for the rest of its burst, for
as long as ``BurstPolicy`` says (see ``burst``): a share of the step it would
otherwise start, unless ``burst_wait_ms`` sets it. A busy engine never waits:
new requests join its next step as usual.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pagedserve.cluster.beam_search import BeamSearchParams, BeamSearchSequence, beam_sequences
from pagedserve.cluster.burst import GAPS_CAP, BurstPolicy
from pagedserve.cluster.config import EngineConfig
from pagedserve.cluster.engine import LLMEngine
from pagedserve.cluster.engine_lifecycle import (
    Transition,
    start_sleep,
    start_update,
    start_wake,
)
from pagedserve.cluster.kv_transfer import KVPayload, begin_import, end_import, reserved_shards
from pagedserve.cluster.outputs import RequestOutput
from pagedserve.cluster.prompt_embeds import EmbedsPrompt
from pagedserve.scheduler.lora_request import LoRARequest
from pagedserve.scheduler.pooling_params import PoolingParams
from pagedserve.scheduler.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """A step failed (a tensor-parallel rank died, or the engine raised); requests on it
    cannot finish, and the replica's health check reports it so Serve replaces it."""


class AsyncEngine:
    """Wraps :class:`LLMEngine` for concurrent callers on one asyncio loop."""

    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None
                 ) -> None:
        # One dedicated thread for every forward, and for building the engine too.
        # OpenMP thread pools belong to the thread that opens a parallel region:
        # a forward hopping between pool threads starts a second team whose idle
        # threads spin against the running one, and once libgomp manages more
        # threads than there are cores (a pool left behind by loading the model
        # on the caller's thread is enough) it throttles every team's spin-wait,
        # so the forward's workers sleep between ops and wake late: 5-10% of a
        # CPU decode step.
        self._step_thread = ThreadPoolExecutor(1, thread_name_prefix="pagedserve-step")
        try:
            self.engine = engine or self._step_thread.submit(
                LLMEngine, config or EngineConfig()).result()
        except BaseException:
            self._step_thread.shutdown(wait=False)
            raise
        self._transfer_thread = ThreadPoolExecutor(1, thread_name_prefix="pagedserve-kv")
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self.burst = BurstPolicy(self.engine.config.burst_wait_ms,
                                 self.engine.config.max_num_batched_tokens)
        configure_gc_for_serving()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_id(self) -> str:
        return self.engine.model_id

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        assert self._wakeup is not None
        engine = self.engine
        idle = True  # this task starts for a request that found the engine idle
        while True:
            if not engine.has_unfinished_requests():
                self._wakeup.clear()
                await self._wakeup.wait()
                idle = True
                continue
            if idle:
                idle = False
                if self.burst.enabled and await self._gather_burst():
                    continue  # the burst's requests may all have been aborted meanwhile
            try:
                # Every phase is inside: an error in scheduling or detokenising must fail
                # the waiting callers too, not end this task and leave them hanging.
                if engine.max_concurrent_batches == 1:
                    plan = engine.schedule()
                    started = time.perf_counter()
                    output = await asyncio.get_running_loop().run_in_executor(
                        self._step_thread, engine.execute, plan)
                    seconds = time.perf_counter() - started
                else:  # pipeline stages: start what fits, then wait for the oldest plan
                    engine.submit_plans()
                    plan, output, seconds = await asyncio.get_running_loop().run_in_executor(
                        self._step_thread, engine.collect_oldest)
                self.burst.observe_step(plan.num_scheduled_tokens, seconds)
                results = engine.process(plan, output)
            except Exception as e:
                self._fail_everyone(e)
                return
            for out in results:
                q = self._queues.get(out.request_id)
                if q is not None:
                    q.put_nowait(out)
            await asyncio.sleep(0)  # let aborts and new requests in between steps

    async def _gather_burst(self) -> bool:
        """Wait while requests keep arriving within the policy's quiet gap; True if it waited.

        The gap is asked afresh after each arrival (auto: it grows with the waiting
        tokens), and the whole wait ends after ``GAPS_CAP`` gaps of the current size.
        """
        assert self._wakeup is not None
        loop = asyncio.get_running_loop()
        start, waited = loop.time(), False
        while True:
            gap = self.burst.quiet_gap(self.engine.num_waiting_tokens())
            left = start + GAPS_CAP * gap - loop.time()
            if gap <= 0 or left <= 0:
                return waited
            waited = True
            self._wakeup.clear()
            try:
                async with asyncio.timeout(min(gap, left)):
                    await self._wakeup.wait()
            except TimeoutError:
                return waited

    def _fail_everyone(self, e: Exception) -> None:
        """A step raised: the engine is dead, every request fails and frees its blocks."""
        logger.exception("engine step failed; failing every request")
        err = EngineDeadError(f"{type(e).__name__}: {e}")
        for q in self._queues.values():
            q.put_nowait(err)
        self._queues.clear()
        try:
            self.engine.fail_all(err)
        except Exception:  # the scheduler itself may be what broke; callers know already
            self.engine.dead = err
            logger.exception("could not abort the requests of a failed engine")

    async def generate(
        self,
        prompt: str | list[int] | EmbedsPrompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        pooling_params: PoolingParams | None = None,
        beam: BeamSearchParams | None = None,
        export_kv: bool = False,
        resumed_token_ids: list[int] | None = None,
        output_kind: str = "cumulative",
        images: list[Any] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield a cumulative snapshot after every step that advanced the request
        (with ``pooling_params``: an embedding request, whose last one has it; with
        ``beam``: a beam search, whose only snapshot is its answer). ``output_kind``
        ``"delta"``: each output holds only what is new (``LLMEngine.add_request``).

        Validation errors raise ``ValueError`` before the first yield. If the
        consumer stops iterating or is cancelled, the request is aborted. A LoRA
        adapter not loaded yet is loaded first, on the step thread (between forwards).
        ``resumed_token_ids``: outputs another replica produced (``LLMEngine.add_request``).
        """
        if self.engine.dead is not None:
            raise EngineDeadError(f"engine is dead: {self.engine.dead}")
        if lora_request is not None and not self.engine.loras.contains(lora_request):
            await asyncio.get_running_loop().run_in_executor(
                self._step_thread, self.engine.add_lora, lora_request)
        if images and self.engine.images is not None:  # loading and resizing take a while
            images = await asyncio.to_thread(self.engine.images.prepare, images)
        rid = self.engine.add_request(prompt, params, request_id, cache_salt, lora_request,
                                      priority, pooling_params, beam, export_kv,
                                      resumed_token_ids, output_kind, images)
        q: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[rid] = q
        self._ensure_loop()
        assert self._wakeup is not None
        self._wakeup.set()
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(rid, None)
            if not finished:
                self.abort(rid)

    async def beam_search(self, prompt: list[int] | EmbedsPrompt, params: BeamSearchParams,
                          lora_request: LoRARequest | None = None,
                          cache_salt: str | None = None, priority: int = 0,
                          images: list[Any] | None = None) -> list[BeamSearchSequence]:
        """One prompt's best ``params.beam_width`` hypotheses, best first (vLLM's
        ``EngineClient.beam_search``): one request whose beams share the continuous
        batch with everything else; a cancellation aborts it."""
        last = None
        async for out in self.generate(prompt, None, None, cache_salt, lora_request,
                                       priority, beam=params, images=images):
            last = out
        if last is None:
            raise RuntimeError("a beam search ended without an answer")
        return beam_sequences(last, self.engine.tokenizer.decode)

    async def import_kv(self, payload: KVPayload) -> int:
        """Write another engine's prompt KV into this pool as prefix-cache blocks
        (``kv_transfer``); returns how many blocks were added.

        The blocks are taken and named on the loop thread, like every scheduler
        change; the copy runs on a thread of its own while steps go on (the blocks
        are held, so no step touches them). With KV offloading, the prefixes the
        blocks held are first copied to the CPU tier on the step thread, between two
        steps (as ``kv_transfer.keep_evicted`` does offline). A caller cancelled
        meanwhile still waits for each copy to end before the blocks are released: a
        block must never be handed to another request while bytes are still landing
        in it.
        """
        engine = self.engine
        res = begin_import(engine, payload)
        written = False
        try:
            plan = res.offload_plan()
            if plan is not None:  # the copy on the step thread, the naming here
                copied = False
                try:
                    await _finish(self._step_thread.submit(engine.executor.execute_model,
                                                           plan))
                    copied = True
                finally:
                    engine.scheduler.kv.commit_offloads(res, copied)
            if res.blocks:
                await _finish(self._transfer_thread.submit(
                    engine.executor.write_kv_blocks, res.block_ids,
                    reserved_shards(payload, res)))
            written = True
        finally:
            named = end_import(engine, res, written)
        return named

    async def sleep(self, level: int = 1, drain_timeout_s: float | None = None) -> None:
        """Free the KV pool (level 2: the weights too) until ``wake_up``. New requests
        meanwhile raise ``EngineSleepingError``. A busy engine is refused, or with
        ``drain_timeout_s`` it refuses new requests and lets the running ones finish
        first (a ``ValueError`` if they take longer). (See ``engine_lifecycle``.)"""
        await self._drain(drain_timeout_s, "sleep")
        await self._transition(start_sleep(self.engine, level))

    async def wake_up(self) -> None:
        await self._transition(start_wake(self.engine))

    async def update_weights(self, model: str, drain_timeout_s: float | None = None) -> None:
        """Serve another checkpoint of the same architecture (a local HF directory or
        GGUF file); idle only, or drained as ``sleep`` does. The prefix cache is
        forgotten."""
        await self._drain(drain_timeout_s, "update_weights")
        await self._transition(start_update(self.engine, model))

    async def _drain(self, timeout_s: float | None, what: str) -> None:
        """Refuse new requests until the unfinished ones are done (none: return now)."""
        engine = self.engine
        if timeout_s is None:
            await self._settle()
            return
        if not engine.has_unfinished_requests():
            return
        if engine.unavailable is not None:
            raise ValueError(f"{what} while the engine is {engine.unavailable}")
        engine.unavailable = f"draining for {what}"
        try:
            async with asyncio.timeout(timeout_s):
                while engine.has_unfinished_requests():
                    await asyncio.sleep(0.02)
        except TimeoutError:
            raise ValueError(f"{what}: {len(engine._groups)} requests still unfinished "
                             f"after {timeout_s:g} s") from None
        finally:  # the transition that follows marks the engine again, with no await between
            engine.unavailable = None

    async def _settle(self) -> None:
        """With no request left, plans of aborted ones may still be crossing the
        stages; the loop collects them within a step. Wait for that, so that sleeping
        right after aborting everything is not refused as busy."""
        engine = self.engine
        while (engine.pipeline and not engine._groups and engine.dead is None
               and not engine.scheduler.has_unfinished_requests()):
            await asyncio.sleep(0.01)

    async def _transition(self, transition: Transition) -> None:
        """A sleep / wake / update: marked here, its work on the step thread (after any
        forward still running), its ending back here."""
        work, end = transition
        ok = False
        try:
            await asyncio.get_running_loop().run_in_executor(self._step_thread, work)
            ok = True
        finally:
            end(ok)

    def abort(self, request_id: str) -> bool:
        return self.engine.abort_request(request_id)

    async def check_health(self) -> None:
        """Raise if the engine died, its step loop ended, or a rank fails its health call.

        This is cheap enough to call every second; the Serve replica's probe
        additionally generates one token end to end.
        """
        if self.engine.dead is not None:
            raise EngineDeadError(f"engine is dead: {self.engine.dead}")
        await asyncio.to_thread(self.engine.executor.check_health)
        if self._loop_task is not None and self._loop_task.done():
            exc = self._loop_task.exception() if not self._loop_task.cancelled() else None
            raise EngineDeadError(f"engine loop ended: {exc}")

    def get_stats(self) -> dict[str, Any]:
        return self.engine.get_stats()

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._loop_task
        self._step_thread.shutdown(wait=False, cancel_futures=True)
        self._transfer_thread.shutdown(wait=False, cancel_futures=True)
        self.engine.shutdown()


async def _finish(job: Future[Any]) -> None:
    """Await a thread's job; if the caller is cancelled meanwhile, still wait for the
    job to end (bytes may be landing in blocks about to be released), then re-raise."""
    try:
        await asyncio.wrap_future(job)
    finally:
        if not job.cancelled():
            with contextlib.suppress(Exception):
                job.result()  # (cancelled: wait for the copy; it is short)


def configure_gc_for_serving() -> None:
    """Freeze start-up objects and raise the young-generation threshold.

    A step allocates thousands of small objects (plans, updates); with the
    default threshold CPython's collector runs several times per step and
    walks every live request, which doubles scheduler time at 1024 running
    sequences. The engine calls this once after start-up.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
