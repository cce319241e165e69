"""Random add / step / finish / abort sequences under memory pressure, with and
without speculative decoding (n-gram drafts against a simulated model that
often repeats itself, so guesses are both accepted and rejected), with and
without KV offloading to the CPU tier.

After every rule: refcounts equal block-table membership, no block is both
free and referenced, every hash names the tokens its block holds (checked
against simulated KV content). At teardown every request is ended and the
pool must be back at baseline.
"""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedserve.scheduler.request import RequestStatus
from tests.scheduler.helpers import (
    REQUEST_DRAWS,
    SCHEDULER_DRAWS,
    add_numbered,
    assert_baseline,
    check_invariants,
    machine_scheduler,
    run_to_completion,
    step,
)


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sched = None
        self.sim = None
        self.next_id = 0

    @rule(**SCHEDULER_DRAWS)
    @precondition(lambda self: self.sched is None)
    def init(self, gpu_blocks: int, cpu_blocks: int, mode: str, budget: int,
             spec: int | None, copy_period: int | None, offload: bool,
             window: int | tuple[int | None, ...] | None) -> None:
        self.sched, self.sim = machine_scheduler(gpu_blocks, cpu_blocks, mode, budget, spec,
                                                 copy_period, offload, window=window)

    @rule(**REQUEST_DRAWS)
    @precondition(lambda self: self.sched is not None)
    def add(self, prompt_len: int, shared: bool, max_tokens: int, n: int, salt: str | None) -> None:
        add_numbered(self.sched, self.next_id, prompt_len, shared, max_tokens, n, salt)
        self.next_id += 1

    @rule(times=st.integers(1, 4))
    @precondition(lambda self: self.sched is not None)
    def steps(self, times: int) -> None:
        for _ in range(times):
            step(self.sched, self.sim)

    @rule(data=st.data())
    @precondition(lambda self: self.sched is not None and self.sched.groups)
    def abort(self, data: st.DataObject) -> None:
        gid = data.draw(st.sampled_from(sorted(self.sched.groups)))
        self.sched.abort(gid)

    @rule(data=st.data())
    @precondition(lambda self: self.sched is not None and self.sched.running)
    def finish_by_stop_string(self, data: st.DataObject) -> None:
        r = data.draw(st.sampled_from(self.sched.running))
        self.sched.finish_request(r.request_id, RequestStatus.FINISHED_STOPPED)

    @rule()
    @precondition(lambda self: self.sched is not None)
    def abort_mid_step(self) -> None:
        plan = self.sched.schedule()
        if plan.scheduled:
            self.sched.abort(plan.scheduled[-1].request_id.split("#")[0])
        self.sched.update_from_output(plan, self.sim.execute(plan))

    @invariant()
    def consistent(self) -> None:
        if self.sched is not None:
            check_invariants(self.sched, self.sim)

    def teardown(self) -> None:
        if self.sched is not None:
            run_to_completion(self.sched, self.sim)
            self.sched.schedule()  # drain finished / aborted id lists
            assert_baseline(self.sched)


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
