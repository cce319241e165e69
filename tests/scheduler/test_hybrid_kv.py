"""One block table per KV cache group (``scheduler/kv_groups.py``, ``hybrid_kv.py``).

The KV simulator writes every step through every group's table and reads each
group's window back through its own; the token follows the full group's reading and
every sliding group's must be its end. Each run is compared with the same "model"
served with one table that keeps every block, so a block released too early, a
table that loses its place, or a hit one group cannot resume from changes the tokens
or trips the simulator.
"""

from __future__ import annotations

import pytest

from pagedserve.scheduler.admission import blocks_held
from pagedserve.scheduler.kv_cache_manager import RELEASED
from pagedserve.scheduler.kv_groups import plan_kv_groups
from pagedserve.scheduler.memory import memory_stats
from pagedserve.scheduler.outputs import SchedulerOutput
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.spec_decode import SpeculativeConfig
from tests.scheduler.helpers import (
    assert_baseline,
    check_invariants,
    make_scheduler,
    req,
    run_to_completion,
    step,
)
from tests.scheduler.kv_sim import KVSim

B, W = 4, 6
GROUPS = (None, W, W)  # one full group, two sliding ones (Gemma's 1 : 2 here)


def test_gemma3_layers_group_by_kind_in_groups_of_the_rarer_kind() -> None:
    """Gemma 3 1B: 26 layers, every sixth full. Four full layers make group 0; the 22
    sliding ones six groups of four (the last two slots of the last one unused)."""
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]
    layout = plan_kv_groups(windows)
    assert layout.windows == (None,) + (512,) * 6
    assert layout.layers[0] == (5, 11, 17, 23)
    assert layout.layers[1] == (0, 1, 2, 3) and layout.layers[6] == (24, 25)
    assert layout.group_size == 4 and layout.is_hybrid
    assert layout.local_slots(range(26))[:7] == [0, 1, 2, 3, 0, 0, 1]
    # A pipeline stage of layers 13..25 numbers its own slots from 0 in each group.
    assert layout.local_slots(range(13, 26)) == [0, 0, 1, 2, 0, 3, 0, 1, 2, 3, 1, 0, 1]


def test_one_kind_or_hybrid_off_is_one_table() -> None:
    assert plan_kv_groups([8] * 4).windows == (8,)  # every layer slides: one table releases
    assert plan_kv_groups([None, 8] * 2, hybrid=False).windows == (None,)  # keeps all
    gemma2 = plan_kv_groups([8, None] * 3)  # alternating: one full group, one sliding
    assert gemma2.windows == (None, 8) and gemma2.layers == ((1, 3, 5), (0, 2, 4))
    widest_first = plan_kv_groups([4, 16, 4, 16])
    assert widest_first.windows == (16, 4)
    with pytest.raises(ValueError, match="window"):
        plan_kv_groups([None, 0])


def _prompts() -> dict[str, list[int]]:
    return {f"r{i}": [100 + (7 * i + 3 * j) % 90 for j in range(5 + 11 * i)] for i in range(4)}


def _run(groups: tuple[int | None, ...], **kw) -> tuple[dict[str, list[int]], object]:
    """The prompts to completion: with ``groups`` one table per group, else one table
    that keeps every block for the same groups' reads."""
    sched, _ = make_scheduler(kv_group_windows=groups, block_size=B, **kw)
    sim = KVSim(kw.get("num_gpu_blocks", 64), kw.get("num_cpu_blocks", 0), B,
                group_windows=GROUPS)
    if not groups:  # one table: the simulator reads every group through it
        sim_execute = sim.execute

        def execute(plan):
            for sr in plan.scheduled:
                sr.group_block_tables = [sr.block_table] * (len(GROUPS) - 1)
            return sim_execute(plan)
        sim.execute = execute
    for rid, prompt in _prompts().items():
        sched.add_request(req(rid, prompt, max_tokens=30, sched=sched))
    out = run_to_completion(sched, sim)
    assert_baseline(sched)
    return out, sched


def test_group_tables_change_no_token_and_sliding_groups_hold_their_window() -> None:
    kept, _ = _run((), max_num_batched_tokens=8)
    sched, _ = make_scheduler(kv_group_windows=GROUPS, block_size=B, max_num_batched_tokens=8)
    sim = KVSim(64, 0, B, group_windows=GROUPS)
    for rid, prompt in _prompts().items():
        sched.add_request(req(rid, prompt, max_tokens=30, sched=sched))
    out: dict[str, list[int]] = {}
    peak = [0, 0, 0]
    while sched.has_unfinished_requests():
        for rid, toks in step(sched, sim).items():
            out.setdefault(rid, []).extend(toks)
        for g, group in enumerate(sched.kv.group_managers):
            for blocks in group.req_blocks.values():
                peak[g] = max(peak[g], sum(b is not RELEASED for b in blocks))
    assert out == kept
    # The longest request (38-token prompt, 30 out: 17 blocks) keeps all 17 in the full
    # group; each sliding group at most the window's and a chunk's (5 blocks).
    bound = blocks_held(1 << 30, sched.config, B, W)
    assert peak[0] == 17 and peak[1] == peak[2] <= bound == 5
    assert_baseline(sched)


@pytest.mark.parametrize(("mode", "cpu_blocks"), [("swap", 40), ("recompute", 0)])
def test_preemption_with_group_tables_gives_the_same_tokens(mode: str, cpu_blocks: int) -> None:
    """A pool of 30 blocks for four requests over three tables: they preempt each other
    (swapping out every group's table, released entries included, or recomputing)."""
    roomy, _ = _run(GROUPS, max_num_batched_tokens=8)
    tight, sched = _run(GROUPS, num_gpu_blocks=30, num_cpu_blocks=cpu_blocks,
                        preemption_mode=mode, max_num_batched_tokens=8)
    assert tight == roomy
    assert sum(sched.num_preemptions.values()) > 0


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_forks_drafts_and_prefix_hits_across_groups(method: str) -> None:
    """n=3 siblings share every group's blocks; n-gram (or suffix decoding's longer)
    drafts are verified and rolled back in all tables; the same prompt again hits 7
    blocks: the full group's seven, the sliding groups' last two (the ones before the
    window come back released)."""
    spec = SpeculativeConfig(method=method, num_speculative_tokens=3 if method == "ngram"
                             else None, prompt_lookup_max=3)
    sched, sim = make_scheduler(kv_group_windows=GROUPS, block_size=B, copy_period=3,
                                speculative_config=spec)
    prompt = [100 + j % 50 for j in range(29)]
    params = SamplingParams(n=3, max_tokens=12, temperature=0.0)
    sched.add_request(sched.make_request("a", prompt, params))
    first = run_to_completion(sched, sim)
    sched.add_request(sched.make_request("b", prompt, params))
    plan = sched.schedule()
    (sr,) = plan.scheduled
    assert sr.num_computed_tokens == 28
    assert -1 not in sr.block_table[:7]
    for table in sr.group_block_tables:
        assert table[:5] == [-1] * 5 and -1 not in table[5:]
    second: dict[str, list[int]] = {}
    for u in sched.update_from_output(plan, sim.execute(plan)):
        second.setdefault(u.request_id, []).extend(t.token_id for t in u.new_tokens)
    check_invariants(sched, sim)
    for rid, toks in run_to_completion(sched, sim).items():
        second.setdefault(rid, []).extend(toks)
    assert len(first) == 3 and {k.replace("a", "b", 1): v for k, v in first.items()} == second
    assert sched.spec_stats["num_accepted_tokens"] > 0
    assert_baseline(sched)


def test_a_hit_needs_only_the_window_of_a_sliding_group() -> None:
    """Evicting a sliding group's early blocks does not lose the hit (its first query
    never reads them); evicting one inside the window moves the hit back to that block;
    evicting the full group's block cuts the hit there."""
    prompt = [100 + j % 70 for j in range(33)]  # 8 full blocks; the hit can reach 8
    for evict, want in [(None, 32), ((1, 0), 32), ((1, 6), 24), ((0, 3), 12)]:
        sched, sim = make_scheduler(kv_group_windows=GROUPS, block_size=B)
        sched.add_request(req("a", prompt, max_tokens=1, sched=sched))
        run_to_completion(sched, sim)
        if evict is not None:
            g, i = evict
            salted = sched.kv.group_managers[g].salted(_hashes(sched, prompt)[i])
            sched.kv.pool._evict(sched.kv.pool.get_cached_block(salted))
        probe = req("b", [*prompt, 7], max_tokens=1, sched=sched)
        _, num_hit = sched.kv.get_computed_blocks(probe)
        assert num_hit == want, (evict, num_hit)


def _hashes(sched, prompt: list[int]) -> list[bytes]:
    return req("h", prompt, sched=sched).update_block_hashes(B)


def test_admission_counts_every_table_and_stats_count_every_group() -> None:
    """A request's blocks: its length in the full group, a window plus a step's in
    each sliding one; one that cannot fit that is refused; the stats walk all tables."""
    sched, sim = make_scheduler(num_gpu_blocks=24, kv_group_windows=GROUPS, block_size=B,
                                max_num_batched_tokens=4)
    sched.add_request(req("long", [100 + j % 60 for j in range(40)], max_tokens=20,
                          sched=sched))  # 15 blocks + 4 in each sliding group at most
    for _ in range(20):
        step(sched, sim)
    stats = memory_stats(sched)
    assert stats.num_used_blocks == 24 - stats.num_free_blocks <= 24
    assert 0 < stats.kv_tokens <= stats.allocated_slots
    run_to_completion(sched, sim)
    with pytest.raises(ValueError, match="request needs 26 KV blocks"):
        sched.add_request(req("longer", [100] * 60, max_tokens=12, sched=sched))
    assert_baseline(sched)


def test_the_longest_request_a_pool_admits() -> None:
    """What the HTTP front caps a request's default ``max_tokens`` by: one table, the
    pool; groups, the full tables after each sliding table's bound; every table
    sliding, the context. Exactly the length admission starts refusing at."""
    for groups, want in [((), 24 * B), (GROUPS, (24 - 2 * 4) * B), ((W, 4), 256)]:
        sched, _ = make_scheduler(num_gpu_blocks=24, kv_group_windows=groups, block_size=B,
                                  max_num_batched_tokens=4)
        assert sched.max_request_tokens() == want
        if want < 256:
            sched.add_request(req("fits", [100] * (want - 10), max_tokens=10, sched=sched))
            with pytest.raises(ValueError, match="KV blocks"):
                sched.add_request(req("over", [100] * (want - 10), max_tokens=11,
                                      sched=sched))


def _check_cpu_copies(sched, sim: KVSim, tokens: dict[bytes, list[int]]) -> None:
    """Every block the CPU tier names holds the tokens its (group-salted) hash stands
    for; ``tokens`` is updated with the live requests' blocks first."""
    for r in sched.requests.values():
        for i, h in enumerate(r.update_block_hashes(B)):
            for g in sched.kv.group_managers:
                tokens[g.salted(h)] = r.all_token_ids[i * B:(i + 1) * B]
    for h, cpu_id in sched.kv.cpu_pool.cached.items():
        assert sim.cpu[cpu_id] == tokens[h], f"CPU block {cpu_id} holds other tokens"


@pytest.mark.parametrize(("mode", "cpu_blocks"), [("swap", 96), ("swap", 20),
                                                  ("recompute", 64)])
def test_offloading_with_group_tables_gives_the_same_tokens(mode: str, cpu_blocks: int) -> None:
    """KV offloading with a table per group: in a 40-block pool, later waves of prompts
    that extend earlier ones find their prefixes evicted to the CPU tier, and continue
    device hits there in every group (the full group's blocks, each sliding group's
    window), under preemption; the tokens are those of a roomy run without caching, and
    every CPU copy holds what its hash names."""
    from tests.scheduler.test_kv_offload import prompts_sharing_prefixes

    prompts = prompts_sharing_prefixes(seed=cpu_blocks, count=24)
    roomy, _ = make_scheduler(num_gpu_blocks=1024, kv_group_windows=GROUPS, block_size=B,
                              enable_prefix_caching=False)
    for rid, p in prompts.items():
        roomy.add_request(req(rid, p, max_tokens=6, sched=roomy))
    ref = run_to_completion(roomy, KVSim(1024, 0, B, group_windows=GROUPS))
    sched, _ = make_scheduler(num_gpu_blocks=40, num_cpu_blocks=cpu_blocks,
                              kv_group_windows=GROUPS, block_size=B, preemption_mode=mode,
                              max_num_batched_tokens=32, enable_kv_offload=True)
    sim = KVSim(40, cpu_blocks, B, group_windows=GROUPS)
    tokens: dict[bytes, list[int]] = {}
    ids = list(prompts)
    for w in range(3):
        for rid in ids[w * 8:(w + 1) * 8]:
            sched.add_request(req(rid, prompts[rid], max_tokens=6, sched=sched))
        got: dict[str, list[int]] = {}
        while sched.has_unfinished_requests():
            _check_cpu_copies(sched, sim, tokens)
            for rid, toks in step(sched, sim).items():
                got.setdefault(rid, []).extend(toks)
            check_invariants(sched, sim)
        assert got == {rid: ref[rid] for rid in got}
    stats = sched.kv.offload_stats
    assert stats["offloaded_blocks"] > 0 and stats["loaded_blocks"] > 0
    # (A hit's tokens owed to the CPU tier may outnumber the blocks loaded: a device
    # block no hit could use alone becomes usable once a CPU block joins it.)
    assert stats["cpu_hit_tokens"] > 0
    assert_baseline(sched)
    assert sched.kv.reset_prefix_cache() > 0
    assert not sched.kv.pool.cached and not sched.kv.cpu_pool.cached


def test_a_hit_continues_on_the_cpu_in_every_group() -> None:
    """A prompt whose blocks were all evicted from the device comes back whole from the
    CPU tier: the full group loads its 8 blocks, each sliding group only the two its
    window needs; with a sliding group's window block gone from both tiers the hit
    stops before it."""
    prompt = [100 + j % 70 for j in range(33)]
    for drop, want, loads in [(None, 32, [8, 2, 2]), ((2, 6), 24, [6, 2, 2])]:
        sched, sim = make_scheduler(num_gpu_blocks=64, num_cpu_blocks=64,
                                    kv_group_windows=GROUPS, block_size=B,
                                    enable_kv_offload=True)
        sim = KVSim(64, 64, B, group_windows=GROUPS)
        sched.add_request(req("a", prompt, max_tokens=1, sched=sched))
        run_to_completion(sched, sim)
        kv = sched.kv
        kv.pool.evicted = [(b.block_id, b.block_hash) for b in kv.pool.blocks
                           if b.block_hash is not None]
        outs, _ = kv.end_step()  # every named block copied to the CPU tier
        plan = SchedulerOutput(step_id=-1, blocks_to_swap_out=outs)
        sim.execute(plan)
        kv.pool.reset_prefix_cache()  # and gone from the device
        if drop is not None:
            g, i = drop
            cpu = kv.cpu_pool
            cpu.free([cpu.take_cached(kv.group_managers[g].salted(_hashes(sched, prompt)[i]))])
        sched.add_request(req("b", [*prompt, 7], max_tokens=1, sched=sched))
        plan = sched.schedule()
        (sr,) = plan.scheduled
        assert sr.num_computed_tokens == want, drop
        per_group = [0] * 3
        for dev, _cpu in plan.blocks_to_swap_in:
            for g, table in enumerate([sr.block_table, *sr.group_block_tables]):
                per_group[g] += dev in table
        assert per_group == loads, drop
        sched.update_from_output(plan, sim.execute(plan))
        run_to_completion(sched, sim)
        assert_baseline(sched)
