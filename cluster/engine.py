"""The engine: central scheduler + executor + detokenisation, one step at a time.

A step is three phases so the async server can run the middle one in a
thread while aborts and new requests keep arriving on the event loop:
``schedule()`` (scheduler, loop thread) -> ``execute(plan)`` (the TP group)
-> ``process(plan, output)`` (scheduler + detokeniser, loop thread).
Every scheduler mutation happens on one thread, so no lock is needed.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

from pagedserve.cluster.beam_search import BeamSearchParams, beam_row_params
from pagedserve.cluster.config import EngineConfig
from pagedserve.cluster.encoder_engine import encoder_engine_config
from pagedserve.cluster.engine_lifecycle import (
    EngineSleepingError,
    calibrate_kv_scales,
    collect_aborted_plans,
    run_now,
    start_sleep,
    start_update,
    start_wake,
)
from pagedserve.cluster.engine_setup import build_scheduler, checked_worker_config
from pagedserve.cluster.engine_stats import STAT_COUNTERS, engine_stats
from pagedserve.cluster.executor import Executor, LocalExecutor, RayExecutor
from pagedserve.cluster.image_prompts import ImagePrompts
from pagedserve.cluster.kv_transfer import export_prompt_kv
from pagedserve.cluster.lora_registry import LoRARegistry
from pagedserve.cluster.outputs import RequestOutput
from pagedserve.cluster.pooling import pool_for, resolved_pooling
from pagedserve.cluster.prompt_embeds import EmbedsPrompt, embeds_request_inputs
from pagedserve.cluster.recurrent_engine import check_recurrent_request, recurrent_engine_config
from pagedserve.cluster.request_state import (
    RequestState,
    check_prompt_ids,
    check_request_args,
    check_resumed,
    with_bad_word_ids,
)
from pagedserve.cluster.step_pipeline import StepPipeline
from pagedserve.cluster.text_pairs import truncated_ids
from pagedserve.scheduler.block_hash import hash_prompt_blocks
from pagedserve.scheduler.lora_request import LoRARequest
from pagedserve.scheduler.multimodal import ImageInput
from pagedserve.scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from pagedserve.scheduler.pooling_params import PoolingParams
from pagedserve.scheduler.request import RequestStatus, sequence_id
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker.loaders import load_tokenizer, resolve_model
from pagedserve.worker.logits_processors import check_params, load_processor_classes


class LLMEngine:
    """One engine replica's core, usable synchronously (``step``) or split in phases."""

    def __init__(self, config: EngineConfig) -> None:
        resolved = resolve_model(config.model)
        config = recurrent_engine_config(encoder_engine_config(config, resolved.path),
                                         resolved.path)
        self.config = config
        self.device = config.resolved_device()
        self.model_id = resolved.model_id
        wcfg = checked_worker_config(config, resolved.path, self.device)
        self.tokenizer = load_tokenizer(resolved)
        # Custom logits processors' classes: each checks a request's params on arrival.
        self.logits_processor_classes = load_processor_classes(config.logits_processors)
        block_size = wcfg.block_size
        self.executor: Executor
        if config.resolved_executor() == "ray":
            self.executor = RayExecutor(wcfg, use_gpu=self.device == "cuda")
        else:
            self.executor = LocalExecutor(wcfg)
        info = self.executor.model_info()
        self.model_info = info
        self.eos_token_ids = tuple(info["eos_token_ids"])
        max_len = min(config.max_model_len or info["max_model_len"], info["max_model_len"])
        self.max_model_len = max_len
        # Plans in flight at once: one per pipeline stage unless the config says fewer.
        self.max_concurrent_batches = min(config.resolved_max_concurrent_batches(),
                                          self.executor.max_concurrent_batches)
        self.pipeline = StepPipeline(self.max_concurrent_batches)
        num_gpu_blocks = self.executor.determine_num_blocks()
        num_swap, num_offload = config.cpu_tier_blocks(int(info["bytes_per_block"]))
        self.executor.init_kv_cache(num_gpu_blocks, num_swap + num_offload)
        self.scheduler = build_scheduler(config, info, self.model_id, max_len, block_size,
                                         num_gpu_blocks, (num_swap, num_offload),
                                         self.max_concurrent_batches)
        image_info = info.get("image")
        # A multimodal model's image prompts (None: text only, or images turned off).
        self.images = ImagePrompts(resolved.path, image_info, self.tokenizer,
                                   config.image_limit, config.allowed_local_media_path,
                                   str(info["dtype"]), config.video_limit,
                                   config.mm_processor_kwargs, max_len) \
            if image_info else None
        self.loras = LoRARegistry(self.executor, config.enable_lora,
                                  config.resolved_max_loaded_loras(), self._lora_in_use)
        for name, path in (config.lora_modules or {}).items():
            self.loras.add(self.loras.resolve(name, path))
        self._groups: dict[str, RequestState] = {}
        self._seq_to_group: dict[str, tuple[RequestState, int]] = {}
        self._ids = itertools.count()
        self.dead: BaseException | None = None
        self.sleep_level = 0  # 1 or 2 while asleep (see ``engine_lifecycle``)
        self.unavailable: str | None = None  # why new requests are refused, if they are
        self.weights_changed = False  # new weights loaded while asleep
        self.stats: dict[str, float] = dict.fromkeys(STAT_COUNTERS, 0)
        if config.calculate_kv_scales and str(info["kv_cache_dtype"]).startswith("fp8"):
            calibrate_kv_scales(self)
            self.stats = dict.fromkeys(STAT_COUNTERS, 0)  # start-up work is not served work

    # ---- requests ----------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return check_prompt_ids(prompt, self.model_info["vocab_size"])

    def add_request(
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
        images: Sequence[Any] | None = None,
    ) -> str:
        """Validate and queue a request; raises ``ValueError`` naming the problem.

        A ``lora_request`` the engine has not loaded yet is loaded first, on every
        rank (``add_lora``). ``priority`` (lower runs first) needs the priority policy.
        With ``pooling_params`` the request embeds its prompt instead of generating
        (``params`` then only carries ``truncate_prompt_tokens``). With ``beam`` it is a
        beam search (``params`` must be None): it answers once, at the end, with one
        completion per hypothesis, best first. With ``export_kv`` its final output carries
        the prompt's KV (``kv_transfer``, a ``KVPayload``) for another engine to import.
        With ``resumed_token_ids`` (``n == 1``) the request continues an output another
        engine began and lost (a dead replica, see ``resume``): those tokens are its
        first outputs, recomputed as a preempted request's are, and its outputs carry
        them (text included; logprobs ``{}``, not recomputed), so greedy and seeded
        requests end as they would have where they started. ``output_kind``: what
        ``step`` returns for it, one of ``request_state.OUTPUT_KINDS``. ``images`` (a
        multimodal model's; ``cluster.multimodal.load_image``'s forms) fill the prompt's
        image placeholders, one begin-of-image token each in a text prompt
        (``image_prompts``). An ``EmbedsPrompt`` (``enable_prompt_embeds``) is a prompt
        of input embeddings; its ids are placeholders (``prompt_embeds``).
        """
        if self.dead is not None:
            raise RuntimeError(f"engine is dead: {self.dead}")
        if self.unavailable is not None:
            raise EngineSleepingError(f"engine is {self.unavailable}")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        check_request_args(request_id, self._groups, params, pooling_params, beam,
                           export_kv, priority, self.config.scheduling_policy, output_kind)
        if self.model_info.get("recurrent_state"):
            check_recurrent_request(beam is not None, export_kv)
        params = params or SamplingParams()
        pooling_params = resolved_pooling(pooling_params, self.model_info)
        pool = pool_for(pooling_params, params, self.model_info)
        params = with_bad_word_ids(params, self.tokenizer)
        params.check_token_ids(self.model_info["vocab_size"])
        if params.structured_outputs is not None:
            from pagedserve.worker.structured import check_structured_outputs

            check_structured_outputs(params.structured_outputs)
        check_params(self.logits_processor_classes, params)
        if isinstance(prompt, EmbedsPrompt):
            ids, image_inputs = embeds_request_inputs(
                prompt, params, images, self.config.enable_prompt_embeds,
                int(self.model_info["hidden_size"]), self.scheduler.block_size)
        else:
            ids, image_inputs = self._prompt_ids(prompt, images)
        if not ids:
            raise ValueError("prompt is empty")
        if params.truncate_prompt_tokens is not None and not isinstance(prompt, EmbedsPrompt):
            if image_inputs:
                raise ValueError("truncate_prompt_tokens cannot cut a prompt with images")
            ids = truncated_ids(ids, params.truncate_prompt_tokens,
                                bool(self.model_info.get("encoder")))
        resumed = check_resumed(resumed_token_ids, params, len(ids), self.max_model_len,
                                self.model_info["vocab_size"], self.eos_token_ids,
                                beam is not None or pooling_params is not None or export_kv)
        n_out = params.n
        if beam is not None:
            params, n_out = beam_row_params(beam, len(ids), self.max_model_len), beam.beam_width
        if lora_request is not None:
            self.loras.add(lora_request)
        # Built first: it may still refuse ``resumed``, before the scheduler has the request.
        group = RequestState.start(request_id, prompt if isinstance(prompt, str) else None,
                                   ids, params, n_out, self.tokenizer, pool,
                                   (cache_salt, lora_request, image_inputs) if export_kv
                                   else None, resumed,
                                   token_prompt=not isinstance(prompt, EmbedsPrompt))
        group.output_kind = output_kind
        req = self.scheduler.make_request(request_id, ids, params, self.eos_token_ids,
                                          cache_salt, lora_request, priority, pooling_params,
                                          beam, image_inputs)
        req.all_token_ids.extend(resumed)
        self.scheduler.add_request(req)
        for i in range(min(n_out, params.n)):  # (a beam search answers under its own id only)
            self._seq_to_group[sequence_id(request_id, i)] = (group, i)
        self._groups[request_id] = group
        self.stats["prompt_tokens"] += len(ids)
        return request_id

    def _prompt_ids(self, prompt: str | list[int], images: Sequence[Any] | None
                    ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """The prompt's token ids, with its images' placeholders and inputs."""
        if not images:
            ids = self.tokenize(prompt)
            if self.images is not None:
                self.images.check_text_only(ids)
            return ids, ()
        if self.images is None:
            from pagedserve.cluster.video import is_video

            kind = "video" if all(is_video(x) for x in images) else "image"
            limit = self.config.video_limit if kind == "video" else self.config.image_limit
            why = f" (limit_mm_per_prompt has {kind}: 0)" if limit == 0 else ""
            raise ValueError(f"{kind}s: this model takes no {kind}s{why}")
        return self.images.build(prompt, images, self.tokenize)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter on every rank; False if already loaded (``ValueError`` if bad)."""
        return self.loras.add(lora_request)

    def remove_lora(self, lora: str | int) -> bool:
        """Unload an adapter (by name, or by ``lora_int_id`` as vLLM's) no unfinished
        request uses; False if it is not loaded."""
        return self.loras.remove(lora)

    def _lora_in_use(self, lora_id: int) -> int:
        return sum(1 for r in self.scheduler.requests.values() if r.lora_id == lora_id)

    def list_loras(self) -> list[LoRARequest]:
        return self.loras.list()

    def abort_request(self, request_id: str) -> bool:
        """Abort a request in any state; its blocks are free when this returns."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return False
        self.scheduler.abort(request_id)
        for i, _ in enumerate(group.seqs):
            self._seq_to_group.pop(sequence_id(request_id, i), None)
        self.stats["aborted_requests"] += 1
        return True

    def has_unfinished_requests(self) -> bool:
        """Requests left, or plans in flight (whose results must come back even when
        every request in them was aborted)."""
        return (bool(self._groups) or self.scheduler.has_unfinished_requests()
                or len(self.pipeline) > 0)

    def num_waiting_tokens(self) -> int:
        """Prompt tokens queued for the next steps (what an idle engine's first step would run)."""
        return self.scheduler.num_waiting_tokens()

    def prompt_block_hashes(self, token_ids: list[int], cache_salt: str | None = None,
                            lora_request: LoRARequest | None = None,
                            images: Sequence[ImageInput] = ()) -> list[bytes]:
        """The prefix-cache keys of a prompt (its ``images``' keys in the blocks they
        overlap), as the scheduler computes them."""
        keys = self.scheduler.prompt_extra_keys(
            len(token_ids), cache_salt, lora_request.cache_key if lora_request else None)
        return hash_prompt_blocks(token_ids, self.scheduler.block_size, keys, images=images)

    # ---- the step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        return self.scheduler.schedule()

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput | None:
        if plan.is_empty and not plan.finished_ids and not plan.aborted_ids:
            return None
        t0 = time.perf_counter()
        try:
            return self.executor.execute_model(plan)
        finally:
            self.stats["execute_seconds"] += time.perf_counter() - t0

    def process(self, plan: SchedulerOutput, output: ModelRunnerOutput | None
                ) -> list[RequestOutput]:
        """Apply sampled tokens; returns the output of every request that progressed
        (a ``final_only`` one's only once it has finished)."""
        updates = self.scheduler.update_from_output(plan, output)
        self.stats["steps"] += 1
        for name, n in (output.counters if output else {}).items():
            self.stats[name] = self.stats.get(name, 0) + n
        for rid, (first, entries, ranks) in (output.prompt_logprobs if output else {}).items():
            group = self._groups.get(rid)
            if group is not None and group.prompt_logprobs is not None:
                group.prompt_logprobs[first : first + len(entries)] = entries
                group.prompt_ranks[first : first + len(ranks)] = ranks
        touched: dict[str, RequestState] = {}
        now = time.monotonic()
        for u in updates:
            entry = self._seq_to_group.get(u.request_id)
            if entry is None:
                continue
            group, i = entry
            group.first_token_time = group.first_token_time or now
            touched[group.request_id] = group
            kept, stopped = group.apply(i, u, self.eos_token_ids)
            self.stats["generation_tokens"] += kept
            if stopped:
                self.scheduler.finish_request(u.request_id, RequestStatus.FINISHED_STOPPED)
        results = []
        for rid, group in touched.items():
            finished = group.finished
            if finished and group.kv_export is not None:  # before a step reuses them
                group.kv_transfer = export_prompt_kv(self, group.prompt_token_ids,
                                                     *group.kv_export)
            if finished or group.output_kind != "final_only":
                results.append(group.snapshot())
            if finished:
                self._groups.pop(rid, None)
                for i, _ in enumerate(group.seqs):
                    self._seq_to_group.pop(sequence_id(rid, i), None)
                self.stats["finished_requests"] += 1
        return results

    def step(self) -> list[RequestOutput]:
        """One synchronous step: schedule, run the TP group, apply the tokens (with
        several plans in flight: keep the pipeline full, apply the oldest plan's)."""
        if self.max_concurrent_batches == 1:
            plan = self.schedule()
            return self.process(plan, self.execute(plan))
        self.submit_plans()
        if not self.pipeline:
            return []
        plan, output, _ = self.collect_oldest()
        return self.process(plan, output)

    # ---- pipelined steps (``max_concurrent_batches > 1``) ------------------------------

    def submit_plans(self) -> None:
        """Start plans until ``max_concurrent_batches`` are in flight or nothing more
        can start now; returns at once (the stages run them; see ``step_pipeline``)."""
        self.stats["pipelined_steps"] += self.pipeline.fill(
            self.schedule, self.executor.submit_model, self.scheduler.has_unfinished_requests)

    def collect_oldest(self) -> tuple[SchedulerOutput, ModelRunnerOutput | None, float]:
        """Wait for the oldest plan in flight: it, its output and its seconds since
        submission. Blocks: the async engine calls it on its step thread."""
        plan, output, seconds, waited = self.pipeline.collect_oldest(self.executor.collect)
        self.stats["execute_seconds"] += waited
        return plan, output, seconds

    # ---- health and teardown ----------------------------------------------------------

    def fail_all(self, error: BaseException) -> list[str]:
        """The TP group died: abort everything so the pool is back at baseline."""
        self.dead = error
        self.pipeline.clear()
        ids = list(self._groups)
        for rid in ids:
            self.abort_request(rid)
        return ids

    def check_health(self) -> None:
        if self.dead is not None:
            raise RuntimeError(f"engine is dead: {self.dead}")
        self.executor.check_health()

    def get_stats(self) -> dict[str, Any]:
        return engine_stats(self)

    def sleep(self, level: int = 1) -> None:
        """Free the KV pool (level 2: the weights too) until ``wake_up``; idle engines only."""
        collect_aborted_plans(self)
        run_now(start_sleep(self, level))

    def wake_up(self) -> None:
        run_now(start_wake(self))

    def update_weights(self, model: str) -> None:
        """Serve another checkpoint of the same architecture; idle engines only."""
        collect_aborted_plans(self)
        run_now(start_update(self, model))

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix no request holds (offloaded ones too); returns how
        many blocks."""
        return self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        self.executor.shutdown()
