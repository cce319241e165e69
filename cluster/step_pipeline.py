"""Plans in flight: the engine's queue of micro-batches for pipeline stages.

With ``pipeline_parallel_size`` stages one plan at a time leaves every stage but one
idle. The engine instead keeps up to ``max_concurrent_batches`` plans in flight
(vLLM's batch queue): the scheduler gives each its own share of the running
sequences (never one still in flight), the executor starts each at once, and the
results are applied oldest first, so stage ``k`` computes plan ``n`` while stage
``k + 1`` computes plan ``n - 1``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from pagedserve.scheduler.outputs import ModelRunnerOutput, SchedulerOutput


class StepPipeline:
    """Plans started and not yet applied, oldest first, each with its executor handle."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._plans: deque[tuple[SchedulerOutput, Any, float]] = deque()

    def __len__(self) -> int:
        return len(self._plans)

    def fill(self, schedule: Callable[[], SchedulerOutput],
             submit: Callable[[SchedulerOutput], Any], has_work: Callable[[], bool]) -> int:
        """Schedule and submit plans until ``depth`` are in flight or nothing more can
        start now; returns how many started while another was in flight.

        A plan that runs nothing is submitted only for the finished and aborted ids it
        tells the workers to forget; when nothing is in flight it is kept, without a
        handle, to be applied as an idle step (what ``LLMEngine.step`` does unpipelined).
        """
        overlapped = 0
        while len(self._plans) < self.depth and (has_work() or not self._plans):
            plan = schedule()
            if plan.is_empty and not plan.finished_ids and not plan.aborted_ids:
                if not self._plans:
                    self._plans.append((plan, None, time.perf_counter()))
                break
            overlapped += bool(self._plans)
            self._plans.append((plan, submit(plan), time.perf_counter()))
        return overlapped

    def collect_oldest(self, collect: Callable[[Any], ModelRunnerOutput | None]
                       ) -> tuple[SchedulerOutput, ModelRunnerOutput | None, float, float]:
        """Wait for the oldest plan: it, its output, seconds since it was submitted and
        seconds spent waiting here."""
        plan, handle, submitted = self._plans.popleft()
        if handle is None:
            return plan, None, 0.0, 0.0
        t0 = time.perf_counter()
        output = collect(handle)
        now = time.perf_counter()
        return plan, output, now - submitted, now - t0

    def clear(self) -> None:
        """Forget every plan in flight (the group died: their results will never come)."""
        self._plans.clear()
