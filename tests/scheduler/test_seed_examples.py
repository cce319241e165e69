"""The worked examples of seeds 000 and 004, as exact values."""

from pagedserve.scheduler.kv_cache_manager import cdiv
from pagedserve.scheduler.memory import (
    allocated_slots,
    kv_bytes,
    reservation_utilisation,
    utilisation,
    wasted_slots,
)

SEED_004_LENGTHS = [37, 91, 128, 201, 511]


def test_seed_004_lengths_use_968_slots() -> None:
    assert sum(SEED_004_LENGTHS) == 968


def test_seed_004_fixed_reservation_vs_paged_allocation() -> None:
    assert 512 * len(SEED_004_LENGTHS) == 2560
    assert sum(allocated_slots(n, 16) for n in SEED_004_LENGTHS) == 992
    assert sum(allocated_slots(n, 32) for n in SEED_004_LENGTHS) == 1024
    assert round(100 * reservation_utilisation(SEED_004_LENGTHS, 512), 2) == 37.81
    assert round(100 * utilisation(SEED_004_LENGTHS, 16), 2) == 97.58
    assert round(100 * utilisation(SEED_004_LENGTHS, 32), 2) == 94.53


def test_seed_004_waste_is_only_in_the_last_block() -> None:
    assert [wasted_slots(n, 16) for n in SEED_004_LENGTHS] == [11, 5, 0, 7, 1]
    assert all(wasted_slots(n, 16) < 16 for n in range(1, 2000))


def test_seed_004_kv_bytes_formula_for_smollm2() -> None:
    # 30 layers, 3 KV heads, head_dim 64, fp16: 23,040 bytes per token.
    assert kv_bytes(1, 30, 3, 64, 2) == 23_040
    assert kv_bytes(1000, 30, 3, 64, 2) == 23_040_000


def test_seed_000_decode_block_table_which_sequences_need_a_new_block() -> None:
    """Cache lengths [30, 32, 70], block 32: the next token of sequence 1 opens a block."""
    cache_seqlens, block_size = [30, 32, 70], 32
    block_table = [[2, -1, -1, -1], [0, 1, -1, -1], [3, 5, 6, -1]]
    blocks_for_cache = [cdiv(n, block_size) for n in cache_seqlens]
    blocks_with_next = [cdiv(n + 1, block_size) for n in cache_seqlens]
    assert blocks_for_cache == [1, 1, 3]
    assert blocks_with_next == [1, 2, 3]
    needs_new = [b > a for a, b in zip(blocks_for_cache, blocks_with_next)]
    assert needs_new == [False, True, False]
    assert [sum(1 for b in row if b >= 0) for row in block_table] == blocks_with_next
    # The slot of the next token of each sequence, per the slot contract.
    slots = [
        row[n // block_size] * block_size + n % block_size
        for row, n in zip(block_table, cache_seqlens)
    ]
    assert slots == [2 * 32 + 30, 1 * 32 + 0, 6 * 32 + 6]
