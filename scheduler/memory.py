"""Memory accounting in the terms of seed 004.

``M_KV = 2 * L * n * h_kv * d_h * b`` bytes for ``n`` cached tokens; a request
of ``n`` tokens holds ``A_B(n) = B * ceil(n / B)`` slots and wastes
``W_B(n) = A_B(n) - n``; utilisation ``U = sum n_i / sum A_B(n_i)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from pagedserve.scheduler.kv_cache_manager import RELEASED

if TYPE_CHECKING:
    from pagedserve.scheduler.scheduler import Scheduler

BLOCK_TABLE_ENTRY_BYTES = 4  # int32 block ids, as the kernels take them


def kv_bytes(
    num_tokens: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int
) -> int:
    """``2 * L * n * h_kv * d_h * b``: keys and values of ``n`` tokens."""
    return 2 * num_layers * num_tokens * num_kv_heads * head_dim * dtype_bytes


def allocated_slots(n: int, block_size: int) -> int:
    """``A_B(n)``: slots a paged request of ``n`` tokens holds."""
    return block_size * (-(-n // block_size))


def wasted_slots(n: int, block_size: int) -> int:
    """``W_B(n)``: the unused tail of the last block."""
    return allocated_slots(n, block_size) - n


def utilisation(lengths: Sequence[int], block_size: int) -> float:
    """``U``: tokens stored over slots held, for paged allocation with block ``B``."""
    return sum(lengths) / sum(allocated_slots(n, block_size) for n in lengths)


def reservation_utilisation(lengths: Sequence[int], reserved: int) -> float:
    """Utilisation of a contiguous per-request reservation of ``reserved`` slots."""
    return sum(lengths) / (reserved * len(lengths))


@dataclass(slots=True)
class MemoryStats:
    """A snapshot of one replica's KV memory, in blocks and slots."""

    block_size: int
    num_gpu_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    num_cached_free_blocks: int
    num_shared_blocks: int
    num_cpu_blocks: int
    num_swapped_blocks: int
    num_cpu_cached_blocks: int
    kv_tokens: int
    allocated_slots: int
    fragmentation_slots: int
    utilisation: float
    block_table_bytes: int
    prefix_hit_rate: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def memory_stats(scheduler: Scheduler) -> MemoryStats:
    """Count, not estimate: walks the live block tables of the scheduler."""
    kv = scheduler.kv
    pool = kv.pool
    tokens = 0
    table_entries = 0
    for group in kv.group_managers:
        for rid, blocks in group.req_blocks.items():
            req = scheduler.requests.get(rid)
            table_entries += len(blocks)
            if req is not None:  # (tokens behind a sliding window no longer hold blocks)
                released = sum(1 for b in blocks if b is RELEASED)
                tokens += min(req.num_computed_tokens, len(blocks) * kv.block_size) - (
                    released * kv.block_size)
    used = [b for b in pool.blocks if b.ref_cnt > 0]
    slots = len(used) * kv.block_size
    return MemoryStats(
        block_size=kv.block_size,
        num_gpu_blocks=pool.num_blocks,
        num_free_blocks=pool.num_free_blocks,
        num_used_blocks=len(used),
        num_cached_free_blocks=sum(1 for b in pool.free_queue if b.block_hash is not None),
        num_shared_blocks=sum(1 for b in used if b.ref_cnt > 1),
        num_cpu_blocks=kv.cpu_pool.num_blocks,
        num_swapped_blocks=kv.cpu_pool.num_owned_blocks,
        num_cpu_cached_blocks=kv.cpu_pool.num_cached_blocks,
        kv_tokens=tokens,
        allocated_slots=slots,
        fragmentation_slots=max(0, slots - tokens),
        utilisation=tokens / slots if slots else 1.0,
        block_table_bytes=table_entries * BLOCK_TABLE_ENTRY_BYTES,
        prefix_hit_rate=kv.prefix_hits / kv.prefix_queries if kv.prefix_queries else 0.0,
    )
