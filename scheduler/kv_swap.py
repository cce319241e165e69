"""Swapping a request's blocks to the CPU tier and back (``KVCacheManager``'s side).

A swapped-out request keeps its table's shape on the CPU: entries released behind a
sliding window stay released (CPU id -1), and full blocks still cached on the device
when it comes back are reused instead of copied. With KV offloading a full block the
CPU cache already holds is taken over rather than copied.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.scheduler.block_hash import BlockHash
from pagedserve.scheduler.block_pool import BlockPool, KVCacheBlock
from pagedserve.scheduler.cpu_block_pool import CpuBlockPool
from pagedserve.scheduler.request import Request

# A table entry whose block went back to the pool behind a sliding window: its id reads
# -1, which the kernels never reach (the window starts after it), and no pool
# operation, swap or hash ever sees it.
RELEASED = KVCacheBlock(-1)


@dataclass(slots=True)
class SwappedBlocks:
    """Where a swapped-out request's KV lives: CPU ids plus the hashes they held."""

    cpu_block_ids: list[int]
    hashes: list[BlockHash | None]


class KVSwapMixin:
    """``KVCacheManager``'s swap-out and swap-in."""

    block_size: int
    pool: BlockPool
    cpu_pool: CpuBlockPool
    req_blocks: dict[str, list[KVCacheBlock]]
    req_block_ids: dict[str, list[int]]
    _snapshots: dict[str, list[int]]
    swapped: dict[str, SwappedBlocks]
    offload_stats: dict[str, int]

    def can_swap_out(self, request: Request) -> bool:
        n = sum(1 for b in self.req_blocks.get(request.request_id, ()) if b is not RELEASED)
        return n <= self.cpu_pool.num_available_blocks

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Copy a request's blocks to the CPU tier and release them on the device.

        The device blocks keep their hashes in the LRU queue, so the prefix
        can still be hit (and swap-in can skip copying it back) until evicted.
        A full block the CPU cache already holds (offloading) is not copied: the
        request takes that CPU block over, and gives it back to the cache when it
        is swapped in or ends. Entries released behind a sliding window stay released
        (CPU id -1).
        """
        blocks = self.req_blocks.pop(request.request_id)
        del self.req_block_ids[request.request_id]
        self._snapshots.pop(request.request_id, None)
        request.num_hashed_blocks = 0
        live = [b for b in blocks if b is not RELEASED]
        taken = [self.cpu_pool.take_cached(b.block_hash) if b.block_hash is not None
                 else None for b in live]
        fresh = iter(self.cpu_pool.allocate(taken.count(None)))
        live_ids = [c if c is not None else next(fresh) for c in taken]
        placed = iter(live_ids)
        cpu_ids = [-1 if b is RELEASED else next(placed) for b in blocks]
        self.swapped[request.request_id] = SwappedBlocks(cpu_ids, [b.block_hash for b in blocks])
        pairs = [(b.block_id, c) for b, c, t in zip(live, live_ids, taken) if t is None]
        self.pool.free(reversed(live))
        self.offload_stats["swap_copies_saved"] += len(live) - len(pairs)
        return pairs

    def _swap_in_hits(self, sw: SwappedBlocks) -> list[KVCacheBlock | None]:
        """Per entry: RELEASED where released, the device block still cached under
        its hash, or None (it must be copied back)."""
        return [RELEASED if c < 0 else None if h is None else self.pool.get_cached_block(h)
                for c, h in zip(sw.cpu_block_ids, sw.hashes)]

    def num_blocks_to_swap_in(self, request: Request) -> int:
        """Free device blocks a swap-in consumes: fresh copies plus revived cache hits."""
        hits = self._swap_in_hits(self.swapped[request.request_id])
        return sum(1 for b in hits if b is None or (b is not RELEASED and b.ref_cnt == 0))

    def swap_in_cost(self, request: Request, num_new_tokens: int) -> int:
        """Free device blocks bringing ``request`` back and then running ``num_new_tokens``
        of it take: the swap-in's, plus the blocks its step adds past its table."""
        sw = self.swapped[request.request_id]
        after = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)
        return self.num_blocks_to_swap_in(request) + max(0, after - len(sw.cpu_block_ids))

    def swap_in(self, request: Request) -> list[tuple[int, int]] | None:
        """Bring a swapped request back; full blocks still cached on the device are
        reused instead of copied. Returns ``(device, cpu)`` pairs or ``None``."""
        sw = self.swapped[request.request_id]
        hits = self._swap_in_hits(sw)
        revived = sum(1 for b in hits if b is not None and b is not RELEASED and b.ref_cnt == 0)
        need = sum(1 for b in hits if b is None)
        if need + revived > self.pool.num_free_blocks:
            return None
        self.pool.touch([b for b in hits if b is not None and b is not RELEASED])
        fresh = iter(self.pool.allocate(need))
        blocks: list[KVCacheBlock] = []
        pairs: list[tuple[int, int]] = []
        for hit, cpu_id in zip(hits, sw.cpu_block_ids):
            if hit is not None:
                blocks.append(hit)
            else:
                b = next(fresh)
                blocks.append(b)
                pairs.append((b.block_id, cpu_id))
        del self.swapped[request.request_id]
        cpu_ids, hashes = held_on_cpu(sw)
        self.cpu_pool.pin(cpu_ids)  # read by this step: not reused in it
        self.cpu_pool.free(cpu_ids, hashes)
        self.req_blocks[request.request_id] = blocks
        self.req_block_ids[request.request_id] = [b.block_id for b in blocks]
        self._snapshots.pop(request.request_id, None)
        return pairs


def held_on_cpu(sw: SwappedBlocks) -> tuple[list[int], list[BlockHash | None]]:
    """A swapped request's CPU block ids and their hashes, released entries left out."""
    kept = [i for i, c in enumerate(sw.cpu_block_ids) if c >= 0]
    return [sw.cpu_block_ids[i] for i in kept], [sw.hashes[i] for i in kept]
