"""Applying a step's results: the scheduler's side of ``update_from_output``.

Each scheduled row advances its request: computed tokens are counted and full
blocks named for the prefix cache, sampled tokens appended (forking the pending
``n > 1`` siblings at the prompt's end), drafted rows keep only their accepted
guesses, embedding rows pass their pooled part on, and a stop ends the sequence.
:class:`scheduler.Scheduler` inherits this.
"""

from __future__ import annotations

from pagedserve.scheduler.beam_scheduling import BeamScheduling
from pagedserve.scheduler.outputs import (
    ModelRunnerOutput,
    RequestUpdate,
    SampledToken,
    SchedulerOutput,
)
from pagedserve.scheduler.request import Request, RequestStatus
from pagedserve.scheduler.spec_decode import Drafter


class StepResults(BeamScheduling):
    """Advance requests from a step's plan and the runner's output."""

    drafter: Drafter | None
    in_flight: set[str]
    plans_in_flight: set[int]

    def update_from_output(
        self, plan: SchedulerOutput, output: ModelRunnerOutput | None
    ) -> list[RequestUpdate]:
        """Advance every scheduled sequence; sequences aborted mid-step are skipped."""
        self.in_flight.difference_update(sr.request_id for sr in plan.scheduled)
        self.plans_in_flight.discard(plan.step_id)
        sampled = output.sampled if output is not None else {}
        spec = output.spec_tokens if output is not None else {}
        updates: list[RequestUpdate] = []
        block_size = self.block_size
        for sr in plan.scheduled:
            req = self.requests.get(sr.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue
            if sr.draft_token_ids:
                self._apply_drafts(req, sr.draft_token_ids, spec.get(req.request_id), updates)
                continue
            req.num_computed_tokens += len(sr.token_ids)
            if req.num_computed_tokens // block_size > req.num_hashed_blocks:
                self.kv.cache_blocks(req)
            if req.pooling_params is not None:
                self._pooled(req, output, updates)
                continue
            if not sr.sample_ids:
                continue
            if req.beam is not None:
                self._beam_sampled(req, self._sampled(sampled, req), updates)
                continue
            family = [req]
            if req.pending_children:
                for child in req.pending_children:
                    self._fork(req, child)
                family += req.pending_children
                req.pending_children = []
            for r in family:
                tok = self._sampled(sampled, r)
                r.all_token_ids.append(tok.token_id)
                reason = r.stop_status(tok.token_id, self.config.max_model_len)
                if reason is not None:
                    self._finish(r, reason)
                updates.append(
                    RequestUpdate(
                        r.request_id,
                        r.group_id,
                        r.index,
                        [tok],
                        reason is not None,
                        reason.value if reason is not None else None,
                        r.num_prompt_tokens,
                        r.num_cached_tokens,
                    )
                )
        if output is not None and output.draft_tokens:
            self._keep_proposals(output.draft_tokens)
        return updates

    def _keep_proposals(self, proposals: dict[str, list[int]]) -> None:
        """A draft model's guesses, held for each running request's next step (with
        the token count they follow: a stale proposal is never sent)."""
        for rid, toks in proposals.items():
            req = self.requests.get(rid)
            if req is not None and req.status is RequestStatus.RUNNING:
                req.draft_proposal = (len(req.all_token_ids), tuple(toks))

    @staticmethod
    def _sampled(sampled: dict[str, SampledToken], req: Request) -> SampledToken:
        tok = sampled.get(req.request_id)
        if tok is None:
            raise RuntimeError(f"runner returned no token for {req.request_id}")
        return tok

    def _apply_drafts(self, req: Request, drafts: tuple[int, ...],
                      toks: list[SampledToken] | None,
                      updates: list[RequestUpdate]) -> None:
        """A drafted row: only the accepted guesses' KV counts as computed; the
        rejected ones' slots are overwritten by the next step. Tokens after a stop
        (EOS, a stop id, ``max_tokens``) are dropped."""
        assert self.drafter is not None
        toks = toks or []
        accepted = self.drafter.count(req, drafts, [t.token_id for t in toks])
        req.spec_token_ids = ()
        req.draft_state = accepted if accepted < len(drafts) else None
        new: list[SampledToken] = []
        reason = None
        for tok in toks:
            req.all_token_ids.append(tok.token_id)
            new.append(tok)
            reason = req.stop_status(tok.token_id, self.config.max_model_len)
            if reason is not None:
                break
        # The row computed its first token and the accepted guesses; a stop inside
        # the guesses leaves fewer tokens than that.
        req.num_computed_tokens = min(req.num_computed_tokens + 1 + accepted, req.num_tokens)
        if req.num_computed_tokens // self.block_size > req.num_hashed_blocks:
            self.kv.cache_blocks(req)
        if reason is not None:
            self._finish(req, reason)
        updates.append(RequestUpdate(req.request_id, req.group_id, req.index, new,
                                     reason is not None,
                                     reason.value if reason is not None else None,
                                     req.num_prompt_tokens, req.num_cached_tokens))

    def _pooled(self, req: Request, output: ModelRunnerOutput | None,
                updates: list[RequestUpdate]) -> None:
        """An embedding request's chunk: pass the runner's pooled part on; the prompt's
        end finishes it (nothing is sampled)."""
        part = output.pooled.get(req.request_id) if output is not None else None
        done = req.num_computed_tokens >= req.num_tokens
        if done:
            self._finish(req, RequestStatus.FINISHED_STOPPED)
        if done or part is not None:
            updates.append(RequestUpdate(req.request_id, req.group_id, req.index, [], done,
                                         "stop" if done else None, req.num_prompt_tokens,
                                         req.num_cached_tokens, part))
