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
from pagedserve.scheduler.request import Request
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
    preempt = sched._preempt

    def never_in_flight(victim: Request, out: SchedulerOutput) -> None:
        # Its step's work would be thrown away: the row that needs blocks waits instead.
        assert victim.request_id not in sched.in_flight, f"preempted {victim.request_id}"
        preempt(victim, out)

    sched._preempt = never_in_flight  # type: ignore[method-assign]
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
    # A burst of prompts is spread over the two plans that may start: 9 tokens each.
    first, second = sched.schedule(), sched.schedule()
    assert [len(p.scheduled) for p in (first, second)] == [3, 3]
    assert not _ids(first) & _ids(second) and len(sched.plans_in_flight) == 2
    assert sched.schedule().is_empty  # every sequence is in flight
    sched.update_from_output(first, sim.execute(first))
    out_second = sim.execute(second)
    third = sched.schedule()  # while the second is in flight: the first's sequences again
    assert _ids(third) == _ids(first)
    sched.update_from_output(second, out_second)
    fourth = sched.schedule()
    assert _ids(fourth) == _ids(second)
    for p in (third, fourth):
        sched.update_from_output(p, sim.execute(p))
    assert not sched.in_flight and not sched.plans_in_flight
    check_invariants(sched, sim)


def test_an_abort_in_flight_frees_the_blocks_at_once() -> None:
    sched, sim = make_scheduler(max_concurrent_batches=2)
    sched.add_request(req("x", list(range(1, 9)), max_tokens=8, sched=sched))
    sched.add_request(req("y", list(range(20, 28)), max_tokens=8, sched=sched))
    first, second = sched.schedule(), sched.schedule()
    assert (_ids(first), _ids(second)) == ({"x"}, {"y"})
    out_first, out_second = sim.execute(first), sim.execute(second)
    free_before = sched.kv.pool.num_free_blocks
    assert sched.abort("x") == ["x"]
    assert sched.kv.pool.num_free_blocks > free_before
    assert sched.update_from_output(first, out_first) == []  # x's token is dropped
    assert [u.request_id for u in sched.update_from_output(second, out_second)] == ["y"]
    assert not sched.in_flight and not sched.plans_in_flight
    sched.abort("y")
    assert_baseline(sched)


def test_max_concurrent_batches_is_checked() -> None:
    with pytest.raises(ValueError, match="max_concurrent_batches must be a positive integer"):
        SchedulerConfig(max_concurrent_batches=0)
