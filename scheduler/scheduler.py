"""Continuous batching with a token budget, chunked prefill, preemption and abort.

Each ``schedule()`` call: running sequences first (decode, or the next chunk of
a prefill), preempting the last running sequence (the most recently admitted;
under the priority policy the least urgent, see ``queues``; ``preemption``) whenever
the pool is short; then swapped sequences come back (only in a step that preempted
nobody); then waiting ones are admitted in queue order while the budget, the
sequence cap, the pool and the LoRA adapter cap allow. ``update_from_output``
(``step_results``) applies the sampled tokens, names newly full blocks in the prefix cache, forks
parallel samples and frees finished sequences at once. Beam searches
(``beam_scheduling``) add one rule: a beam that reported its candidates is
held (skipped, never readmitted) until its group has chosen. With KV
offloading the plan also carries the copies of evicted prefix blocks to the
CPU tier and the loads of CPU hits back (``KVCacheManager.end_step``).
With ``max_concurrent_batches > 1`` (pipeline stages each on a micro-batch) a
plan may be scheduled before the previous ones come back: it skips the sequences
still in flight, never preempts one (its step's work would be wasted), takes at
most ``1 / max_concurrent_batches`` of the running sequences, and shares the
tokens that could start now with the plans that may still start.
"""

from __future__ import annotations

from typing import Any

from pagedserve.scheduler.admission import check_fits, lora_fits, max_tokens_held
from pagedserve.scheduler.beam import BeamGroup, BeamSearchParams
from pagedserve.scheduler.beam_scheduling import is_held
from pagedserve.scheduler.block_hash import make_extra_keys
from pagedserve.scheduler.config import CacheConfig, SchedulerConfig
from pagedserve.scheduler.hybrid_kv import HybridKVCacheManager
from pagedserve.scheduler.kv_cache_manager import KVCacheManager
from pagedserve.scheduler.long_rope import (
    needs_long_rope,
    prompt_keys,
    start_long_rope,
    uses_long_rope,
)
from pagedserve.scheduler.lora_request import LoRARequest
from pagedserve.scheduler.memory import MemoryStats, memory_stats
from pagedserve.scheduler.multimodal import ImageInput, fit_chunk
from pagedserve.scheduler.outputs import (
    ScheduledRequest,
    SchedulerOutput,
)
from pagedserve.scheduler.pooling_params import PoolingParams
from pagedserve.scheduler.preemption import Preemption
from pagedserve.scheduler.queues import make_queues, urgency
from pagedserve.scheduler.request import Request, RequestStatus
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.spec_decode import Drafter, SpeculativeConfig
from pagedserve.scheduler.state_cache import StateSnapshots
from pagedserve.scheduler.step_plan import scheduled_request


class Scheduler(Preemption):
    """The single owner of every block decision of one engine replica."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 speculative_config: SpeculativeConfig | None = None) -> None:
        self.config = scheduler_config
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.kv: KVCacheManager | HybridKVCacheManager
        if len(cache_config.kv_group_windows) > 1:
            self.kv = HybridKVCacheManager(
                cache_config.num_gpu_blocks, cache_config.block_size,
                cache_config.kv_group_windows, cache_config.num_cpu_blocks,
                cache_config.enable_prefix_caching, cache_config.enable_kv_offload)
        else:
            self.kv = KVCacheManager(
                cache_config.num_gpu_blocks,
                cache_config.block_size,
                cache_config.num_cpu_blocks,
                cache_config.enable_prefix_caching,
                cache_config.enable_kv_offload,
                cache_config.sliding_window,
            )
        self.requests: dict[str, Request] = {}
        self.groups: dict[str, list[str]] = {}
        self.aging_s = scheduler_config.priority_aging_s
        self.waiting, self.running, self.swapped = make_queues(scheduler_config.policy,
                                                               self.aging_s)
        self._finished_ids: list[str] = []
        self._aborted_ids: list[str] = []
        self._step_id = 0
        # Sequences of plans whose results ``update_from_output`` has not applied yet.
        self.in_flight: set[str] = set()
        self.plans_in_flight: set[int] = set()  # their step ids
        self.num_preemptions = {"swap": 0, "recompute": 0}
        self.drafter = (Drafter(speculative_config, scheduler_config.max_model_len)
                        if speculative_config is not None else None)
        # A recurrent model's prefix cache: its state snapshots (``state_cache``).
        self.snapshots = (StateSnapshots(cache_config.state_snapshots, self.block_size)
                          if cache_config.state_snapshots else None)

    # ---- admission -------------------------------------------------------------

    def make_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        pooling_params: PoolingParams | None = None,
        beam: BeamSearchParams | None = None,
        images: tuple[ImageInput, ...] = (),
    ) -> Request:
        """Build a request with this replica's hash keys (model id, salt, adapter);
        with ``pooling_params`` an embedding request, which ends after its prompt;
        with ``beam`` the first beam of a beam search (``params`` then are its rows':
        greedy, ``logprobs=2 * beam_width``)."""
        lora_key = lora_request.cache_key if lora_request is not None else None
        req = Request(
            request_id,
            prompt_token_ids,
            params,
            eos_token_ids,
            self.prompt_extra_keys(len(prompt_token_ids), cache_salt, lora_key),
            lora_id=lora_request.lora_int_id if lora_request is not None else 0,
            priority=priority,
            pooling_params=pooling_params,
            images=images,
        )
        if beam is not None:
            if params.n != 1 or params.logprobs != 2 * beam.beam_width:
                raise ValueError("a beam's rows sample once with logprobs=2 * beam_width")
            req.beam = BeamGroup(beam, eos_token_ids, self.config.max_model_len)
            req.beam.start(req)
        return req

    def prompt_extra_keys(self, num_tokens: int, cache_salt: str | None = None,
                          lora_key: str | None = None) -> tuple[str, ...]:
        """What a prompt of ``num_tokens`` tokens' blocks hash under: the model, salt and
        adapter (``make_extra_keys``), and LongRoPE's key past its pre-trained length."""
        keys = make_extra_keys(self.cache_config.model_id, cache_salt, lora_key)
        return prompt_keys(keys, num_tokens, self.cache_config.long_rope_from)

    def add_request(self, request: Request) -> None:
        """Queue a request; ``n > 1`` becomes a group whose siblings fork later."""
        if request.request_id in self.requests or request.group_id in self.groups:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        check_fits(request, self.config, self.block_size, self.kv.pool.num_blocks,
                   self.kv.group_windows)
        if needs_long_rope(request, self.cache_config.long_rope_from):
            start_long_rope(request)
        n = request.sampling_params.n
        if n > 1:
            request.pending_children = [request.make_child(i) for i in range(1, n)]
            request.sampling_params = request.sampling_params.for_child(0)
        self.requests[request.request_id] = request
        self.groups[request.group_id] = [request.request_id] + [
            c.request_id for c in request.pending_children
        ]
        self.waiting.append(request)

    # ---- the step plan -----------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(step_id=self._step_id)
        self._step_id += 1
        out.finished_ids, self._finished_ids = self._finished_ids, []
        out.aborted_ids, self._aborted_ids = self._aborted_ids, []
        budget = self._plan_budget()
        preempted = False
        priority = self.config.policy == "priority"
        if priority:
            self._preempt_for_urgent(out)
        self._unblock_held_beams()
        self._switch_to_long_rope()

        drafter = self.drafter if self.drafter and self.drafter.active(len(self.running)) else None
        in_flight = self.in_flight
        # With several plans in flight each takes its share of the running sequences,
        # so the pipeline's stages get micro-batches of about the same size.
        share = -(-len(self.running) // self.config.max_concurrent_batches)
        i = taken = 0
        while i < len(self.running) and budget > 0 and taken < share:
            req = self.running[i]
            if req.request_id in in_flight:  # its last step's tokens are not back yet
                i += 1
                continue
            self.kv.release_behind_window(req)
            num_new = self._chunk(req, req.num_computed_tokens, budget)
            if num_new == 0:  # a held beam waits for its siblings, an image for room
                i += 1
                continue
            req.spec_token_ids = drafter.propose(req, budget - 1) if drafter else ()
            if self.cache_config.long_rope_from and not uses_long_rope(req):
                # Guesses past the switch would be rotated short: stop them before it.
                room = self.cache_config.long_rope_from - req.num_computed_tokens - num_new
                req.spec_token_ids = req.spec_token_ids[:max(0, room)]
            look = drafter.lookahead(req, num_new) if drafter else 0
            if req.spec_token_ids:
                num_new += len(req.spec_token_ids)
            copies = self.kv.allocate_slots(req, num_new + look)
            if copies is None and (req.spec_token_ids or look):
                # Guesses never preempt anyone: try the plain step first.
                num_new -= len(req.spec_token_ids)
                req.spec_token_ids, look = (), 0
                copies = self.kv.allocate_slots(req, num_new)
            while copies is None:
                if self.running[-1].request_id in in_flight:
                    break  # the victim's step is still running: rather than waste it, wait
                victim = self.running.pop()
                self._preempt(victim, out)
                preempted = True
                if victim is req:
                    break
                copies = self.kv.allocate_slots(req, num_new)
            if copies is None:
                break
            out.blocks_to_copy.extend(copies)
            out.scheduled.append(self._scheduled(req, num_new, look))
            budget -= num_new
            i += 1
            taken += 1

        active = {r.lora_id for r in self.running if r.lora_id} if self.config.max_loras else set()
        while (
            not preempted
            and self.swapped
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            req = self.swapped[0]
            if priority and self.waiting and (urgency(self.waiting[0], self.aging_s)
                                              < urgency(req, self.aging_s)):
                break  # a more urgent waiting request goes first
            if not lora_fits(req, active, self.config.max_loras):
                break
            num_new = self._chunk(req, req.num_computed_tokens, budget)
            if self.kv.swap_in_cost(req, num_new) > self.kv.pool.num_free_blocks:
                break
            pairs = self.kv.swap_in(req)
            copies = self.kv.allocate_slots(req, num_new) if pairs is not None else None
            assert pairs is not None and copies is not None, "swap-in check was exact"
            self.swapped.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.blocks_to_swap_in.extend(pairs)
            out.blocks_to_copy.extend(copies)
            if num_new:  # (a held beam only comes back)
                out.scheduled.append(self._scheduled(req, num_new))
            budget -= num_new

        skipped: list[Request] = []  # over the adapter cap this step; keep their places
        while (
            not preempted
            and (not self.swapped or (priority and self.waiting
                 and urgency(self.waiting[0], self.aging_s)
                 < urgency(self.swapped[0], self.aging_s)))
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            req = self.waiting[0]
            if is_held(req) or not lora_fits(req, active, self.config.max_loras):
                skipped.append(self.waiting.popleft())
                continue
            if req.sampling_params.prompt_logprobs is None and not (
                    req.pooling_params and req.pooling_params.needs_every_position):
                hits, num_hit = self.kv.get_computed_blocks(req)
                if self.snapshots is not None:  # (resumes only where a state was kept)
                    hits, num_hit = self.snapshots.trim(req, hits, num_hit)
                loads = self.kv.get_offloaded_blocks(req, num_hit // self.block_size)
                device_hit = num_hit
                num_hit += self.kv.offloaded_tokens(loads)
            else:  # every prompt position's logits (or state) is wanted: compute them all
                hits, loads, num_hit, device_hit = [], [], 0, None
            num_new = req.num_tokens - num_hit
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = self._chunk(req, num_hit, budget)
            if num_new == 0:  # its next image needs more of a step than is left
                break
            req.num_computed_tokens = num_hit
            look = drafter.lookahead(req, num_new) if drafter else 0
            copies = self.kv.allocate_slots(req, num_new + look, hits, loads)
            if copies is None:
                req.num_computed_tokens = 0
                break
            self.kv.release_behind_window(req)  # prefix hits the window has passed
            if device_hit is not None:
                self.kv.record_prefix_lookup(req.num_tokens, device_hit)
            req.num_cached_tokens = max(req.num_cached_tokens, num_hit)
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(self._scheduled(req, num_new, look))
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        if self.snapshots is not None:
            out.dropped_states = self.snapshots.take_drops()
        offloads, loads = self.kv.end_step()
        out.blocks_to_swap_out.extend(offloads)
        out.blocks_to_swap_in.extend(loads)
        if self.config.max_concurrent_batches > 1 and out.scheduled:
            in_flight.update(r.request_id for r in out.scheduled)
            self.plans_in_flight.add(out.step_id)
        return out

    def _plan_budget(self) -> int:
        """The step's token budget. With plans in flight (chunked prefill on), the work
        that can start now is spread over the plans that may still start, so a burst of
        prompts becomes one micro-batch per stage instead of a full plan the first
        stage computes while the others wait for it, then a small one."""
        budget = self.config.max_num_batched_tokens
        slots = self.config.max_concurrent_batches - len(self.plans_in_flight)
        if slots <= 1 or not self.config.enable_chunked_prefill:
            return budget
        work = self.num_waiting_tokens() + sum(
            r.num_tokens - r.num_computed_tokens for r in (*self.running, *self.swapped)
            if r.request_id not in self.in_flight)
        # A bidirectional image is computed in one step: a smaller share would never run it.
        image = max((img.end - img.start for r in (*self.waiting, *self.running,
                                                   *self.swapped)
                     for img in r.images if img.end > r.num_computed_tokens
                     and not img.causal), default=0)
        return max(1, min(budget, max(-(-work // slots), image)))

    def _chunk(self, req: Request, start: int, budget: int) -> int:
        """The tokens ``req`` runs this step from token ``start``: what it has left,
        within the step's budget and the per-prompt cap (``long_prefill_token_threshold``),
        and never stopping inside a bidirectional image (``multimodal.fit_chunk``)."""
        remaining = req.num_tokens - start
        cap = self.config.long_prefill_token_threshold
        num_new = min(remaining, budget, cap) if cap else min(remaining, budget)
        if self.snapshots is not None:
            num_new = self.snapshots.align(req, start, num_new)
        if req.images and num_new < remaining:
            return fit_chunk(req.images, start, num_new)
        return num_new

    def _scheduled(self, req: Request, num_new: int, look: int = 0) -> ScheduledRequest:
        rid = req.request_id
        sched = scheduled_request(req, num_new, self.kv.block_ids(rid),
                                  self.kv.group_block_ids(rid), self.config.output_history)
        sched.num_lookahead = look
        sched.draft_state, req.draft_state = req.draft_state, None
        if self.snapshots is not None:
            self.snapshots.mark(req, sched)
        return sched

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix no request holds (offloaded ones too) and every
        state snapshot (the next plan frees them); returns how many blocks."""
        if self.snapshots is not None:
            self.snapshots.reset()
        return self.kv.reset_prefix_cache()

    # ---- introspection ---------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def num_waiting_tokens(self) -> int:
        """Tokens the waiting requests still have to compute (prefix-cache hits not known yet)."""
        return sum(len(r.all_token_ids) - r.num_computed_tokens for r in self.waiting)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    @property
    def spec_stats(self) -> dict[str, Any]:
        """Speculative decoding counters: drafted rows, guesses sent, guesses accepted
        (per position too; and the suffix cache's responses and tokens)."""
        if self.drafter is None:
            return {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
        return self.drafter.snapshot()

    def memory_stats(self) -> MemoryStats:
        return memory_stats(self)

    def max_request_tokens(self) -> int:
        """The most tokens one request can hold in this pool (``admission``)."""
        return max_tokens_held(self.config, self.block_size, self.kv.pool.num_blocks,
                               self.kv.group_windows)
