"""Blocks for another replica's KV (disaggregated prefill): what this pool already
caches, fresh blocks for the rest, and, with KV offloading, the copies that keep
what those fresh blocks held.

A decode replica names the shipped blocks by their prefix hashes, so a later request
with that prompt hits them as if it had computed them. The write happens beside the
step loop (``cluster.kv_transfer``), so nothing is named before its content has
landed. Taking fresh blocks evicts cached prefixes like any allocation; with
offloading those go to the CPU tier first, as a step's evictions do
(``KVCacheManager.end_step``), by a copy the caller runs between two steps, before it
writes the shipped KV over them (``offload_plan``, then ``commit_offloads``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.scheduler.block_hash import BlockHash
from pagedserve.scheduler.block_pool import BlockPool, KVCacheBlock
from pagedserve.scheduler.cpu_block_pool import CpuBlockPool
from pagedserve.scheduler.outputs import SchedulerOutput


@dataclass(slots=True)
class ImportReservation:
    """Blocks held while another replica's KV is written into them.

    ``indices[i]`` is the position in the shipped hash list whose content goes
    to ``blocks[i]``; ``held`` are blocks this pool already had under the
    shipped hashes, pinned so that taking fresh blocks cannot evict them.
    ``offloads`` are ``(device block, CPU block)`` copies of the cached prefixes
    that taking ``blocks`` evicted, under ``offload_hashes``; the CPU blocks are
    owned by the reservation until ``commit_offloads`` names them.
    """

    hashes: list[BlockHash]
    indices: list[int]
    blocks: list[KVCacheBlock]
    held: list[KVCacheBlock]
    offloads: list[tuple[int, int]] = field(default_factory=list)
    offload_hashes: list[BlockHash] = field(default_factory=list)

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    def offload_plan(self) -> SchedulerOutput | None:
        """A plan of just the offload copies (the worker applies swap-outs and runs no
        forward), to run between steps and before the shipped KV is written; None if
        there is nothing to keep."""
        if not self.offloads:
            return None
        return SchedulerOutput(step_id=-1, blocks_to_swap_out=list(self.offloads))


class KVImportMixin:
    """``KVCacheManager``'s side of KV transfer between replicas."""

    pool: BlockPool
    block_size: int
    cpu_pool: CpuBlockPool
    offload_enabled: bool
    offload_stats: dict[str, int]

    def shippable_prefix(self, hashes: list[BlockHash], num_tokens: int
                         ) -> tuple[list[int], list[BlockHash]]:
        """Device ids of what a prefill replica ships for a prompt of ``num_tokens``
        tokens with these block hashes, and the hashes that name them on the other side:
        the longest leading run cached here (``num_tokens`` matters to a hybrid cache)."""
        ids = self.cached_prefix(hashes)
        return ids, list(hashes[:len(ids)])

    def prefix_hit_tokens(self, hashes: list[BlockHash], num_tokens: int) -> int:
        """Tokens of a prompt of ``num_tokens`` tokens whose K/V this pool holds (what
        a decode replica need not fetch)."""
        return len(self.cached_prefix(hashes)) * self.block_size

    def cached_prefix(self, hashes: list[BlockHash]) -> list[int]:
        """Device ids of the longest leading run of ``hashes`` cached here: what a
        prefill replica ships (a hit must start at the first block to be of use)."""
        ids: list[int] = []
        for h in hashes:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            ids.append(block.block_id)
        return ids

    def reserve_import(self, hashes: list[BlockHash]) -> ImportReservation:
        """Fresh blocks for the shipped hashes this pool lacks, from the first on.

        Hashes cached here already are pinned and skipped. When the free blocks run
        out, the rest is left out (a later hit would need every block before it), so
        the request recomputes that part. Nothing is named until ``commit_import``,
        so no lookup can find a block whose content has not arrived yet.
        """
        if not self.pool.enable_caching:
            return ImportReservation(list(hashes), [], [], [])
        held, missing = self.cached_and_missing(hashes, one_chain=True)
        self.pool.touch(held)
        room = self.pool.num_free_blocks
        if len(missing) > room:
            missing = missing[:room]
        fresh = self.pool.allocate(len(missing))
        return self.keep_evicted(ImportReservation(list(hashes), missing, fresh, held))

    def keep_evicted(self, res: ImportReservation) -> ImportReservation:
        """Give ``res`` the copies of what its fresh blocks held to the CPU tier (with
        offloading), in blocks the reservation owns: no plan reads or reuses them until
        they are named."""
        for block_id, block_hash in self.pool.evicted:
            if self.cpu_pool.lookup(block_hash) is not None:
                continue
            if self.cpu_pool.num_available_blocks == 0:
                break
            res.offloads.append((block_id, self.cpu_pool.allocate(1)[0]))
            res.offload_hashes.append(block_hash)
        self.pool.evicted.clear()
        return res

    def cached_and_missing(self, hashes: list[BlockHash], one_chain: bool
                           ) -> tuple[list[KVCacheBlock], list[int]]:
        """The blocks cached here under ``hashes`` and the positions of those that are
        not. In ``one_chain`` (one prefix chain) a cached block after a missing one is
        of no use (a hit needs every block before it): the walk stops there."""
        held: list[KVCacheBlock] = []
        missing: list[int] = []
        for i, h in enumerate(hashes):
            block = self.pool.get_cached_block(h)
            if block is None:
                missing.append(i)
            elif missing and one_chain:
                break
            else:
                held.append(block)
        return held, missing

    def commit_offloads(self, res: ImportReservation, copied: bool) -> int:
        """Name the CPU copies of the evicted prefixes (if ``copied``; else free them);
        returns how many joined the CPU tier."""
        cpu_ids = [c for _, c in res.offloads]
        before = self.cpu_pool.num_cached_blocks
        self.cpu_pool.free(cpu_ids, res.offload_hashes if copied else None)
        res.offloads, res.offload_hashes = [], []
        named = self.cpu_pool.num_cached_blocks - before
        self.offload_stats["offloaded_blocks"] += named
        return named

    def commit_import(self, res: ImportReservation, written: bool) -> int:
        """Name the written blocks by their hashes (if ``written``) and release every
        block of the reservation to the free queue, tail first, where the next
        request with this prefix finds them. Returns how many blocks were named.
        Offload copies never committed are freed unnamed."""
        if res.offloads:
            self.commit_offloads(res, copied=False)
        named = 0
        if written:
            for i, block in zip(res.indices, res.blocks, strict=True):
                named += self.pool.cache_full_block(block, res.hashes[i])
        self.pool.free(reversed(res.held + res.blocks))
        res.blocks, res.held, res.indices = [], [], []
        return named
