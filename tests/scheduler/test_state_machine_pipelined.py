"""The state machine of ``test_state_machine`` with plans in flight.

Random add / submit / collect / finish / abort sequences with up to two or three
plans in flight at once (``max_concurrent_batches``, one per pipeline stage), under
memory pressure, swap or recompute preemption, n-gram drafts and KV offloading.
The KV simulator executes a plan when it is submitted and its results are applied
only when it is collected, oldest first, as the stages of a pipeline run them.

After every rule: the invariants of the one-plan machine hold (refcounts, free
lists, hashes against simulated KV content), plans in flight hold disjoint
sequences, and no sequence in flight was ever preempted. At teardown every plan is
collected, every request ended, and the pool must be back at baseline.
"""

from collections import deque

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedserve.scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from pagedserve.scheduler.request import Request, RequestStatus
from tests.scheduler.helpers import (
    REQUEST_DRAWS,
    SCHEDULER_DRAWS,
    add_numbered,
    assert_baseline,
    check_invariants,
    machine_scheduler,
    run_to_completion,
)

# Tighter pools than the one-plan machine's: a sequence in flight that would be the
# preemption victim is then common enough to be drawn.
DRAWS = {**SCHEDULER_DRAWS, "gpu_blocks": st.integers(6, 16), "depth": st.sampled_from([2, 3])}


def _ids(plan: SchedulerOutput) -> set[str]:
    return {r.request_id for r in plan.scheduled}


class PipelinedSchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sched = None
        self.sim = None
        self.depth = 1
        self.next_id = 0
        self.in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()

    @rule(**DRAWS)
    @precondition(lambda self: self.sched is None)
    def init(self, depth: int, gpu_blocks: int, cpu_blocks: int, mode: str, budget: int,
             spec: int | None, copy_period: int | None, offload: bool,
             window: int | tuple[int | None, ...] | None) -> None:
        self.depth = depth
        self.sched, self.sim = machine_scheduler(gpu_blocks, cpu_blocks, mode, budget, spec,
                                                 copy_period, offload, depth, window)
        sched = self.sched
        preempt = sched._preempt

        def never_in_flight(victim: Request, out: SchedulerOutput) -> None:
            assert victim.request_id not in sched.in_flight, f"preempted {victim.request_id}"
            preempt(victim, out)

        sched._preempt = never_in_flight  # type: ignore[method-assign]

    @rule(**REQUEST_DRAWS)
    @precondition(lambda self: self.sched is not None)
    def add(self, prompt_len: int, shared: bool, max_tokens: int, n: int,
            salt: str | None) -> None:
        add_numbered(self.sched, self.next_id, prompt_len, shared, max_tokens, n, salt)
        self.next_id += 1

    def _submit(self) -> SchedulerOutput | None:
        plan = self.sched.schedule()
        if plan.is_empty:
            assert self.in_flight or not self.sched.has_unfinished_requests(), "stuck"
            return None
        for other, _ in self.in_flight:
            assert not _ids(plan) & _ids(other), "a sequence in two plans in flight"
        self.in_flight.append((plan, self.sim.execute(plan)))
        return plan

    def _collect(self) -> None:
        plan, out = self.in_flight.popleft()
        self.sched.update_from_output(plan, out)

    @rule(times=st.integers(1, 3))
    @precondition(lambda self: self.sched is not None)
    def submit(self, times: int) -> None:
        for _ in range(times):
            if len(self.in_flight) >= self.depth or self._submit() is None:
                return

    @rule()
    @precondition(lambda self: self.sched is not None and self.in_flight)
    def collect(self) -> None:
        self._collect()

    @rule(data=st.data())
    @precondition(lambda self: self.sched is not None and self.sched.groups)
    def abort(self, data: st.DataObject) -> None:
        gid = data.draw(st.sampled_from(sorted(self.sched.groups)))
        self.sched.abort(gid)

    @rule(data=st.data())
    @precondition(lambda self: self.sched is not None and any(
        r.request_id not in self.sched.in_flight for r in self.sched.running))
    def finish_by_stop_string(self, data: st.DataObject) -> None:
        # The engine finds a stop string in a sequence whose results it just applied.
        r = data.draw(st.sampled_from([r for r in self.sched.running
                                       if r.request_id not in self.sched.in_flight]))
        self.sched.finish_request(r.request_id, RequestStatus.FINISHED_STOPPED)

    @rule()
    @precondition(lambda self: self.sched is not None and len(self.in_flight) < self.depth)
    def abort_while_in_flight(self) -> None:
        plan = self._submit()
        if plan is not None and plan.scheduled:  # (a plan may carry only swaps)
            self.sched.abort(plan.scheduled[-1].request_id.split("#")[0])

    @invariant()
    def consistent(self) -> None:
        if self.sched is not None:
            check_invariants(self.sched, self.sim)
            assert set(self.sched.in_flight) <= {
                r.request_id for p, _ in self.in_flight for r in p.scheduled}

    def teardown(self) -> None:
        if self.sched is not None:
            while self.in_flight:
                self._collect()
            assert not self.sched.in_flight and not self.sched.plans_in_flight
            run_to_completion(self.sched, self.sim)
            self.sched.schedule()  # drain finished / aborted id lists
            assert_baseline(self.sched)


TestPipelinedSchedulerMachine = PipelinedSchedulerMachine.TestCase
TestPipelinedSchedulerMachine.settings = settings(max_examples=400, stateful_step_count=50,
                                                  deadline=None)
