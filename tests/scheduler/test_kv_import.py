"""Blocks taken for another replica's KV: what is reserved, named, skipped and freed."""

from __future__ import annotations

from pagedserve.scheduler.block_hash import hash_prompt_blocks
from pagedserve.scheduler.hybrid_kv import HybridKVCacheManager
from pagedserve.scheduler.kv_cache_manager import RELEASED, KVCacheManager
from pagedserve.scheduler.kv_import import ImportReservation
from tests.scheduler.helpers import req

B = 4


def hashes(n_blocks: int, start: int = 0) -> list[bytes]:
    ids = list(range(start, start + n_blocks * B))
    return hash_prompt_blocks(ids, B, ("test-model",))


def at_baseline(kv: KVCacheManager) -> bool:
    pool = kv.pool
    return (pool.num_free_blocks == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)
            and all(b.block_hash == h for h, b in pool.cached.items()))


def test_import_names_blocks_only_after_commit_and_a_request_then_hits_them() -> None:
    kv = KVCacheManager(16, B)
    hs = hashes(3)
    res = kv.reserve_import(hs)
    assert res.indices == [0, 1, 2] and len(res.block_ids) == 3
    assert all(b.ref_cnt == 1 for b in res.blocks) and not kv.pool.cached  # nothing named yet
    assert kv.pool.num_free_blocks == 13
    assert kv.commit_import(res, written=True) == 3
    assert at_baseline(kv) and len(kv.pool.cached) == 3
    r = req("r", list(range(3 * B + 2)))  # the same tokens and model: the same hashes
    hits, n = kv.get_computed_blocks(r)
    assert n == 3 * B and [b.block_id for b in hits] == kv.cached_prefix(hs)


def test_failed_write_names_nothing_and_frees_everything() -> None:
    kv = KVCacheManager(8, B)
    res = kv.reserve_import(hashes(2))
    assert kv.commit_import(res, written=False) == 0
    assert at_baseline(kv) and not kv.pool.cached


def test_cached_hashes_are_pinned_and_skipped_and_a_gap_ends_the_run() -> None:
    kv = KVCacheManager(8, B)
    hs = hashes(4)
    first = kv.reserve_import(hs[:1])
    kv.commit_import(first, written=True)
    # hs[0] is here, hs[1] is not: import 1..3; the cached block is pinned meanwhile, so
    # taking the fresh blocks (from the free queue's head) cannot evict it.
    res = kv.reserve_import(hs)
    assert res.indices == [1, 2, 3]
    assert [b.block_hash for b in res.held] == [hs[0]] and res.held[0].ref_cnt == 1
    kv.commit_import(res, written=True)
    assert kv.cached_prefix(hs) and len(kv.cached_prefix(hs)) == 4 and at_baseline(kv)
    # A block cached after a missing one is useless on its own: not pinned.
    kv2 = KVCacheManager(8, B)
    only_last = kv2.reserve_import(hs)
    kv2.commit_import(only_last, written=True)
    assert len(kv2.cached_prefix(hs)) == 4


def test_a_short_pool_imports_the_leading_blocks_only() -> None:
    kv = KVCacheManager(5, B)
    running = req("busy", list(range(100, 100 + 3 * B)))
    assert kv.allocate_slots(running, 3 * B) == []
    hs = hashes(4)
    res = kv.reserve_import(hs)
    assert res.indices == [0, 1]  # two free blocks: the first two blocks, not any two
    kv.commit_import(res, written=True)
    assert len(kv.cached_prefix(hs)) == 2
    kv.free(running)
    assert at_baseline(kv)


def test_a_hash_computed_here_meanwhile_keeps_its_own_block() -> None:
    kv = KVCacheManager(8, B)
    hs = hashes(1)
    res = kv.reserve_import(hs)
    other = kv.reserve_import(hs)  # a second import of the same prefix races the first
    winner = other.block_ids
    kv.commit_import(other, written=True)
    assert kv.commit_import(res, written=True) == 0
    assert kv.cached_prefix(hs) == winner
    assert len(kv.pool.cached) == 1 and at_baseline(kv)


def test_without_prefix_caching_nothing_is_taken() -> None:
    kv = KVCacheManager(8, B, enable_caching=False)
    res = kv.reserve_import(hashes(2))
    assert res.blocks == [] and kv.commit_import(res, written=True) == 0
    assert at_baseline(kv)


def _cached_then_imported(kv: KVCacheManager) -> tuple[list[bytes], ImportReservation]:
    """Four blocks of one prefix cached (free) on a 4-block pool, then an import of
    three other blocks that must evict three of them."""
    old = hashes(4, start=1000)
    first = kv.reserve_import(old)
    kv.commit_import(first, written=True)
    assert len(kv.cached_prefix(old)) == 4 and kv.pool.num_free_blocks == 4
    return old, kv.reserve_import(hashes(3))


def test_with_offloading_the_prefixes_an_import_evicts_go_to_the_cpu_tier() -> None:
    kv = KVCacheManager(4, B, num_cpu_blocks=8, enable_offload=True)
    old, res = _cached_then_imported(kv)
    assert len(res.blocks) == 3
    # The evicted blocks' contents are copied out of the very blocks the import
    # writes, into CPU blocks the reservation owns; nothing is named before the copy.
    assert sorted(d for d, _ in res.offloads) == sorted(res.block_ids)
    assert set(res.offload_hashes) < set(old) and len(res.offload_hashes) == 3
    assert not kv.cpu_pool.cached and kv.cpu_pool.num_owned_blocks == 3
    plan = res.offload_plan()
    assert plan is not None and plan.blocks_to_swap_out == res.offloads and not plan.scheduled
    evicted = list(res.offload_hashes)
    assert kv.commit_offloads(res, copied=True) == 3
    assert set(kv.cpu_pool.cached) == set(evicted)
    assert kv.offload_stats["offloaded_blocks"] == 3 and kv.cpu_pool.num_owned_blocks == 0
    kv.commit_import(res, written=True)
    # A request for the old prefix now finds one block on the device and the rest on
    # the CPU tier (the leading run, from where the device's hits stop).
    r = req("again", [*range(1000, 1000 + 4 * B), 7])
    hits, _ = kv.get_computed_blocks(r)
    assert len(hits) + len(kv.get_offloaded_blocks(r, len(hits))) == 4
    assert at_baseline(kv)


def test_offload_copies_that_never_ran_are_freed_unnamed() -> None:
    for copied_then_failed in (False, True):
        kv = KVCacheManager(4, B, num_cpu_blocks=8, enable_offload=True)
        _, res = _cached_then_imported(kv)
        if copied_then_failed:
            kv.commit_offloads(res, copied=False)
        kv.commit_import(res, written=False)  # (without commit_offloads: the same)
        assert not kv.cpu_pool.cached and kv.cpu_pool.num_free_blocks == 8
        assert kv.offload_stats["offloaded_blocks"] == 0 and at_baseline(kv)


def test_without_offloading_an_import_evicts_and_copies_nothing() -> None:
    kv = KVCacheManager(4, B, num_cpu_blocks=8)
    _, res = _cached_then_imported(kv)
    assert res.offloads == [] and res.offload_plan() is None
    kv.commit_import(res, written=True)
    assert at_baseline(kv)


def _hybrid_prefilled(windows, prompt: list[int], num_blocks: int = 64):
    """A hybrid manager that has run ``prompt`` (every group's blocks named), freed."""
    kv = HybridKVCacheManager(num_blocks, B, windows)
    r = req("p", prompt)
    hits, _ = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, len(prompt), hits) is not None
    r.num_computed_tokens = len(prompt)
    kv.cache_blocks(r)
    kv.free(r)
    return kv


def test_a_hybrid_cache_ships_each_groups_hit_and_the_other_side_hits_it() -> None:
    # One full group and two sliding ones (window 6 tokens of blocks of 4): a 31-token
    # prompt hits 7 blocks, so full groups ship blocks 0..6, sliding ones 5..6 (the
    # 7th block's first query, token 28, sees tokens 23..28).
    windows = (None, 6, 6)
    prompt = list(range(500, 531))
    src = _hybrid_prefilled(windows, prompt)
    r = req("q", prompt)
    hs = r.update_block_hashes(B)
    ids, names = src.shippable_prefix(hs, len(prompt))
    assert len(ids) == len(names) == 7 + 2 + 2 and len(set(names)) == len(names)
    assert src.prefix_hit_tokens(hs, len(prompt)) == 7 * B

    dst = HybridKVCacheManager(64, B, windows)
    assert dst.prefix_hit_tokens(hs, len(prompt)) == 0
    res = dst.reserve_import(names)
    assert len(res.blocks) == 11 and not dst.pool.cached
    assert dst.commit_import(res, written=True) == 11
    hits, n = dst.get_computed_blocks(req("q2", prompt))
    assert n == 7 * B and dst.prefix_hit_tokens(hs, len(prompt)) == 7 * B
    assert [len([b for b in g if b is not RELEASED]) for g in hits] == [7, 2, 2]
    assert dst.pool.num_free_blocks == 64  # every block back in the free queue, named

    # A failed write names nothing; a pool too small for every group takes none.
    res = HybridKVCacheManager(64, B, windows).reserve_import(names)
    small = HybridKVCacheManager(10, B, windows)
    none = small.reserve_import(names)
    assert none.blocks == [] and none.held == [] and small.pool.num_free_blocks == 10
    assert small.commit_import(none, written=True) == 0
    assert res.blocks and not res.held


def test_a_hybrid_import_pins_what_it_has_and_takes_the_rest() -> None:
    windows = (None, 6)
    prompt = list(range(700, 725))  # 24 full tokens + 1: a hit of 6 blocks
    names = _hybrid_prefilled(windows, prompt).shippable_prefix(
        req("x", prompt).update_block_hashes(B), len(prompt))[1]
    half = _hybrid_prefilled(windows, prompt[:13])  # the first 3 blocks of each group
    before = len(half.pool.cached)
    res = half.reserve_import(names)
    assert len(res.held) == 3 and len(res.blocks) == len(names) - 3  # full group's 0..2
    assert all(b.ref_cnt == 1 for b in res.held)
    half.commit_import(res, written=True)
    assert len(half.pool.cached) == before + len(names) - 3
    assert half.get_computed_blocks(req("y", prompt))[1] == 6 * B
    assert all(b.ref_cnt == 0 for b in half.pool.blocks)
