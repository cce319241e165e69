"""Step plans as they travel to Ray worker ranks: what changed since the rank's last plan.

A plan names every running request's whole block table and its sampling parameters
(and, for penalties, its prompt and output history), though from one decode step to
the next a table gains a block at most every ``block_size`` tokens, a history one
token, and the rest never changes. Pickled whole, 256 rows of 8,192-token contexts are
0.6 MB and about 6 ms of pickling and unpickling per step (``python bench/plan_wire.py``),
on the driver's step thread and on every rank. So, as vLLM's scheduler sends a
running request's new block ids only, the driver's ``PlanEncoder`` keeps what it
has sent each request and sends a table or a history as the tail the rank lacks,
parameters and prompts only when they are new; each rank's ``PlanDecoder`` keeps
the same and rebuilds the plan.

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

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from pagedserve.scheduler.outputs import ScheduledRequest, SchedulerOutput
from pagedserve.scheduler.sampling_params import SamplingParams

_FIELDS = tuple(f.name for f in fields(ScheduledRequest))
_RID = _FIELDS.index("request_id")
_TABLE = _FIELDS.index("block_table")
_PARAMS = _FIELDS.index("sampling_params")
_PROMPT = _FIELDS.index("prompt_token_ids")
_OUTPUTS = _FIELDS.index("output_token_ids")
_GROUPS = _FIELDS.index("group_block_tables")
# Records past four per scheduled row before both sides start over: a request left
# without a plan naming it (none should) would otherwise stay. Running requests not
# scheduled in a step keep theirs, so the bound leaves room for a large running set.
_SLACK = 8192


@dataclass(slots=True)
class EncodedPlan:
    """A plan whose rows hold only what the rank lacks.

    ``plan`` has every field but ``scheduled``; ``rows`` are the scheduled requests'
    field values in ``ScheduledRequest`` order, with ``block_table`` as ``(k, tail)``
    (the first ``k`` ids are the rank's record, then ``tail``), ``output_token_ids``
    as ``{sample id: (k, tail)}`` the same way, ``group_block_tables`` (a hybrid
    model's) as a list of ``(k, tail)``, and ``sampling_params`` /
    ``prompt_token_ids`` as ``(same, value)`` (``same``: the rank's record, value None).
    ``lengths`` / ``lasts``: each whole table's length and last id (-1: empty).
    ``number``: the encoder's count of plans (a rank decodes them in a row, or from a
    ``reset`` one on).
    """

    number: int
    plan: SchedulerOutput
    rows: list[list[Any]]
    lengths: list[int]
    lasts: list[int]
    reset: bool


class _Records:
    """What one side holds per request (tables, parameters, prompts) and per sample
    (output histories), kept in plan order on both sides."""

    def __init__(self) -> None:
        self.tables: dict[str, list[int]] = {}
        self.params: dict[str, dict[str, SamplingParams]] = {}
        self.prompts: dict[str, list[int] | None] = {}
        self.outputs: dict[str, list[int]] = {}
        self.groups: dict[str, dict[int, list[int]]] = {}

    def clear(self) -> None:
        for d in (self.tables, self.params, self.prompts, self.outputs, self.groups):
            d.clear()

    def forget(self, plan: SchedulerOutput) -> None:
        """Drop what the requests a plan lists as finished or aborted had (a sample's
        id is its own request's)."""
        for rid in (*plan.finished_ids, *plan.aborted_ids):
            for d in (self.tables, self.params, self.prompts, self.outputs, self.groups):
                d.pop(rid, None)


class PlanEncoder:
    """The driver's side: what every rank holds, as of the last plan encoded."""

    def __init__(self) -> None:
        self._rec = _Records()
        self._reset = True
        self._number = 0

    def reset(self) -> None:
        """Send the next plan whole (after a failed step: a rank may have missed one)."""
        self._reset = True

    def encode(self, plan: SchedulerOutput) -> EncodedPlan:
        rec = self._rec
        reset = self._reset or len(rec.tables) > 4 * len(plan.scheduled) + _SLACK
        self._reset = False
        self._number += 1
        if reset:
            rec.clear()
        rec.forget(plan)
        rows, lengths, lasts = [], [], []
        for sr in plan.scheduled:
            rid, table = sr.request_id, sr.block_table
            row = [getattr(sr, f) for f in _FIELDS]
            row[_TABLE] = _delta(rec.tables, rid, table)
            row[_PARAMS] = _same_or_new(rec.params, rid, sr.sampling_params, _same_params)
            row[_PROMPT] = _same_or_new(rec.prompts, rid, sr.prompt_token_ids, _is)
            if sr.output_token_ids:
                row[_OUTPUTS] = {sid: _delta(rec.outputs, sid, out)
                                 for sid, out in sr.output_token_ids.items()}
            if sr.group_block_tables is not None:
                held = rec.groups.setdefault(rid, {})
                row[_GROUPS] = [_delta(held, g, t) for g, t in enumerate(sr.group_block_tables)]
            rows.append(row)
            lengths.append(len(table))
            lasts.append(table[-1] if table else -1)
        bare = SchedulerOutput(plan.step_id, [], plan.blocks_to_swap_out, plan.blocks_to_swap_in,
                               plan.blocks_to_copy, plan.finished_ids, plan.aborted_ids,
                               plan.dropped_states)
        return EncodedPlan(self._number, bare, rows, lengths, lasts, reset)


class PlanDecoder:
    """A rank's side: the plans it has run, folded into the same records."""

    def __init__(self) -> None:
        self._rec = _Records()
        self._number: int | None = None  # the last plan decoded

    def decode(self, enc: EncodedPlan) -> SchedulerOutput:
        """The whole plan back; ``RuntimeError`` if a row does not fit the records."""
        rec = self._rec
        if enc.reset:
            rec.clear()
        elif self._number is None or enc.number != self._number + 1:
            raise RuntimeError(f"plan {enc.number} follows plan {self._number} on this rank: "
                               "it missed one (ranks out of step)")
        self._number = None  # until this plan has decoded whole: later ones need a reset
        plan = enc.plan
        rec.forget(plan)
        scheduled = []
        for sent, n, last in zip(enc.rows, enc.lengths, enc.lasts, strict=True):
            row = list(sent)  # the encoded plan stays as it came (other ranks may share it)
            rid, step = row[_RID], plan.step_id
            table = row[_TABLE] = _undelta(rec.tables, rid, row[_TABLE], "block table", step)
            if len(table) != n or (table[-1] if table else -1) != last:
                raise RuntimeError(f"plan {step}: request {rid}'s block table differs from "
                                   "the driver's (ranks out of step)")
            row[_PARAMS] = _recorded(rec.params, rid, row[_PARAMS], "parameters", step)
            row[_PROMPT] = _recorded(rec.prompts, rid, row[_PROMPT], "prompt", step)
            if row[_OUTPUTS]:
                row[_OUTPUTS] = {sid: _undelta(rec.outputs, sid, d, "outputs", step)
                                 for sid, d in row[_OUTPUTS].items()}
            if row[_GROUPS] is not None:
                held = rec.groups.setdefault(rid, {})
                row[_GROUPS] = [_undelta(held, g, d, "group block table", step)
                                for g, d in enumerate(row[_GROUPS])]
            scheduled.append(ScheduledRequest(*row))
        self._number = enc.number
        return SchedulerOutput(plan.step_id, scheduled, plan.blocks_to_swap_out,
                               plan.blocks_to_swap_in, plan.blocks_to_copy, plan.finished_ids,
                               plan.aborted_ids, plan.dropped_states)


def _delta(records: dict[str, list[int]], key: str, ids: list[int]
           ) -> tuple[int, list[int]] | tuple[int, list[int], int]:
    """``(k, tail)``: how many leading ids of ``ids`` the rank's record holds, and the
    rest; the record becomes ``ids`` (a list the plan's maker does not change later).
    ``(k, tail, r)`` when the record's first ``r`` ids have since turned -1 (blocks a
    sliding window released) and the rest are held."""
    known = records.get(key)
    records[key] = ids
    if known is not None:
        if _extends(ids, known):
            return len(known), ids[len(known):]
        n, r = len(known), _released(ids)
        if r and len(ids) >= n and ids[r:n] == known[r:n]:
            return n, ids[n:], r
    return 0, ids


def _released(ids: list[int]) -> int:
    """How many leading entries are -1 (released entries only ever lead a table)."""
    if not ids or ids[0] >= 0:
        return 0
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if ids[mid] < 0:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _undelta(records: dict[str, list[int]], key: str,
             delta: tuple[int, list[int]] | tuple[int, list[int], int],
             what: str, step: int) -> list[int]:
    """The list ``_delta`` encoded; ``what`` and ``step`` name it in an error only (no
    message is built per row)."""
    k, tail = delta[0], delta[1]
    if k:
        known = records.get(key, [])
        if len(known) != k:
            raise RuntimeError(f"plan {step}: request {key}'s {what} extends {k} ids this "
                               f"rank does not hold (it has {len(known)})")
        if len(delta) == 3:
            r = min(delta[2], k)  # (past ``k`` the -1s are in ``tail``)
            ids = [-1] * r + known[r:] + tail
        else:
            ids = known + tail if tail else known  # shared when nothing was added
    else:
        ids = tail
    records[key] = ids
    return ids


def _same_or_new(records: dict[str, Any], key: str, value: Any,
                 same: Callable[[Any, Any], bool]) -> tuple[bool, Any]:
    """``(True, None)`` when the rank's record is ``value``, else ``(False, value)``."""
    if key in records and same(records[key], value):
        return True, None
    records[key] = value
    return False, value


def _recorded(records: dict[str, Any], key: str, sent: tuple[bool, Any], what: str,
              step: int) -> Any:
    same, value = sent
    if not same:
        records[key] = value
        return value
    if key not in records:
        raise RuntimeError(f"plan {step}: request {key}'s {what} were never sent to this rank")
    return records[key]


def _extends(table: list[int], known: list[int]) -> bool:
    """Whether ``table`` starts with ``known`` (compared in C; most steps add no block,
    so the lengths match and no slice is made)."""
    n = len(known)
    if len(table) == n:
        return table == known
    return len(table) > n and table[:n] == known


def _is(a: object, b: object) -> bool:
    return a is b


def _same_params(known: dict[str, SamplingParams], params: dict[str, SamplingParams]) -> bool:
    """Whether a row's parameters are the ones already sent, object for object."""
    if len(known) != len(params):
        return False
    return all(known.get(sid) is p for sid, p in params.items())
