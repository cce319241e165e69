"""How sequences fork and end: the scheduler's request lifecycle, kept in one place.

Ending a sequence (finished, stopped by a stop string, aborted, or a group
aborted before its siblings forked) always frees its blocks at once and
records the id for the workers (and hands the sequence to the drafter, whose
suffix cache keeps its response); forking shares every block of the parent.
:class:`scheduler.Scheduler` inherits these; they touch only its queues,
request tables, KV manager and drafter.
"""

from __future__ import annotations

from collections import deque

from pagedserve.scheduler.kv_cache_manager import KVCacheManager
from pagedserve.scheduler.queues import PriorityQueue
from pagedserve.scheduler.request import Request, RequestStatus
from pagedserve.scheduler.spec_decode import Drafter


class RequestLifecycle:
    """Fork, finish and abort sequences of the scheduler's requests and groups."""

    requests: dict[str, Request]
    groups: dict[str, list[str]]
    waiting: deque[Request] | PriorityQueue
    running: deque[Request] | PriorityQueue
    swapped: deque[Request] | PriorityQueue
    kv: KVCacheManager
    drafter: Drafter | None
    _finished_ids: list[str]
    _aborted_ids: list[str]

    def _fork(self, parent: Request, child: Request) -> None:
        self.kv.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.status = RequestStatus.RUNNING
        self.requests[child.request_id] = child
        self.running.append(child)

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """End one sequence from outside (a stop string matched in the detokeniser)."""
        req = self.requests.get(request_id)
        if req is not None and not req.is_finished:
            self._finish(req, status)

    def abort(self, request_id: str) -> list[str]:
        """Abort a group (or one sequence) in any state; frees its blocks at once.

        Blocks shared with other sequences only lose this sequence's reference.
        Returns the sequence ids that were aborted.
        """
        ids = list(self.groups.get(request_id, [request_id]))
        aborted: list[str] = []
        for rid in ids:
            req = self.requests.get(rid)
            if req is None:
                parent = self.requests.get(self._group_of(rid) or "")
                if parent is not None:
                    parent.pending_children = [
                        c for c in parent.pending_children if c.request_id != rid
                    ]
                    self._forget(rid, parent.group_id)
                    aborted.append(rid)
                continue
            if not req.is_finished:
                aborted += self._finish(req, RequestStatus.FINISHED_ABORTED)
        return aborted

    def _group_of(self, rid: str) -> str | None:
        return rid.rsplit("#", 1)[0] if "#" in rid else None

    def _finish(self, req: Request, status: RequestStatus) -> list[str]:
        """End a sequence, free its blocks now, and drop siblings it never forked."""
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.SWAPPED:
            self.swapped.remove(req)
        req.status = status
        self.kv.free(req)
        if self.drafter is not None:
            self.drafter.release(req)
        del self.requests[req.request_id]
        ended = [req.request_id] + [c.request_id for c in req.pending_children]
        req.pending_children = []
        sink = self._aborted_ids if status is RequestStatus.FINISHED_ABORTED else self._finished_ids
        sink.extend(ended)
        for rid in ended:
            self._forget(rid, req.group_id)
        return ended

    def _forget(self, rid: str, group_id: str) -> None:
        members = self.groups.get(group_id)
        if members is None:
            return
        if rid in members:
            members.remove(rid)
        if not members:
            del self.groups[group_id]

