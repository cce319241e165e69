"""The priority policy (vLLM's ``scheduling_policy="priority"``): waiting requests are
admitted by ``(priority, arrival)``, a short pool preempts the least urgent running
request, swapped requests come back most urgent first, and the order never changes
what a request produces; ``fcfs`` ignores priorities."""

from __future__ import annotations

import pytest

from pagedserve.scheduler.config import CacheConfig, SchedulerConfig
from pagedserve.scheduler.outputs import SchedulerOutput
from pagedserve.scheduler.queues import PriorityQueue
from pagedserve.scheduler.request import Request
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler
from tests.scheduler.helpers import assert_baseline, check_invariants
from tests.scheduler.kv_sim import KVSim

# (request id, priority) in arrival order.
ARRIVALS = [("a", 3), ("b", 1), ("c", 2), ("d", 1), ("e", 0), ("f", 3)]


def make(policy: str, num_gpu_blocks: int = 128, num_cpu_blocks: int = 0,
         preemption_mode: str = "swap", max_num_seqs: int = 16) -> tuple[Scheduler, KVSim]:
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
                        max_model_len=256, preemption_mode=preemption_mode, policy=policy),
        CacheConfig(num_gpu_blocks=num_gpu_blocks, block_size=4,
                    num_cpu_blocks=num_cpu_blocks, model_id="test-model"))
    return sched, KVSim(num_gpu_blocks, num_cpu_blocks, 4)


def add_all(sched: Scheduler, max_tokens: int = 6, only: str = "abcdef") -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for i, (rid, prio) in enumerate(ARRIVALS):
        if rid not in only:
            continue
        req = sched.make_request(rid, [(7 * i + j) % 30 + 1 for j in range(4 + i)], params,
                                 priority=prio)
        req.arrival_time = 100.0 + i  # arrival order, independent of the clock's resolution
        sched.add_request(req)


def run(sched: Scheduler, sim: KVSim, later: tuple[int, str] | None = None
        ) -> tuple[dict[str, list[int]], list[str], list[str]]:
    """(outputs, order of first scheduling, order of preemption victims); ``later``:
    after that many steps, the requests named arrive. Every victim must be the least
    urgent of the requests it left running."""
    outputs: dict[str, list[int]] = {}
    started: list[str] = []
    victims: list[str] = []
    for n in range(1000):
        if later is not None and n == later[0]:
            add_all(sched, max_tokens=24, only=later[1])
        if not sched.has_unfinished_requests():
            return outputs, started, victims
        before = {r.request_id: r.num_preemptions for r in sched.requests.values()}
        plan = sched.schedule()
        new = [rid for rid, r in sched.requests.items()
               if r.num_preemptions > before.get(rid, 0)]
        if sched.config.policy == "priority":
            for rid in new:
                v = sched.requests[rid]
                assert all((v.priority, v.arrival_time) >= (r.priority, r.arrival_time)
                           for r in sched.running), (rid, [r.request_id for r in sched.running])
        victims += new
        started += [s.request_id for s in plan.scheduled if s.request_id not in started]
        for u in sched.update_from_output(plan, sim.execute(plan)):
            outputs.setdefault(u.request_id, []).extend(t.token_id for t in u.new_tokens)
        check_invariants(sched, sim)
    raise AssertionError("scheduler did not finish")


def test_waiting_requests_start_by_priority_then_arrival() -> None:
    sched, sim = make("priority", max_num_seqs=1)
    add_all(sched)
    _, started, _ = run(sched, sim)
    assert started == ["e", "b", "d", "c", "a", "f"]
    assert_baseline(sched)
    sched, sim = make("fcfs", max_num_seqs=1)
    add_all(sched)
    assert run(sched, sim)[1] == ["a", "b", "c", "d", "e", "f"]


@pytest.mark.parametrize("mode,num_cpu_blocks", [("swap", 64), ("recompute", 0)])
def test_a_short_pool_preempts_the_least_urgent_and_tokens_do_not_change(
        mode: str, num_cpu_blocks: int) -> None:
    ref_sched, ref_sim = make("fcfs")
    add_all(ref_sched, max_tokens=24)
    reference, _, _ = run(ref_sched, ref_sim)
    sched, sim = make("priority", num_gpu_blocks=14, num_cpu_blocks=num_cpu_blocks,
                      preemption_mode=mode)
    # The urgent ones arrive while the others run: admitted last, yet never the victims
    # (an admission-ordered running list would preempt them first).
    add_all(sched, max_tokens=24, only="acf")
    outputs, _, victims = run(sched, sim, later=(2, "bde"))
    assert outputs == reference
    assert victims, "the pool was not short enough to preempt anyone"
    assert "e" not in victims
    assert sched.num_preemptions[mode] == len(victims)
    assert_baseline(sched)


def test_priority_queue_keeps_priority_then_arrival_order() -> None:
    params = SamplingParams(max_tokens=1)
    q = PriorityQueue()
    reqs = {}
    for i, (rid, prio) in enumerate([("x", 2), ("y", 0), ("z", 2), ("w", 1)]):
        reqs[rid] = Request(rid, [1], params, priority=prio, arrival_time=float(i))
        q.append(reqs[rid])
    assert [r.request_id for r in q] == ["y", "w", "x", "z"]
    q.appendleft(q.pop())  # a request put back goes to its place, not to the front
    assert [r.request_id for r in q] == ["y", "w", "x", "z"]
    q.remove(reqs["w"])
    assert q.popleft() is reqs["y"] and q[0] is reqs["x"] and len(q) == 2
    q.extendleft([reqs["y"], reqs["w"]])
    assert [r.request_id for r in q] == ["y", "w", "x", "z"]


def _apply(sched: Scheduler, sim: KVSim, plan: SchedulerOutput,
           produced: dict[str, list[int]]) -> None:
    for u in sched.update_from_output(plan, sim.execute(plan)):
        produced.setdefault(u.request_id, []).extend(t.token_id for t in u.new_tokens)
    check_invariants(sched, sim)


@pytest.mark.parametrize("mode,num_cpu_blocks", [("swap", 64), ("recompute", 0)])
def test_an_urgent_arrival_takes_the_seat_of_the_least_urgent(mode: str,
                                                             num_cpu_blocks: int) -> None:
    """Both seats busy with less urgent requests: the urgent arrival preempts the least
    urgent one and runs in that same step; the victim resumes and nothing changes in
    what anyone produces. Under FCFS the arrival waits for a seat."""
    ref_sched, ref_sim = make("fcfs")
    add_all(ref_sched, max_tokens=12, only="ace")
    reference, _, _ = run(ref_sched, ref_sim)
    for policy in ("priority", "fcfs"):
        sched, sim = make(policy, num_cpu_blocks=num_cpu_blocks, preemption_mode=mode,
                          max_num_seqs=2)
        add_all(sched, max_tokens=12, only="ac")
        produced: dict[str, list[int]] = {}
        for _ in range(3):
            _apply(sched, sim, sched.schedule(), produced)
        add_all(sched, max_tokens=12, only="e")
        plan = sched.schedule()
        preempted = [r.request_id for r in sched.requests.values() if r.num_preemptions]
        if policy == "priority":
            assert preempted == ["a"] and "e" in {s.request_id for s in plan.scheduled}
        else:
            assert preempted == [] and "e" not in {s.request_id for s in plan.scheduled}
        _apply(sched, sim, plan, produced)
        outputs, _, _ = run(sched, sim)
        for rid, toks in outputs.items():
            produced.setdefault(rid, []).extend(toks)
        assert produced == reference
        assert_baseline(sched)


def _starvation_run(aging_s: float | None, steps: int = 80) -> int | None:
    """One seat; a priority-5 request arrives with the first of a stream of urgent
    (priority 0) requests, one per step (the clock: a second per step), each holding
    the seat two steps. The step at which the priority-5 request starts, or None."""
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=256,
                        policy="priority", priority_aging_s=aging_s),
        CacheConfig(num_gpu_blocks=128, block_size=4, model_id="test-model"))
    sim = KVSim(128, 0, 4)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    for step in range(steps):
        for rid, prio in ([("low", 5)] if step == 0 else []) + [(f"u{step}", 0)]:
            req = sched.make_request(rid, [3, 4, 5, 6], params, priority=prio)
            req.arrival_time = 100.0 + step
            sched.add_request(req)
        plan = sched.schedule()
        if any(s.request_id == "low" for s in plan.scheduled):
            return step
        sched.update_from_output(plan, sim.execute(plan))
        check_invariants(sched, sim)
    return None


def test_aging_bounds_how_long_urgent_arrivals_can_hold_back_a_request() -> None:
    # Strict priorities: 80 steps of urgent arrivals and it never starts.
    assert _starvation_run(None) is None
    # Aged by 2 s a level: it goes ahead of arrivals younger than 5 x 2 s after it,
    # i.e. once the ten urgent requests that came first are served (two steps each).
    start = _starvation_run(2.0)
    assert start is not None and 18 <= start <= 22, start
    # Aged faster, it starts sooner.
    start_fast = _starvation_run(0.5)
    assert start_fast is not None and start_fast < start


def test_aging_is_refused_outside_the_priority_policy() -> None:
    with pytest.raises(ValueError, match="priority_aging_s needs scheduling_policy"):
        SchedulerConfig(policy="fcfs", priority_aging_s=5.0)
    for bad in (0, -1.0, True, "5"):
        with pytest.raises(ValueError, match="priority_aging_s must be"):
            SchedulerConfig(policy="priority", priority_aging_s=bad)
