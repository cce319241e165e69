"""Preemption: which running sequence gives way, and how it comes back.

A sequence preempted for want of blocks (the last running one; under the priority
policy the least urgent, before anything is scheduled, when a more urgent waiting
request lacks a seat or its first chunk's blocks) is swapped to the CPU tier when the
mode and that tier allow, and recomputed from its first token otherwise. A sequence
that grows past LongRoPE's pre-trained length is recomputed with the long factors.
A sequence whose step is still in flight is never preempted: its work would be lost.
:class:`scheduler.Scheduler` inherits these.
"""

from __future__ import annotations

from collections import deque

from pagedserve.scheduler.admission import lacks_room
from pagedserve.scheduler.config import CacheConfig, SchedulerConfig
from pagedserve.scheduler.hybrid_kv import HybridKVCacheManager
from pagedserve.scheduler.kv_cache_manager import KVCacheManager
from pagedserve.scheduler.long_rope import needs_long_rope, start_long_rope
from pagedserve.scheduler.outputs import SchedulerOutput
from pagedserve.scheduler.queues import PriorityQueue, urgency
from pagedserve.scheduler.request import Request, RequestStatus
from pagedserve.scheduler.step_results import StepResults


class Preemption(StepResults):
    """Preempt sequences of the scheduler's queues (see the module docstring)."""

    config: SchedulerConfig
    cache_config: CacheConfig
    block_size: int
    kv: KVCacheManager | HybridKVCacheManager
    waiting: deque[Request] | PriorityQueue
    running: deque[Request] | PriorityQueue
    swapped: deque[Request] | PriorityQueue
    aging_s: float | None
    num_preemptions: dict[str, int]

    def _preempt_for_urgent(self, out: SchedulerOutput) -> None:
        """Priority policy, before anything is scheduled: while the most urgent waiting
        request is more urgent than the least urgent running one and lacks a seat or
        the blocks of its first chunk, preempt that running request (vLLM's priority
        preemption). A waiting request never displaces one at least as urgent."""
        while self.waiting and self.running:
            req, victim = self.waiting[0], self.running[-1]
            if victim.request_id in self.in_flight:
                return  # its step is still running: wait for its tokens first
            if urgency(victim, self.aging_s) <= urgency(req, self.aging_s) or not lacks_room(
                    req, len(self.running), self.config, self.block_size,
                    self.kv.pool.num_free_blocks, len(self.kv.group_windows)):
                return
            self.running.pop()
            self._preempt(victim, out)

    def _switch_to_long_rope(self) -> None:
        """Recompute, with the long factors, every request that has grown past
        LongRoPE's pre-trained length (``scheduler.long_rope``); none otherwise."""
        limit = self.cache_config.long_rope_from
        if not limit:
            return
        for req in self.waiting:  # (preempted for recompute: nothing cached to drop)
            if needs_long_rope(req, limit):
                start_long_rope(req)
        for queue in (self.running, self.swapped):
            for req in [r for r in queue if needs_long_rope(r, limit)
                        and r.request_id not in self.in_flight]:
                queue.remove(req)
                self.kv.free(req)
                req.num_computed_tokens = 0
                req.status = RequestStatus.WAITING
                start_long_rope(req)
                self.waiting.appendleft(req)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Swap to CPU when the mode and the CPU tier allow; otherwise recompute.

        A swap that does not fit on the CPU falls back to recompute for that
        request alone: the engine never fails for lack of swap space.
        """
        req.num_preemptions += 1
        self.kv.release_behind_window(req)  # its last step moved the window: copy less
        if self.config.preemption_mode == "swap" and self.kv.can_swap_out(req):
            out.blocks_to_swap_out.extend(self.kv.swap_out(req))
            req.status = RequestStatus.SWAPPED
            self.swapped.append(req)
            self.num_preemptions["swap"] += 1
            return
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions["recompute"] += 1
