"""Several plans in flight (``max_concurrent_batches``, one per pipeline stage).

The KV simulator executes a plan when it is submitted and its output is applied only
after the following plans were scheduled, as the stages of a pipeline do: every
stage runs the plans in submission order, so a later plan's writes land after an
earlier one's. Tokens must equal the one-plan-at-a-time run's under preemption in
both modes, plans in flight must hold disjoint sequences, none of them may be
preempted, and an abort in flight frees the blocks at once.
"""

from __future__ import annotations

from collections import deque

import pytest

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from pagedserve.scheduler.request import RequestStatus
from pagedserve.scheduler.scheduler import Scheduler
from tests.scheduler.helpers import (
    assert_baseline,
    check_invariants,
    make_scheduler,
    req,
    run_to_completion,
)
from tests.scheduler.kv_sim import KVSim

# Shared prefixes (the first two), a long prompt that is chunked, and short ones.
PROMPTS = {f"r{i}": [(7 * i + j) % 50 + 1 for j in range(5 + 6 * i)] for i in range(6)}
PROMPTS["s0"] = [*PROMPTS["r3"][:12], 3, 1, 4]
PROMPTS["s1"] = [*PROMPTS["r3"][:12], 2, 7]


def _ids(plan: SchedulerOutput) -> set[str]:
    return {r.request_id for r in plan.scheduled}


def run_pipelined(sched: Scheduler, sim: KVSim, depth: int, max_rounds: int = 10_000
                  ) -> tuple[dict[str, list[int]], list[int]]:
    """Keep ``depth`` plans in flight, apply the oldest; returns the outputs and the
    number of rows of every plan started while another was in flight."""
    in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
    outputs: dict[str, list[int]] = {}
    overlapped: list[int] = []
    for _ in range(max_rounds):
        if not sched.has_unfinished_requests() and not in_flight:
            return outputs, overlapped
        while len(in_flight) < depth:
            plan = sched.schedule()
            if plan.is_empty:
                assert in_flight or not sched.has_unfinished_requests(), "stuck"
                break
            for other, _ in in_flight:
                assert not _ids(plan) & _ids(other), "a sequence in two plans in flight"
            if in_flight:
                overlapped.append(len(plan.scheduled))
            in_flight.append((plan, sim.execute(plan)))
        plan, out = in_flight.popleft()
        for u in sched.update_from_output(plan, out):
            outputs.setdefault(u.request_id, []).extend(t.token_id for t in u.new_tokens)
        check_invariants(sched, sim)
    raise AssertionError("scheduler did not finish")


def _add_all(sched: Scheduler, max_tokens: int = 12) -> None:
    for rid, p in PROMPTS.items():
        sched.add_request(req(rid, p, max_tokens, n=2 if rid == "r1" else 1, sched=sched))


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_two_plans_in_flight_give_the_tokens_of_one(mode: str) -> None:
    ref_sched, ref_sim = make_scheduler(num_gpu_blocks=512, max_num_batched_tokens=512)
    _add_all(ref_sched)
    reference = run_to_completion(ref_sched, ref_sim)
    sched, sim = make_scheduler(num_gpu_blocks=20, num_cpu_blocks=64 if mode == "swap" else 0,
                                preemption_mode=mode, max_num_batched_tokens=24,
                                max_concurrent_batches=2)
    _add_all(sched)
    outputs, overlapped = run_pipelined(sched, sim, depth=2)
    assert outputs == reference
    assert sched.num_preemptions[mode] > 0  # the pool was short while plans were in flight
    assert len(overlapped) > 10 and sum(overlapped) > 20
    assert not sched.in_flight
    assert_baseline(sched)


def test_each_plan_takes_its_share_of_the_running_sequences() -> None:
    sched, sim = make_scheduler(max_num_batched_tokens=256, max_concurrent_batches=2)
    for i in range(6):
        sched.add_request(req(f"q{i}", [i + 1] * 3, max_tokens=6, sched=sched))
    first = sched.schedule()
    assert len(first.scheduled) == 6  # admissions are not capped
    assert sched.schedule().is_empty  # every sequence is in flight
    sched.update_from_output(first, sim.execute(first))
    a, b = sched.schedule(), sched.schedule()
    assert len(a.scheduled) == len(b.scheduled) == 3 and not _ids(a) & _ids(b)
    out_a, out_b = sim.execute(a), sim.execute(b)
    sched.update_from_output(a, out_a)
    c = sched.schedule()  # while b is in flight: a's sequences again
    assert _ids(c) == _ids(a)
    sched.update_from_output(b, out_b)
    sched.update_from_output(c, sim.execute(c))
    check_invariants(sched, sim)


def test_a_sequence_in_flight_is_never_preempted() -> None:
    """A needs a block while the only victim, C, is in flight: A waits a plan instead of
    preempting C (whose step still writes its blocks); once C is back, C is preempted."""
    sched, sim = make_scheduler(num_gpu_blocks=6, block_size=4, num_cpu_blocks=16,
                                max_num_batched_tokens=64, max_concurrent_batches=2)
    prompts = {"A": list(range(1, 8)), "B": list(range(11, 15)), "C": list(range(21, 25))}
    for rid, p in prompts.items():
        sched.add_request(req(rid, p, max_tokens=12, sched=sched))
    first = sched.schedule()
    assert _ids(first) == {"A", "B", "C"}
    sched.update_from_output(first, sim.execute(first))
    ab = sched.schedule()
    assert _ids(ab) == {"A", "B"}  # B's first decode takes the fifth block
    c = sched.schedule()
    assert _ids(c) == {"C"}  # C's takes the sixth: the pool is full
    out_c = sim.execute(c)
    sched.update_from_output(ab, sim.execute(ab))
    blocked = sched.schedule()  # A reaches its third block; the victim would be C
    assert blocked.is_empty and not blocked.blocks_to_swap_out
    assert sched.requests["C"].status is RequestStatus.RUNNING
    assert sched.num_preemptions == {"swap": 0, "recompute": 0}
    sched.update_from_output(c, out_c)
    after = sched.schedule()
    assert sched.num_preemptions["swap"] == 1 and sched.requests["C"].status is \
        RequestStatus.SWAPPED
    assert "A" in _ids(after)
    sched.update_from_output(after, sim.execute(after))
    check_invariants(sched, sim)


def test_an_abort_in_flight_frees_the_blocks_at_once() -> None:
    sched, sim = make_scheduler(max_concurrent_batches=2)
    sched.add_request(req("x", list(range(1, 10)), max_tokens=8, sched=sched))
    sched.add_request(req("y", list(range(20, 26)), max_tokens=8, sched=sched))
    plan = sched.schedule()
    out = sim.execute(plan)
    free_before = sched.kv.pool.num_free_blocks
    assert sched.abort("x") == ["x"]
    assert sched.kv.pool.num_free_blocks > free_before
    updates = sched.update_from_output(plan, out)  # x's token is dropped
    assert [u.request_id for u in updates] == ["y"]
    assert not sched.in_flight
    sched.abort("y")
    assert_baseline(sched)


def test_max_concurrent_batches_is_checked() -> None:
    with pytest.raises(ValueError, match="max_concurrent_batches must be a positive integer"):
        SchedulerConfig(max_concurrent_batches=0)
