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
from pagedserve.scheduler.spec_decode import SpeculativeConfig
from tests.scheduler.helpers import (
    assert_baseline,
    check_invariants,
    make_scheduler,
    req,
    run_to_completion,
    step,
)

SHARED_PREFIX = [5, 6, 7, 8, 9, 10, 11, 12]


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sched = None
        self.sim = None
        self.next_id = 0

    @rule(
        gpu_blocks=st.integers(8, 24),
        cpu_blocks=st.integers(0, 12),
        mode=st.sampled_from(["swap", "recompute"]),
        budget=st.integers(2, 24),
        spec=st.sampled_from([None, None, 1, 3]),
        copy_period=st.sampled_from([None, 2, 5]),
        offload=st.booleans(),
    )
    @precondition(lambda self: self.sched is None)
    def init(self, gpu_blocks: int, cpu_blocks: int, mode: str, budget: int,
             spec: int | None, copy_period: int | None, offload: bool) -> None:
        self.sched, self.sim = make_scheduler(
            num_gpu_blocks=gpu_blocks,
            block_size=4,
            num_cpu_blocks=cpu_blocks,
            preemption_mode=mode,
            max_num_batched_tokens=budget,
            max_num_seqs=6,
            speculative_config=None if spec is None else SpeculativeConfig(
                num_speculative_tokens=spec, prompt_lookup_max=3),
            copy_period=copy_period,
            enable_kv_offload=offload and cpu_blocks > 0,
        )

    @rule(
        prompt_len=st.integers(1, 20),
        shared=st.booleans(),
        max_tokens=st.integers(1, 10),
        n=st.integers(1, 3),
        salt=st.sampled_from([None, None, "t1"]),
    )
    @precondition(lambda self: self.sched is not None)
    def add(self, prompt_len: int, shared: bool, max_tokens: int, n: int, salt: str | None) -> None:
        rid = f"q{self.next_id}"
        self.next_id += 1
        tail = [100 + (self.next_id * 13 + j) % 80 for j in range(prompt_len)]
        prompt = (SHARED_PREFIX + tail) if shared else tail
        try:
            self.sched.add_request(req(rid, prompt, max_tokens, n=n, salt=salt, sched=self.sched))
        except ValueError as e:
            assert "KV blocks" in str(e)

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
