"""The scheduler's queues under the two policies (vLLM's ``scheduling_policy``).

``fcfs``: the waiting and swapped queues are deques in arrival order, a request
preempted for recompute goes back to the front, and the running list is in
admission order, so the victim of a short pool (its last entry) is the most
recently admitted. ``priority``: every queue is kept sorted by ``(priority,
arrival_time)`` (a lower value runs first), so the same scheduler code admits
the most urgent waiting request first, swaps the most urgent back first, and
preempts the least urgent running request; the scheduler also lets an urgent
arrival preempt less urgent running requests for a seat or blocks.

Strict priorities starve: under a steady stream of urgent requests a less urgent one
may wait forever (vLLM's priority policy does). ``priority_aging_s`` bounds that wait:
every ``priority_aging_s`` seconds since its arrival count as one level more urgent,
so a request of priority ``p`` goes ahead of fresh priority-0 arrivals after about
``p * priority_aging_s`` seconds. Its effective priority at time ``t``,
``priority - (t - arrival) / aging``, orders requests exactly as the constant
``priority + arrival / aging`` does (``t / aging`` is the same for all), so the queues
stay sorted as time passes without re-sorting.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable, Iterator

from pagedserve.scheduler.request import Request

POLICIES = ("fcfs", "priority")


def urgency(req: Request, aging_s: float | None = None) -> tuple[float, float]:
    """The priority policy's order: lower runs first (aged by ``aging_s``, see above)."""
    if aging_s:
        return req.priority + req.arrival_time / aging_s, req.arrival_time
    return req.priority, req.arrival_time


class PriorityQueue:
    """A deque's interface over a list sorted by ``urgency``: where an ``fcfs`` deque
    appends at an end, this inserts at the request's place."""

    def __init__(self, aging_s: float | None = None) -> None:
        self.aging_s = aging_s
        self._items: list[Request] = []
        self._keys: list[tuple[float, float]] = []

    def append(self, req: Request) -> None:
        key = urgency(req, self.aging_s)
        i = bisect.bisect_right(self._keys, key)
        self._items.insert(i, req)
        self._keys.insert(i, key)

    appendleft = append  # a preempted request goes back to its place by priority

    def extendleft(self, reqs: Iterable[Request]) -> None:
        for req in reqs:
            self.append(req)

    def popleft(self) -> Request:
        self._keys.pop(0)
        return self._items.pop(0)

    def pop(self) -> Request:
        self._keys.pop()
        return self._items.pop()

    def remove(self, req: Request) -> None:
        i = self._items.index(req)
        del self._items[i], self._keys[i]

    def __getitem__(self, i: int) -> Request:
        return self._items[i]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)


def make_queues(policy: str, aging_s: float | None = None
                ) -> tuple[deque[Request] | PriorityQueue, list[Request] | PriorityQueue,
                           deque[Request] | PriorityQueue]:
    """(waiting, running, swapped) for ``policy``."""
    if policy == "fcfs":
        return deque(), [], deque()
    if policy == "priority":
        return PriorityQueue(aging_s), PriorityQueue(aging_s), PriorityQueue(aging_s)
    raise ValueError(f"scheduling_policy must be one of {POLICIES}, got {policy!r}")
