"""The adapter cap (``max_loras``): no step plans more distinct LoRA adapters than the
cap, waiting requests over it are passed over and keep their FIFO places, the cap
changes when requests run but never what they produce, and prefix-cache blocks are
keyed by adapter."""

from __future__ import annotations

import pytest

from pagedserve.scheduler.config import CacheConfig, SchedulerConfig
from pagedserve.scheduler.lora_request import LoRARequest
from pagedserve.scheduler.outputs import SchedulerOutput
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler
from tests.scheduler.helpers import assert_baseline, check_invariants
from tests.scheduler.kv_sim import KVSim

LORAS = {i: LoRARequest(f"lora{i}", i, f"/adapters/lora{i}") for i in range(1, 5)}
# (request id, adapter id), in arrival order; 0 is the base model.
QUEUE = [("a", 1), ("b", 2), ("c", 3), ("d", 1), ("e", 0), ("f", 3), ("g", 2), ("h", 4)]
LORA_OF = {**dict(QUEUE), "i": 1, "j": 3}  # i and j arrive later


def make_lora_scheduler(max_loras: int, num_gpu_blocks: int = 128, num_cpu_blocks: int = 0,
                        preemption_mode: str = "swap", max_num_batched_tokens: int = 64
                        ) -> tuple[Scheduler, KVSim]:
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_num_batched_tokens,
                        max_model_len=256, preemption_mode=preemption_mode,
                        max_loras=max_loras),
        CacheConfig(num_gpu_blocks=num_gpu_blocks, block_size=4, num_cpu_blocks=num_cpu_blocks,
                    model_id="test-model"),
    )
    return sched, KVSim(num_gpu_blocks, num_cpu_blocks, 4)


def prompt_of(i: int) -> list[int]:
    return [(11 * i + j) % 40 + 1 for j in range(3 + 2 * i)]


def add_queue(sched: Scheduler, max_tokens: int = 6) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for i, (rid, lora_id) in enumerate(QUEUE):
        sched.add_request(sched.make_request(rid, prompt_of(i), params,
                                             lora_request=LORAS.get(lora_id)))


def run(sched: Scheduler, sim: KVSim) -> tuple[dict[str, list[int]], list[SchedulerOutput]]:
    """Run to completion, checking the cap and the block invariants every step."""
    cap = sched.config.max_loras
    outputs: dict[str, list[int]] = {}
    plans: list[SchedulerOutput] = []
    for _ in range(1000):
        if not sched.has_unfinished_requests():
            return outputs, plans
        plan = sched.schedule()
        plans.append(plan)
        assert all(s.lora_id == LORA_OF[s.request_id] for s in plan.scheduled)
        if cap:
            in_plan = {s.lora_id for s in plan.scheduled} - {0}
            running = {r.lora_id for r in sched.running} - {0}
            assert len(in_plan) <= cap and len(running) <= cap, (in_plan, running)
        for u in sched.update_from_output(plan, sim.execute(plan)):
            outputs.setdefault(u.request_id, []).extend(t.token_id for t in u.new_tokens)
        check_invariants(sched, sim)
    raise AssertionError("scheduler did not finish")


def first_step(plans: list[SchedulerOutput]) -> dict[str, int]:
    first: dict[str, int] = {}
    for i, plan in enumerate(plans):
        for s in plan.scheduled:
            first.setdefault(s.request_id, i)
    return first


def test_requests_over_the_cap_are_skipped_and_keep_their_fifo_places() -> None:
    sched, sim = make_lora_scheduler(max_loras=2)
    add_queue(sched)
    plan = sched.schedule()
    # Adapters 1 and 2 take the two slots; 3 and 4 wait, base-model rows never count.
    assert [s.request_id for s in plan.scheduled] == ["a", "b", "d", "e", "g"]
    assert [r.request_id for r in sched.waiting] == ["c", "f", "h"]
    sched.update_from_output(plan, sim.execute(plan))
    params = SamplingParams(max_tokens=6, temperature=0.0)
    for rid in ("i", "j"):
        sched.add_request(sched.make_request(rid, prompt_of(0), params,
                                             lora_request=LORAS[LORA_OF[rid]]))
    plan = sched.schedule()  # i's adapter is running: it passes the skipped ones
    assert [s.request_id for s in plan.scheduled] == ["a", "b", "d", "e", "g", "i"]
    assert [r.request_id for r in sched.waiting] == ["c", "f", "h", "j"]
    sched.update_from_output(plan, sim.execute(plan))
    _, plans = run(sched, sim)
    first = first_step(plans)
    # Adapter 2 is done first (i keeps 1 busy a step longer): its slot goes to the
    # oldest skipped adapter, 3, with every request of it; 4 follows i.
    assert [s.request_id for s in plans[first["c"]].scheduled] == ["i", "c", "f", "j"]
    assert [s.request_id for s in plans[first["h"]].scheduled] == ["c", "f", "j", "h"]
    assert_baseline(sched)


def test_max_loras_zero_means_no_cap() -> None:
    sched, _ = make_lora_scheduler(max_loras=0)
    add_queue(sched)
    assert [s.request_id for s in sched.schedule().scheduled] == [rid for rid, _ in QUEUE]


@pytest.mark.parametrize("cap", [1, 2, 3])
@pytest.mark.parametrize("mode,num_cpu_blocks", [("swap", 64), ("recompute", 0)])
def test_the_cap_changes_the_order_never_the_tokens(cap, mode, num_cpu_blocks) -> None:
    ref_sched, ref_sim = make_lora_scheduler(max_loras=0, num_gpu_blocks=512)
    add_queue(ref_sched, max_tokens=12)
    reference, _ = run(ref_sched, ref_sim)
    # A pool that cannot hold everyone: preemptions interleave with the cap.
    sched, sim = make_lora_scheduler(max_loras=cap, num_gpu_blocks=12,
                                     num_cpu_blocks=num_cpu_blocks, preemption_mode=mode,
                                     max_num_batched_tokens=16)
    add_queue(sched, max_tokens=12)
    outputs, plans = run(sched, sim)
    assert outputs == reference
    assert max(len({s.lora_id for s in p.scheduled} - {0}) for p in plans) == cap
    assert sched.num_preemptions[mode] > 0
    assert_baseline(sched)


def test_prefix_cache_blocks_are_keyed_by_adapter() -> None:
    sched, sim = make_lora_scheduler(max_loras=2)
    prompt = list(range(1, 18))  # 4 full blocks of 4 and one token
    params = SamplingParams(max_tokens=2, temperature=0.0)
    sched.add_request(sched.make_request("first", prompt, params, lora_request=LORAS[1]))
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        sched.update_from_output(plan, sim.execute(plan))

    def cached_tokens(lora: LoRARequest | None, salt: str | None = None) -> int:
        req = sched.make_request("probe", prompt, params, cache_salt=salt, lora_request=lora)
        return sched.kv.get_computed_blocks(req)[1]

    assert cached_tokens(LORAS[1]) == 16
    assert cached_tokens(None) == 0
    assert cached_tokens(LORAS[2]) == 0
    assert cached_tokens(LORAS[1], salt="tenant") == 0
    assert_baseline(sched)
