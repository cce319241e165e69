"""The scheduler's side of beam search: held beams, forks, drops and the answer.

:class:`scheduler.Scheduler` inherits these. A beam that reported its
candidates is *held*: it has nothing to compute (the running loop skips it, a
held beam preempted to the waiting queue is not readmitted) until its group
chooses. Choosing appends each continuation's token to a sequence: the parent
itself for its first continuation, a fork on its blocks for any further one (a
parent that is not resident forks a child that waits and recomputes through
the prefix cache); beams not chosen end at once. When the search ends, every
live beam ends and one update carries the group's best hypotheses.

A batch whose running sequences are all held beams, waiting for a sibling the
pool cannot take, would never step again; ``_unblock_held_beams`` evicts held
beams (their KV is recomputed when they continue) until that sibling fits.
"""

from __future__ import annotations

from pagedserve.scheduler.admission import lacks_room
from pagedserve.scheduler.beam import BeamGroup, Candidate
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.lifecycle import RequestLifecycle
from pagedserve.scheduler.outputs import RequestUpdate, SampledToken
from pagedserve.scheduler.request import Request, RequestStatus


def is_held(req: Request) -> bool:
    """A beam that reported this round and waits for its siblings."""
    return req.beam is not None and req.beam.is_held(req)


class BeamScheduling(RequestLifecycle):
    """Advance beam groups from their beams' samples."""

    config: SchedulerConfig
    block_size: int
    num_preemptions: dict[str, int]

    def _beam_sampled(self, req: Request, tok: SampledToken,
                      updates: list[RequestUpdate]) -> None:
        """A beam's row sampled: its candidates are the reported top log-probabilities
        (the sampled token among them); the last beam of a round makes the group choose."""
        group = req.beam
        assert group is not None
        seen = dict(tok.top_logprobs or {})
        seen[tok.token_id] = tok.logprob if tok.logprob is not None else 0.0
        if not group.report(req, seen):
            return
        chosen = group.select()
        if group.is_over(chosen):
            self._end_beam_search(group, chosen, updates)
        else:
            self._continue_beams(group, chosen)

    def _continue_beams(self, group: BeamGroup, chosen: list[Candidate]) -> None:
        kept: set[str] = set()
        beams: list[Request] = []
        for cand in chosen:  # forks first: they copy the parent's tokens before it grows
            parent = cand.parent
            if parent.request_id in kept:
                beams.append(self._fork_beam(parent))
            else:
                kept.add(parent.request_id)
                beams.append(parent)
        for beam, cand in zip(beams, chosen, strict=True):
            beam.all_token_ids.append(cand.token)
        dropped = [b for b in group.live if b.request_id not in kept]
        group.continue_with(beams, chosen)
        for beam in dropped:
            self._finish(beam, RequestStatus.FINISHED_STOPPED)

    def _fork_beam(self, parent: Request) -> Request:
        group = parent.beam
        assert group is not None
        group.num_forks += 1
        child = parent.make_beam(group.num_forks)
        self.groups[parent.group_id].append(child.request_id)
        if parent.status is RequestStatus.RUNNING:
            self._fork(parent, child)
            child.num_hashed_blocks = parent.num_hashed_blocks
        else:  # the parent's KV is swapped out or gone: recompute (prefix hits help)
            self.requests[child.request_id] = child
            self.waiting.append(child)
        return child

    def _end_beam_search(self, group: BeamGroup, chosen: list[Candidate],
                         updates: list[RequestUpdate]) -> None:
        best = group.results(chosen)
        first = group.live[0]
        for beam in list(group.live):
            self._finish(beam, RequestStatus.FINISHED_LENGTH)
        group.live = []
        updates.append(RequestUpdate(first.group_id, first.group_id, 0, [], True,
                                     best[0].finish_reason, first.num_prompt_tokens,
                                     group.num_cached_tokens, beams=best))

    def _unblock_held_beams(self) -> None:
        """If every running sequence is a held beam and the next sequence to admit lacks
        a seat or blocks, evict held beams from the tail until it has them."""
        if not self.running or not all(is_held(r) for r in self.running):
            return
        if self.swapped:
            head: Request | None = self.swapped[0]
        else:
            head = next((r for r in self.waiting if not is_held(r)), None)
        while head is not None and self.running and self._lacks_room(head):
            victim = self.running.pop()
            self.kv.free(victim)
            victim.num_computed_tokens = 0
            victim.status = RequestStatus.WAITING
            victim.num_preemptions += 1
            self.waiting.append(victim)
            self.num_preemptions["recompute"] += 1

    def _lacks_room(self, req: Request) -> bool:
        free = self.kv.pool.num_free_blocks
        if req.status is RequestStatus.SWAPPED:
            return (len(self.running) >= self.config.max_num_seqs
                    or self.kv.swap_in_cost(req, 1) > free)
        return lacks_room(req, len(self.running), self.config, self.block_size, free,
                          len(self.kv.group_windows))
