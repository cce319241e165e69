"""Continuous batching, chunked prefill, fork/CoW, preemption and abort."""

import pickle

import pytest

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.request import RequestStatus
from pagedserve.scheduler.sampling_params import SamplingParams
from tests.scheduler.helpers import (
    assert_baseline,
    check_invariants,
    make_scheduler,
    req,
    run_to_completion,
    step,
)

PROMPTS = {f"r{i}": [(7 * i + j) % 50 + 1 for j in range(5 + 6 * i)] for i in range(6)}


def reference_outputs(max_tokens: int = 12) -> dict[str, list[int]]:
    sched, sim = make_scheduler(num_gpu_blocks=512, max_num_batched_tokens=512)
    for rid, p in PROMPTS.items():
        sched.add_request(req(rid, p, max_tokens, sched=sched))
    return run_to_completion(sched, sim)


def test_running_decodes_come_first_then_waiting_prefills_within_budget() -> None:
    sched, sim = make_scheduler(max_num_batched_tokens=10)
    sched.add_request(req("a", [1, 2, 3], sched=sched))
    plan = sched.schedule()
    assert [(s.request_id, len(s.token_ids)) for s in plan.scheduled] == [("a", 3)]
    sched.update_from_output(plan, sim.execute(plan))
    sched.add_request(req("b", list(range(1, 13)), sched=sched))
    plan = sched.schedule()
    assert [(s.request_id, len(s.token_ids)) for s in plan.scheduled] == [("a", 1), ("b", 9)]
    assert plan.scheduled[1].sample_ids == []  # a non-final chunk samples nothing
    sched.update_from_output(plan, sim.execute(plan))
    plan = sched.schedule()
    assert [(s.request_id, len(s.token_ids), s.num_computed_tokens) for s in plan.scheduled] == [
        ("a", 1, 4),
        ("b", 3, 9),
    ]
    assert plan.scheduled[1].sample_ids == ["b"]


def test_plan_is_plain_and_picklable() -> None:
    sched, _ = make_scheduler()
    sched.add_request(req("a", [1, 2, 3, 4, 5], sched=sched))
    plan = sched.schedule()
    again = pickle.loads(pickle.dumps(plan))
    assert again == plan and again.scheduled[0].block_table == [0, 1]


def test_max_num_seqs_caps_running() -> None:
    sched, _sim = make_scheduler(max_num_seqs=2)
    for i in range(4):
        sched.add_request(req(f"r{i}", [1, 2, 3], sched=sched))
    plan = sched.schedule()
    assert [s.request_id for s in plan.scheduled] == ["r0", "r1"]


@pytest.mark.parametrize("budget", [3, 7, 64])
def test_chunked_prefill_gives_the_same_tokens(budget: int) -> None:
    ref = reference_outputs()
    sched, sim = make_scheduler(num_gpu_blocks=512, max_num_batched_tokens=budget)
    for rid, p in PROMPTS.items():
        sched.add_request(req(rid, p, 12, sched=sched))
    assert run_to_completion(sched, sim) == ref
    assert_baseline(sched)


@pytest.mark.parametrize("cap", [1, 5, 16])
def test_long_prefill_threshold_caps_each_prompt_and_changes_no_token(cap: int) -> None:
    sched, sim = make_scheduler(num_gpu_blocks=512, long_prefill_token_threshold=cap)
    for rid, p in PROMPTS.items():
        sched.add_request(req(rid, p, 12, sched=sched))
    outputs: dict[str, list[int]] = {}
    first = True
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        assert all(len(r.token_ids) <= cap for r in plan.scheduled)
        if first:  # as many prompts start as the budget holds, in arrival order
            ids = [r.request_id for r in plan.scheduled]
            assert ids == list(PROMPTS)[:len(ids)] and len(ids) >= min(6, 64 // cap)
            first = False
        for u in sched.update_from_output(plan, sim.execute(plan)):
            outputs.setdefault(u.request_id, []).extend(t.token_id for t in u.new_tokens)
        check_invariants(sched, sim)
    assert outputs == reference_outputs()
    assert_baseline(sched)


def test_a_short_prompt_starts_beside_a_long_one_under_the_threshold() -> None:
    """Without the cap a 200-token prompt takes the whole 64-token budget for four steps
    and the 5-token prompt behind it waits; with a cap of 32 both run in step one."""
    for cap, short_starts_at in ((0, 3), (32, 0)):
        sched, sim = make_scheduler(num_gpu_blocks=512, long_prefill_token_threshold=cap)
        sched.add_request(req("long", list(range(1, 201)), 4, sched=sched))
        sched.add_request(req("short", [7, 8, 9, 10, 11], 4, sched=sched))
        first = None
        for k in range(6):
            if "short" in step(sched, sim):
                first = k
                break
        assert first == short_starts_at, (cap, first)


def test_long_prefill_threshold_is_checked() -> None:
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="long_prefill_token_threshold"):
            SchedulerConfig(long_prefill_token_threshold=bad)
    with pytest.raises(ValueError, match="enable_chunked_prefill"):
        SchedulerConfig(long_prefill_token_threshold=8, enable_chunked_prefill=False,
                        max_num_batched_tokens=4096)


@pytest.mark.parametrize("mode,cpu_blocks", [("swap", 64), ("recompute", 0), ("swap", 3)])
def test_forced_preemption_gives_the_same_tokens(mode: str, cpu_blocks: int) -> None:
    ref = reference_outputs()
    sched, sim = make_scheduler(num_gpu_blocks=14, num_cpu_blocks=cpu_blocks, preemption_mode=mode)
    for rid, p in PROMPTS.items():
        sched.add_request(req(rid, p, 12, sched=sched))
    assert run_to_completion(sched, sim) == ref
    assert sum(sched.num_preemptions.values()) > 0
    if mode == "swap" and cpu_blocks == 64:
        assert sched.num_preemptions["swap"] > 0
    if cpu_blocks == 0:
        assert sched.num_preemptions["swap"] == 0
    assert_baseline(sched)


def test_prefix_hits_give_the_same_tokens_and_are_counted() -> None:
    ref = reference_outputs()
    sched, sim = make_scheduler(num_gpu_blocks=512)
    for rid, p in PROMPTS.items():
        sched.add_request(req(rid, p, 12, sched=sched))
    run_to_completion(sched, sim)
    for rid, p in PROMPTS.items():
        sched.add_request(req(rid, p, 12, sched=sched))
    again = run_to_completion(sched, sim)
    assert again == ref
    assert sched.kv.prefix_hits > 0
    assert_baseline(sched)


def test_fork_shares_the_partial_prompt_block_then_copies_on_write() -> None:
    sched, sim = make_scheduler(block_size=4)
    sched.add_request(req("g", list(range(1, 11)), max_tokens=3, n=3, sched=sched))
    plan = sched.schedule()
    assert plan.scheduled[0].sample_ids == ["g", "g#1", "g#2"]
    sched.update_from_output(plan, sim.execute(plan))
    # All three share the 3 prompt blocks, including the partial one.
    assert sched.kv.block_ids("g") == sched.kv.block_ids("g#1") == sched.kv.block_ids("g#2")
    assert [b.ref_cnt for b in sched.kv.pool.blocks[:3]] == [3, 3, 3]
    assert sched.memory_stats().num_used_blocks == 3
    plan = sched.schedule()
    # Two writers copy the shared partial block; the last writer keeps it.
    assert plan.blocks_to_copy == [(2, 3), (2, 4)]
    assert [s.block_table for s in plan.scheduled] == [[0, 1, 3], [0, 1, 4], [0, 1, 2]]
    sched.update_from_output(plan, sim.execute(plan))
    out = run_to_completion(sched, sim)
    assert {k: len(v) for k, v in out.items()} == {"g": 1, "g#1": 1, "g#2": 1}
    assert_baseline(sched)


def test_fork_outputs_equal_independent_runs() -> None:
    prompt = list(range(1, 11))
    sched, sim = make_scheduler(num_gpu_blocks=8, num_cpu_blocks=8)
    sched.add_request(req("g", prompt, max_tokens=9, n=3, sched=sched))
    forked = run_to_completion(sched, sim)
    assert_baseline(sched)
    for i, rid in enumerate(["g", "g#1", "g#2"]):
        alone, sim2 = make_scheduler()
        r = req(rid, prompt, max_tokens=9, sched=alone)
        r.index = i  # the simulator offsets samples by index, like per-sample seeds
        alone.add_request(r)
        assert run_to_completion(alone, sim2)[rid] == forked[rid]


@pytest.mark.parametrize("where", ["waiting", "running", "swapped", "mid-step", "pending-fork"])
def test_abort_in_any_state_frees_everything(where: str) -> None:
    sched, sim = make_scheduler(num_gpu_blocks=8, num_cpu_blocks=16, max_num_batched_tokens=8)
    sched.add_request(req("keep", list(range(1, 9)), max_tokens=20, sched=sched))
    sched.add_request(req("x", list(range(1, 12)), max_tokens=20, n=2, sched=sched))
    if where == "waiting":
        assert sched.abort("x") == ["x", "x#1"]
    elif where == "pending-fork":
        step(sched, sim)  # x's prompt is chunked: siblings not forked yet
        assert sched.requests["x"].pending_children
        assert sorted(sched.abort("x")) == ["x", "x#1"]
    elif where == "running":
        step(sched, sim)
        step(sched, sim)
        assert sched.requests["x#1"].status is RequestStatus.RUNNING
        assert sorted(sched.abort("x")) == ["x", "x#1"]
    elif where == "swapped":
        for _ in range(30):
            step(sched, sim)
            if any(r.group_id == "x" for r in sched.swapped):
                break
        assert any(r.group_id == "x" for r in sched.swapped)
        sched.abort("x")
    else:
        plan = sched.schedule()
        sched.abort("x")
        sched.update_from_output(plan, sim.execute(plan))
    assert all(not rid.startswith("x") for rid in sched.requests)
    out = run_to_completion(sched, sim)
    assert len(out["keep"]) + 0 > 0
    assert_baseline(sched)


def test_abort_of_one_sibling_keeps_the_shared_blocks_of_the_others() -> None:
    sched, sim = make_scheduler(block_size=4)
    sched.add_request(req("g", list(range(1, 11)), max_tokens=6, n=2, sched=sched))
    step(sched, sim)
    assert sched.abort("g#1") == ["g#1"]
    assert [b.ref_cnt for b in sched.kv.pool.blocks[:3]] == [1, 1, 1]
    assert len(run_to_completion(sched, sim)["g"]) == 5
    assert_baseline(sched)


def test_request_that_can_never_fit_is_rejected_at_admission() -> None:
    sched, _ = make_scheduler(num_gpu_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add_request(req("big", list(range(1, 15)), max_tokens=8, sched=sched))
    with pytest.raises(ValueError, match="context"):
        sched.add_request(req("long", list(range(1, 70)), max_tokens=1, sched=sched))
    with pytest.raises(ValueError, match="max_tokens"):
        sched.add_request(req("mt", [1, 2], max_tokens=63, sched=sched))
    sched.add_request(req("ok", [1, 2, 3], max_tokens=4, sched=sched))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(req("ok", [1], sched=sched))


def test_eos_and_stop_token_ids_finish_and_free() -> None:
    sched, sim = make_scheduler()
    params = SamplingParams(max_tokens=50, temperature=0.0, stop_token_ids=[])
    r = sched.make_request("a", [1, 2, 3], params, eos_token_ids=())
    sched.add_request(r)
    first = step(sched, sim)["a"][0]
    sched2, sim2 = make_scheduler()
    sched2.add_request(sched2.make_request("a", [1, 2, 3], params, eos_token_ids=(first,)))
    upd = sched2.update_from_output(p := sched2.schedule(), sim2.execute(p))
    assert upd[0].finished and upd[0].finish_reason == "stop"
    assert_baseline(sched2)


def test_finish_request_from_a_stop_string() -> None:
    sched, sim = make_scheduler()
    sched.add_request(req("a", [1, 2, 3], max_tokens=30, sched=sched))
    step(sched, sim)
    sched.finish_request("a", RequestStatus.FINISHED_STOPPED)
    plan = sched.schedule()
    assert plan.finished_ids == ["a"] and not plan.scheduled
    assert_baseline(sched)


def test_memory_stats_count_shared_and_swapped_blocks() -> None:
    sched, sim = make_scheduler(block_size=4, num_cpu_blocks=8)
    sched.add_request(req("g", list(range(1, 11)), max_tokens=6, n=3, sched=sched))
    step(sched, sim)
    st = sched.memory_stats()
    assert (st.num_used_blocks, st.num_shared_blocks, st.kv_tokens) == (3, 3, 30)
    assert st.block_table_bytes == 3 * 3 * 4
    assert st.num_swapped_blocks == 0


def test_a_prompt_waiting_for_room_counts_its_prefix_hits_once() -> None:
    sched, sim = make_scheduler(num_gpu_blocks=6, block_size=4)
    hog = list(range(1, 9))  # 2 blocks, 6 with its 16 tokens: the whole pool
    sched.add_request(req("hog", hog, max_tokens=16, sched=sched))
    while sched.kv.pool.num_free_blocks:
        step(sched, sim)
    sched.add_request(req("late", [*hog, 99], max_tokens=4, sched=sched))
    waited = 0
    while sched.requests["late"].status is RequestStatus.WAITING:
        step(sched, sim)
        waited += 1
    assert waited >= 2  # it looked its prefix up on each of those steps
    run_to_completion(sched, sim)
    # Counted once, when admitted: 8 + 9 tokens looked up, the hog's 2 blocks found.
    assert (sched.kv.prefix_queries, sched.kv.prefix_hits) == (17, 8)
    assert_baseline(sched)
