"""KV offloading: the CPU tier as a second level of the prefix cache.

Exact block ids for the copy out (by the step that reuses a block) and the
load back; outputs through the KV simulator, whose tokens depend on every
slot read back, equal to runs without offloading; CPU content checked
against the tokens each cached hash names; pins keep a step from reusing
what it reads; swaps evict cached blocks, never the reverse.
"""

from __future__ import annotations

import random

import pytest

from pagedserve.scheduler.block_pool import NoFreeBlocksError
from pagedserve.scheduler.config import CacheConfig
from pagedserve.scheduler.cpu_block_pool import CpuBlockPool
from pagedserve.scheduler.kv_cache_manager import KVCacheManager
from pagedserve.scheduler.scheduler import Scheduler
from tests.scheduler.helpers import (
    assert_baseline,
    make_scheduler,
    req,
    run_to_completion,
    step,
)
from tests.scheduler.kv_sim import KVSim

B = 4


class Named:
    """Every full block's tokens by its hash, for requests seen so far."""

    def __init__(self) -> None:
        self.tokens: dict[bytes, list[int]] = {}

    def note(self, sched: Scheduler) -> None:
        for r in sched.requests.values():
            for i, h in enumerate(r.update_block_hashes(sched.block_size)):
                self.tokens[h] = r.all_token_ids[i * B:(i + 1) * B]

    def check_cpu(self, sched: Scheduler, sim: KVSim) -> None:
        for h, cpu_id in sched.kv.cpu_pool.cached.items():
            assert sim.cpu[cpu_id] == self.tokens[h], f"CPU block {cpu_id} holds other tokens"


def run_checked(sched: Scheduler, sim: KVSim, named: Named) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    for _ in range(10_000):
        if not sched.has_unfinished_requests():
            return outputs
        named.note(sched)
        for rid, toks in step(sched, sim).items():
            outputs.setdefault(rid, []).extend(toks)
        named.check_cpu(sched, sim)
    raise AssertionError("scheduler did not finish")


def test_the_step_that_reuses_an_evicted_block_copies_it_out_first() -> None:
    sched, sim = make_scheduler(num_gpu_blocks=4, num_cpu_blocks=8, enable_kv_offload=True)
    a = list(range(1, 10))  # blocks 0, 1 full (hashed), 2 partial
    sched.add_request(req("a", a, max_tokens=1, sched=sched))
    first = run_to_completion(sched, sim)["a"]
    pool = sched.kv.pool
    assert [b.block_id for b in pool.free_queue] == [3, 2, 1, 0]  # freed tail first
    sched.add_request(req("b", list(range(50, 63)), max_tokens=1, sched=sched))
    plan = sched.schedule()
    # b takes 3, 2 (no hash), then 1 and 0: their hashes go to CPU blocks 0 and 1.
    assert plan.scheduled[0].block_table == [3, 2, 1, 0]
    assert plan.blocks_to_swap_out == [(1, 0), (0, 1)]
    assert plan.blocks_to_swap_in == []
    sched.update_from_output(plan, sim.execute(plan))
    run_to_completion(sched, sim)
    assert sim.cpu[1] == a[0:4] and sim.cpu[0] == a[4:8]

    sched.add_request(req("a2", a, max_tokens=1, sched=sched))
    plan = sched.schedule()
    (row,) = plan.scheduled
    # Nothing of a is on the device any more; both full blocks load from the CPU.
    assert row.num_computed_tokens == 8 and row.token_ids == [9]
    assert plan.blocks_to_swap_in == [(row.block_table[0], 1), (row.block_table[1], 0)]
    out = sim.execute(plan)
    sched.update_from_output(plan, out)
    assert out.sampled["a2"].token_id == first[0]
    assert not sched.has_unfinished_requests()
    assert sched.kv.offload_stats == {"cpu_hit_tokens": 8, "offloaded_blocks": 4,
                                      "loaded_blocks": 2, "swap_copies_saved": 0}
    assert_baseline(sched)


def test_a_prefix_split_across_tiers_loads_only_what_the_device_lacks() -> None:
    kv = KVCacheManager(num_gpu_blocks=8, block_size=B, num_cpu_blocks=8,
                        enable_offload=True)
    r = req("r", list(range(1, 18)))  # four full blocks and one token
    hashes = r.update_block_hashes(B)
    for h in hashes[1:3]:
        kv.cpu_pool.store(h)
    kv.cpu_pool.release_pins()
    (dev,) = kv.pool.allocate(1)
    kv.pool.cache_full_block(dev, hashes[0])
    kv.pool.free([dev])
    hits, n = kv.get_computed_blocks(r)
    loads = kv.get_offloaded_blocks(r, len(hits))
    assert (n, [b.block_id for b in hits], loads) == (4, [dev.block_id], [0, 1])
    r.num_computed_tokens = n + len(loads) * B
    assert kv.allocate_slots(r, 17 - r.num_computed_tokens, hits, loads) == []
    table = kv.block_ids("r")
    assert table[0] == dev.block_id and len(table) == 5
    outs, swap_ins = kv.end_step()
    assert outs == [] and swap_ins == [(table[1], 0), (table[2], 1)]
    # Loaded blocks are named only after the step ran, as computed ones are.
    assert kv.pool.get_cached_block(hashes[1]) is None
    kv.cache_blocks(r)
    assert kv.pool.get_cached_block(hashes[1]).block_id == table[1]


def test_a_swap_out_takes_over_cached_cpu_copies_instead_of_copying() -> None:
    kv = KVCacheManager(num_gpu_blocks=8, block_size=B, num_cpu_blocks=8,
                        enable_offload=True)
    r = req("r", list(range(1, 10)))  # two full blocks and one token
    hashes = r.update_block_hashes(B)
    assert kv.cpu_pool.store(hashes[0]) == 0
    kv.cpu_pool.release_pins()
    hits, _ = kv.get_computed_blocks(r)
    loads = kv.get_offloaded_blocks(r, len(hits))
    r.num_computed_tokens = 4
    assert kv.allocate_slots(r, 5, hits, loads) == []
    d0, d1, d2 = kv.block_ids("r")
    assert kv.end_step() == ([], [(d0, 0)])
    r.num_computed_tokens = 9
    kv.cache_blocks(r)
    pairs = kv.swap_out(r)
    # Block 0's content is CPU block 0 already: only blocks 1 and 2 are copied.
    assert [d for d, _ in pairs] == [d1, d2]
    assert kv.swapped["r"].cpu_block_ids[0] == 0 and kv.cpu_pool.num_cached_blocks == 0
    assert kv.offload_stats["swap_copies_saved"] == 1
    back = kv.swap_in(r)  # both full blocks are still cached on the device
    assert [c for _, c in back] == [pairs[1][1]]  # only the partial one comes back
    kv.end_step()
    # The copies go back to the cache under their hashes; the partial one is free.
    assert kv.cpu_pool.lookup(hashes[0]) == 0
    assert kv.cpu_pool.lookup(hashes[1]) == pairs[0][1]
    assert kv.cpu_pool.num_owned_blocks == 0 and kv.cpu_pool.num_free_blocks == 6


def test_the_one_token_left_rule_holds_across_tiers() -> None:
    kv = KVCacheManager(num_gpu_blocks=8, block_size=B, num_cpu_blocks=8,
                        enable_offload=True)
    r = req("r", list(range(1, 9)))  # exactly two full blocks
    for h in r.update_block_hashes(B):
        kv.cpu_pool.store(h)
    kv.cpu_pool.release_pins()
    hits, _ = kv.get_computed_blocks(r)
    assert kv.get_offloaded_blocks(r, len(hits)) == [0]  # the last block is computed


def prompts_sharing_prefixes(seed: int, count: int) -> dict[str, list[int]]:
    """Conversations: each turn's prompt is an earlier prompt plus new tokens."""
    rng = random.Random(seed)
    out: dict[str, list[int]] = {}
    roots = [[rng.randrange(1, 900) for _ in range(rng.randint(9, 30))] for _ in range(5)]
    for i in range(count):
        base = rng.choice([p for p in roots + list(out.values()) if len(p) <= 40])
        out[f"r{i}"] = base + [rng.randrange(1, 900) for _ in range(rng.randint(1, 10))]
    return out


def reference(prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    sched, sim = make_scheduler(num_gpu_blocks=1024, enable_prefix_caching=False)
    for rid, p in prompts.items():
        sched.add_request(req(rid, p, max_tokens, sched=sched))
    return run_to_completion(sched, sim)


@pytest.mark.parametrize("mode,cpu_blocks,waves", [
    ("swap", 64, 3), ("swap", 12, 3), ("recompute", 48, 3), ("swap", 6, 1),
])
def test_outputs_equal_a_run_without_offloading(mode: str, cpu_blocks: int,
                                                waves: int) -> None:
    prompts = prompts_sharing_prefixes(seed=cpu_blocks, count=24)
    ref = reference(prompts, 6)
    sched, sim = make_scheduler(num_gpu_blocks=18, num_cpu_blocks=cpu_blocks,
                                preemption_mode=mode, max_num_batched_tokens=32,
                                enable_kv_offload=True)
    named = Named()
    ids = list(prompts)
    per_wave = -(-len(ids) // waves)
    for w in range(waves):  # later waves find earlier prefixes evicted to the CPU
        for rid in ids[w * per_wave:(w + 1) * per_wave]:
            sched.add_request(req(rid, prompts[rid], 6, sched=sched))
        got = run_checked(sched, sim, named)
        assert got == {rid: ref[rid] for rid in got}
    stats = sched.kv.offload_stats
    assert stats["offloaded_blocks"] > 0 and stats["loaded_blocks"] > 0
    assert stats["cpu_hit_tokens"] == B * stats["loaded_blocks"]
    if mode == "swap" and cpu_blocks >= 12:  # swaps that took cached copies over ran too
        assert stats["swap_copies_saved"] > 0
    assert_baseline(sched)
    dropped = sched.kv.reset_prefix_cache()
    assert dropped > 0 and sched.kv.cpu_pool.num_free_blocks == cpu_blocks
    assert not sched.kv.pool.cached and not sched.kv.cpu_pool.cached


def test_offloading_computes_fewer_tokens_than_device_caching_alone() -> None:
    prompts = prompts_sharing_prefixes(seed=7, count=24)
    computed = {}
    for offload in (False, True):
        sched, sim = make_scheduler(num_gpu_blocks=18, num_cpu_blocks=64,
                                    max_num_batched_tokens=32, enable_kv_offload=offload)
        total = 0
        for rid in prompts:  # one at a time: each turn after the pool moved on
            sched.add_request(req(rid, prompts[rid], 6, sched=sched))
            while sched.has_unfinished_requests():
                plan = sched.schedule()
                total += sum(len(s.token_ids) for s in plan.scheduled)
                sched.update_from_output(plan, sim.execute(plan))
        computed[offload] = total
    assert computed[True] < 0.8 * computed[False], computed


def test_a_swap_out_evicts_cached_cpu_blocks_least_recently_used_first() -> None:
    cpu = CpuBlockPool(4, enable_caching=True)
    hashes = [bytes([i]) * 32 for i in range(4)]
    assert [cpu.store(h) for h in hashes] == [0, 1, 2, 3]
    cpu.release_pins()
    cpu.touch([0])  # hash 0 is now the most recently used
    assert cpu.num_free_blocks == 0 and cpu.num_available_blocks == 4
    assert cpu.allocate(2) == [1, 2]  # a swapped request's: the two oldest go
    assert list(cpu.cached) == [hashes[3], hashes[0]]
    assert cpu.num_owned_blocks == 2 and cpu.lookup(hashes[1]) is None
    cpu.free([1, 2])
    assert cpu.num_free_blocks == 2 and cpu.num_cached_blocks == 2


def test_blocks_a_step_reads_or_writes_are_not_reused_in_it() -> None:
    cpu = CpuBlockPool(2, enable_caching=True)
    a = cpu.store(b"a" * 32)
    b = cpu.store(b"b" * 32)
    assert (a, b) == (0, 1)
    assert cpu.store(b"c" * 32) is None  # both pinned: written by this step
    with pytest.raises(NoFreeBlocksError):
        cpu.allocate(1)
    cpu.release_pins()
    owned = cpu.allocate(1)  # takes the least recently used: a's
    assert owned == [0] and cpu.lookup(b"a" * 32) is None
    cpu.pin(owned)  # a swap-in reads it this step
    cpu.free(owned)
    assert cpu.num_free_blocks == 0 and cpu.num_available_blocks == 1
    cpu.release_pins()
    assert cpu.num_free_blocks == 1


def test_a_swapped_request_leaves_its_full_blocks_cached_on_the_cpu() -> None:
    sched, sim = make_scheduler(num_gpu_blocks=8, num_cpu_blocks=16, max_num_batched_tokens=8,
                                enable_kv_offload=True)
    sched.add_request(req("keep", list(range(1, 9)), max_tokens=20, sched=sched))
    sched.add_request(req("x", list(range(100, 111)), max_tokens=20, sched=sched))
    for _ in range(40):
        step(sched, sim)
        if any(r.request_id == "x" for r in sched.swapped):
            break
    (x,) = [r for r in sched.swapped if r.request_id == "x"]
    full = x.num_computed_tokens // B
    sched.abort("x")
    cpu = sched.kv.cpu_pool
    assert cpu.num_owned_blocks == 0 and cpu.num_cached_blocks >= full
    for h in x.update_block_hashes(B)[:full]:
        assert cpu.lookup(h) is not None
    run_to_completion(sched, sim)
    assert_baseline(sched)


def test_offloading_needs_prefix_caching_and_cpu_blocks() -> None:
    with pytest.raises(ValueError, match="kv_offloading"):
        CacheConfig(num_gpu_blocks=8, num_cpu_blocks=0, enable_kv_offload=True)
    with pytest.raises(ValueError, match="kv_offloading"):
        CacheConfig(num_gpu_blocks=8, num_cpu_blocks=8, enable_prefix_caching=False,
                    enable_kv_offload=True)
    with pytest.raises(ValueError, match="kv_offloading"):
        KVCacheManager(8, B, num_cpu_blocks=0, enable_offload=True)


def test_a_sliding_window_loads_only_the_blocks_its_next_query_sees() -> None:
    """A window admits a prompt longer than the whole pool; its prefix, evicted to the
    CPU, must come back only as far as the next query sees (the rest ``RELEASED``,
    never loaded). Loading every block asked more fresh device blocks than the pool
    has: the request was never admitted and the queue stalled (found by the
    pipelined state machine: six blocks, a window of six tokens, a 25-token prompt)."""
    sched, sim = make_scheduler(num_gpu_blocks=6, num_cpu_blocks=12, enable_kv_offload=True,
                                sliding_window=6, max_num_batched_tokens=4)
    long = [100 + (13 * j) % 80 for j in range(25)]
    sched.add_request(req("a", long, max_tokens=2, sched=sched))
    first = run_to_completion(sched, sim)["a"]
    sched.add_request(req("b", list(range(300, 324)), max_tokens=1, sched=sched))
    run_to_completion(sched, sim)  # b's blocks push a's full blocks out to the CPU
    sched.add_request(req("a2", long, max_tokens=2, sched=sched))
    r = sched.requests["a2"]
    _, num_hit = sched.kv.get_computed_blocks(r)
    loads = sched.kv.get_offloaded_blocks(r, num_hit // B)
    assert num_hit // B + len(loads) == 6  # the hit alone is as long as the pool
    plan = sched.schedule()
    (row,) = plan.scheduled
    assert row.num_computed_tokens == 24 and row.token_ids == [long[-1]]
    assert 0 < len(plan.blocks_to_swap_in) <= 2  # only what the window sees
    assert row.block_table[:4] == [-1] * 4
    sched.update_from_output(plan, sim.execute(plan))
    assert run_to_completion(sched, sim).get("a2", []) == first[1:]
    assert_baseline(sched)
