"""Step plans as they travel to Ray worker ranks: what changed since the rank's last plan.

A plan names every running request's whole block table and its sampling parameters,
though from one decode step to the next a table gains a block at most every
``block_size`` tokens and the parameters never change. Pickled whole, 256 rows of
8,192-token contexts are 0.58 MB and 4-5 ms of pickling and unpickling per step
(``python bench/plan_wire.py``) on the driver's step thread and on every rank. So,
as vLLM's scheduler sends a running request's new block ids only, the driver's
``PlanEncoder`` keeps what it has sent each request (its table and its parameters)
and sends a row's table as the tail the rank lacks and its parameters only when
they are new; each rank's ``PlanDecoder`` keeps the same and rebuilds the plan.

Both sides change their records only in plan order (the executor's sequence numbers
keep every rank in it), dropping a request's once a plan lists it finished or
aborted. Plans are numbered: a rank that did not decode the previous one fails the
step loudly rather than attend to the wrong blocks (each row's table length and last
block are checked too). ``reset`` (after any failed step, or when the records
outgrow the running set) makes the next plan whole again. Sampling parameters are
matched by identity: a request's ``SamplingParams`` object is fixed once the engine
has the request. A decoded row's table may be the rank's record itself: plans are
read, never changed.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from pagedserve.scheduler.outputs import ScheduledRequest, SchedulerOutput
from pagedserve.scheduler.sampling_params import SamplingParams

_FIELDS = tuple(f.name for f in fields(ScheduledRequest))
_RID = _FIELDS.index("request_id")
_TABLE = _FIELDS.index("block_table")
_PARAMS = _FIELDS.index("sampling_params")
# Records past four per scheduled row before both sides start over: a request left
# without a plan naming it (none should) would otherwise stay. Running requests not
# scheduled in a step keep theirs, so the bound leaves room for a large running set.
_SLACK = 8192


@dataclass(slots=True)
class EncodedPlan:
    """A plan whose rows hold only what the rank lacks.

    ``plan`` has every field but ``scheduled``; ``rows`` are the scheduled requests'
    field values in ``ScheduledRequest`` order, with ``block_table`` the ids past the
    first ``kept[i]`` the rank holds, and ``sampling_params`` None where the rank has
    them. ``lengths`` / ``lasts``: each whole table's length and last id (-1: empty).
    ``number``: the encoder's count of plans (a rank decodes them in a row, or from a
    ``reset`` one on).
    """

    number: int
    plan: SchedulerOutput
    rows: list[list[Any]]
    kept: list[int]
    lengths: list[int]
    lasts: list[int]
    reset: bool


class PlanEncoder:
    """The driver's side: what every rank holds, as of the last plan encoded."""

    def __init__(self) -> None:
        self._tables: dict[str, list[int]] = {}
        self._params: dict[str, dict[str, SamplingParams]] = {}
        self._reset = True
        self._number = 0

    def reset(self) -> None:
        """Send the next plan whole (after a failed step: a rank may have missed one)."""
        self._reset = True

    def encode(self, plan: SchedulerOutput) -> EncodedPlan:
        reset = self._reset or len(self._tables) > 4 * len(plan.scheduled) + _SLACK
        self._reset = False
        self._number += 1
        if reset:
            self._tables.clear()
            self._params.clear()
        for rid in (*plan.finished_ids, *plan.aborted_ids):
            self._tables.pop(rid, None)
            self._params.pop(rid, None)
        rows, kept, lengths, lasts = [], [], [], []
        for sr in plan.scheduled:
            rid, table, params = sr.request_id, sr.block_table, sr.sampling_params
            row = [getattr(sr, f) for f in _FIELDS]
            known = self._tables.get(rid)
            k = 0
            if known is not None and _extends(table, known):
                k = len(known)
                row[_TABLE] = table[k:]
            self._tables[rid] = table
            if _same_params(self._params.get(rid), params):
                row[_PARAMS] = None
            else:
                self._params[rid] = params
            rows.append(row)
            kept.append(k)
            lengths.append(len(table))
            lasts.append(table[-1] if table else -1)
        bare = SchedulerOutput(plan.step_id, [], plan.blocks_to_swap_out, plan.blocks_to_swap_in,
                               plan.blocks_to_copy, plan.finished_ids, plan.aborted_ids)
        return EncodedPlan(self._number, bare, rows, kept, lengths, lasts, reset)


class PlanDecoder:
    """A rank's side: the plans it has run, folded into the same records."""

    def __init__(self) -> None:
        self._tables: dict[str, list[int]] = {}
        self._params: dict[str, dict[str, SamplingParams]] = {}
        self._number: int | None = None  # the last plan decoded

    def decode(self, enc: EncodedPlan) -> SchedulerOutput:
        """The whole plan back; ``RuntimeError`` if a row does not fit the records."""
        if enc.reset:
            self._tables.clear()
            self._params.clear()
        elif self._number is None or enc.number != self._number + 1:
            raise RuntimeError(f"plan {enc.number} follows plan {self._number} on this rank: "
                               "it missed one (ranks out of step)")
        self._number = enc.number
        plan = enc.plan
        for rid in (*plan.finished_ids, *plan.aborted_ids):
            self._tables.pop(rid, None)
            self._params.pop(rid, None)
        scheduled = []
        for sent, k, n, last in zip(enc.rows, enc.kept, enc.lengths, enc.lasts, strict=True):
            row = list(sent)  # the encoded plan stays as it came (other ranks may share it)
            rid = row[_RID]
            if k:
                known = self._tables.get(rid, [])
                if len(known) < k:
                    raise RuntimeError(f"plan {plan.step_id}: request {rid} extends a block "
                                       f"table of {k} ids this rank does not hold")
                tail = row[_TABLE]
                if k == len(known):  # the usual case; shared when nothing was added
                    row[_TABLE] = known + tail if tail else known
                else:
                    row[_TABLE] = [*known[:k], *tail]
            table = row[_TABLE]
            if len(table) != n or (table[-1] if table else -1) != last:
                raise RuntimeError(f"plan {plan.step_id}: request {rid}'s block table "
                                   "differs from the driver's (ranks out of step)")
            self._tables[rid] = table
            if row[_PARAMS] is None:
                params = self._params.get(rid)
                if params is None:
                    raise RuntimeError(f"plan {plan.step_id}: request {rid}'s sampling "
                                       "parameters were never sent to this rank")
                row[_PARAMS] = params
            else:
                self._params[rid] = row[_PARAMS]
            scheduled.append(ScheduledRequest(*row))
        return SchedulerOutput(plan.step_id, scheduled, plan.blocks_to_swap_out,
                               plan.blocks_to_swap_in, plan.blocks_to_copy, plan.finished_ids,
                               plan.aborted_ids)


def _extends(table: list[int], known: list[int]) -> bool:
    """Whether ``table`` starts with ``known`` (compared in C; most steps add no block,
    so the lengths match and no slice is made)."""
    n = len(known)
    if len(table) == n:
        return table == known
    return len(table) > n and table[:n] == known


def _same_params(known: dict[str, SamplingParams] | None,
                 params: dict[str, SamplingParams]) -> bool:
    """Whether a row's parameters are the ones already sent, object for object."""
    if known is None or len(known) != len(params):
        return False
    return all(known.get(sid) is p for sid, p in params.items())
