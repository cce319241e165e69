"""Exact block ids, refcounts, free-queue order and eviction order."""

import pytest

from pagedserve.scheduler.block_hash import hash_prompt_blocks, make_extra_keys
from pagedserve.scheduler.block_pool import BlockPool, NoFreeBlocksError
from pagedserve.scheduler.cpu_block_pool import CpuBlockPool
from pagedserve.scheduler.kv_cache_manager import KVCacheManager
from tests.scheduler.helpers import req


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


def test_allocate_pops_from_head_and_free_appends_to_tail() -> None:
    pool = BlockPool(6)
    a = pool.allocate(2)
    assert [b.block_id for b in a] == [0, 1]
    assert [b.ref_cnt for b in a] == [1, 1]
    assert free_ids(pool) == [2, 3, 4, 5]
    pool.free(reversed(a))
    assert free_ids(pool) == [2, 3, 4, 5, 1, 0]


def test_failed_allocation_leaves_pool_untouched() -> None:
    pool = BlockPool(3)
    pool.allocate(2)
    before = free_ids(pool)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    assert free_ids(pool) == before and pool.num_free_blocks == 1


def test_touch_removes_a_cached_block_from_the_middle_of_the_free_queue() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    pool.cache_full_block(blocks[2], b"h2")
    pool.free(blocks)
    assert free_ids(pool) == [0, 1, 2, 3]
    hit = pool.get_cached_block(b"h2")
    assert hit is blocks[2]
    pool.touch([hit])
    assert free_ids(pool) == [0, 1, 3] and hit.ref_cnt == 1


def test_eviction_is_lazy_and_lru() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_full_block(a, b"A")
    pool.cache_full_block(b, b"B")
    pool.free([b, a])  # b freed first -> least recently used
    assert set(pool.cached) == {b"A", b"B"}
    (x,) = pool.allocate(1)
    assert x is b and x.block_hash is None and set(pool.cached) == {b"A"}


def test_duplicate_hash_keeps_the_first_block() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    assert pool.cache_full_block(a, b"H")
    assert not pool.cache_full_block(b, b"H")
    assert pool.cached[b"H"] is a and b.block_hash is None


def test_double_free_is_an_error() -> None:
    pool = BlockPool(1)
    (a,) = pool.allocate(1)
    pool.free([a])
    with pytest.raises(RuntimeError):
        pool.free([a])
    cpu = CpuBlockPool(2)
    ids = cpu.allocate(2)
    assert ids == [0, 1]
    cpu.free(ids)
    with pytest.raises(RuntimeError):
        cpu.free([0])


def test_shared_prefix_block_ids_and_refcounts() -> None:
    kv = KVCacheManager(num_gpu_blocks=10, block_size=4)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    r1 = req("r1", prompt)
    hits, n = kv.get_computed_blocks(r1)
    assert (hits, n) == ([], 0)
    assert kv.allocate_slots(r1, 10) == []
    assert kv.block_ids("r1") == [0, 1, 2]
    r1.num_computed_tokens = 10
    kv.cache_blocks(r1)
    assert [b.block_hash is not None for b in kv.req_blocks["r1"]] == [True, True, False]

    r2 = req("r2", [*prompt[:8], 99, 98, 97])
    hits, n = kv.get_computed_blocks(r2)
    assert [b.block_id for b in hits] == [0, 1] and n == 8
    r2.num_computed_tokens = n
    assert kv.allocate_slots(r2, 3, hits) == []
    assert kv.block_ids("r2") == [0, 1, 3]
    assert [b.ref_cnt for b in kv.pool.blocks[:4]] == [2, 2, 1, 1]

    kv.free(r1)
    assert [b.ref_cnt for b in kv.pool.blocks[:4]] == [1, 1, 0, 1]
    assert free_ids(kv.pool) == [4, 5, 6, 7, 8, 9, 2]
    kv.free(r2)
    assert free_ids(kv.pool) == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]


def test_partial_blocks_are_never_hashed_and_one_token_is_always_computed() -> None:
    kv = KVCacheManager(num_gpu_blocks=8, block_size=4)
    r1 = req("r1", list(range(8)))
    kv.allocate_slots(r1, 8)
    r1.num_computed_tokens = 8
    kv.cache_blocks(r1)
    kv.free(r1)
    r2 = req("r2", list(range(8)))  # identical, exactly 2 full blocks
    hits, n = kv.get_computed_blocks(r2)
    assert [b.block_id for b in hits] == [0] and n == 4
    r3 = req("r3", list(range(6)))
    assert len(r3.update_block_hashes(4)) == 1


def test_failed_slot_allocation_with_prefix_hits_changes_nothing() -> None:
    kv = KVCacheManager(num_gpu_blocks=3, block_size=4)
    r1 = req("r1", list(range(8)))
    kv.allocate_slots(r1, 8)
    r1.num_computed_tokens = 8
    kv.cache_blocks(r1)
    kv.free(r1)
    r2 = req("r2", list(range(8)) + list(range(100, 110)))
    hits, n = kv.get_computed_blocks(r2)
    assert n == 8
    before = (free_ids(kv.pool), [b.ref_cnt for b in kv.pool.blocks], dict(kv.pool.cached))
    r2.num_computed_tokens = n
    assert kv.allocate_slots(r2, 10, hits) is None
    after = (free_ids(kv.pool), [b.ref_cnt for b in kv.pool.blocks], dict(kv.pool.cached))
    assert before == after and "r2" not in kv.req_blocks


def test_cache_salt_isolates_tenants() -> None:
    prompt = list(range(32))
    a = hash_prompt_blocks(prompt, 16, make_extra_keys("m", "tenant-a"))
    b = hash_prompt_blocks(prompt, 16, make_extra_keys("m", "tenant-b"))
    none = hash_prompt_blocks(prompt, 16, make_extra_keys("m"))
    other_model = hash_prompt_blocks(prompt, 16, make_extra_keys("m2"))
    assert len({a[0], b[0], none[0], other_model[0]}) == 4
    assert hash_prompt_blocks(prompt, 16, make_extra_keys("m", "tenant-a")) == a


def test_hash_is_chained_so_equal_blocks_after_different_prefixes_differ() -> None:
    x = hash_prompt_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4)
    y = hash_prompt_blocks([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert x[1] != y[1]
    assert len(x[0]) == 16
