"""One request, one block table per KV cache group: the hybrid model's manager.

Gemma 3 attends through a 512- or 1,024-token window in five layers of six. With
one table for every layer, each of those layers holds the whole context; here each
group of layers (``kv_groups``) has its own table, every group draws its blocks
from one shared pool, and a sliding group gives back what falls behind its window
(``KVCacheManager.release_behind_window``), so a long request costs the full
groups its length and each sliding group about its window.

Every step decision goes to every group and succeeds in all of them or in none:
the cost of an allocation or a swap-in is summed over the groups and checked
against the shared pool before any group changes. Each group's blocks are named in
the prefix cache under a salted hash, so groups never hit each other's blocks; a
prompt hits ``k`` blocks when every full group holds its first ``k`` and every
sliding group holds the blocks that the ``k``-th block's first query can see.

With KV offloading the CPU tier is a second level of every group's prefix cache (one
CPU pool, the same salted hashes): a hit may continue there, each group loading what
follows its device blocks, as long as every group can resume from the longer hit
(``get_offloaded_blocks``).

KV shipped from a prefill replica (``kv_import``) is the same hit: every full group's
first ``k`` blocks and each sliding group's window before block ``k``, named by their
salted hashes in one flat list, and taken whole or not at all (a hit needs every
group's part).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.scheduler.block_hash import BlockHash
from pagedserve.scheduler.block_pool import BlockPool, KVCacheBlock
from pagedserve.scheduler.cpu_block_pool import CpuBlockPool
from pagedserve.scheduler.kv_cache_manager import RELEASED, KVCacheManager, first_seen_block
from pagedserve.scheduler.kv_import import ImportReservation, KVImportMixin
from pagedserve.scheduler.request import Request


@dataclass(slots=True)
class HybridLoads:
    """A prefix hit that continues on the CPU tier, group by group: the device hits
    it starts from (``hits``, in place of ``get_computed_blocks``'s) and the CPU
    blocks loaded after them (``cpu``); ``num_blocks`` more blocks than the device
    alone gave."""

    hits: list[list[KVCacheBlock]]
    cpu: list[list[int]]
    num_blocks: int


class HybridKVCacheManager(KVImportMixin):
    """``KVCacheManager``'s interface over ``len(windows)`` groups sharing one pool.

    ``block_ids`` is group 0's table (the step plan's ``block_table``);
    ``group_block_ids`` the others'.
    """

    def __init__(self, num_gpu_blocks: int, block_size: int,
                 windows: tuple[int | None, ...], num_cpu_blocks: int = 0,
                 enable_caching: bool = True, enable_offload: bool = False) -> None:
        if len(windows) < 2:
            raise ValueError(f"a hybrid KV cache needs two groups or more, got {windows}")
        self.block_size = block_size
        self.pool = BlockPool(num_gpu_blocks, enable_caching)
        self.cpu_pool = CpuBlockPool(num_cpu_blocks, enable_caching=enable_offload)
        self.groups = [
            KVCacheManager(num_gpu_blocks, block_size, num_cpu_blocks, enable_caching,
                           enable_offload, sliding_window=w, pool=self.pool,
                           cpu_pool=self.cpu_pool,
                           hash_salt=f"kv-group-{g}".encode() if g else b"")
            for g, w in enumerate(windows)
        ]
        self.windows = tuple(windows)
        # Sliding groups by window: a request's groups of one window release in step.
        by_window: dict[int, list[KVCacheManager]] = {}
        for g in self.groups:
            if g.sliding_window is not None:
                by_window.setdefault(g.sliding_window, []).append(g)
        self._by_window = list(by_window.items())
        self.sliding_window = None  # (per group: ``windows``)
        self.offload_enabled = enable_offload
        self.offload_stats = self.groups[0].offload_stats
        for g in self.groups[1:]:  # one set of counters (CPU hit tokens fixed up here)
            g.offload_stats = self.offload_stats
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ---- lookups -------------------------------------------------------------------

    @property
    def group_managers(self) -> list[KVCacheManager]:
        return self.groups

    @property
    def group_windows(self) -> tuple[int | None, ...]:
        return self.windows

    def block_ids(self, request_id: str) -> list[int]:
        return self.groups[0].block_ids(request_id)

    def group_block_ids(self, request_id: str) -> list[list[int]]:
        return [g.block_ids(request_id) for g in self.groups[1:]]

    def get_computed_blocks(self, request: Request) -> tuple[list[list[KVCacheBlock]], int]:
        """Per group, the hits of the longest prefix every group can resume from."""
        hashes = request.update_block_hashes(self.block_size)
        k = self._hit_blocks(hashes, (request.num_tokens - 1) // self.block_size)
        hits = []
        for g in self.groups:
            lo = self._first_needed(g, k)
            found = [g.pool.get_cached_block(g.salted(h)) for h in hashes[lo:k]]
            hits.append([RELEASED] * lo + found)
        return hits, k * self.block_size

    def _hit_blocks(self, hashes: list[BlockHash], max_blocks: int) -> int:
        """The most leading blocks (up to ``max_blocks``) every group can resume from."""
        k = min(max_blocks, len(hashes))
        for g in self.groups:
            if g.sliding_window is None:
                k = next((i for i in range(k)
                          if g.pool.get_cached_block(g.salted(hashes[i])) is None), k)
        moved = True
        while moved and k:  # each sliding group's window before the hit, from the right
            moved = False
            for g in self.groups:
                if g.sliding_window is not None and (miss := g.last_miss(hashes, k)) is not None:
                    k, moved = miss, True
        return k

    def _first_needed(self, group: KVCacheManager, num_hit_blocks: int) -> int:
        """A group's first block that a hit of ``num_hit_blocks`` blocks needs."""
        if group.sliding_window is None:
            return 0
        return first_seen_block(num_hit_blocks, group.sliding_window, self.block_size)

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def get_offloaded_blocks(self, request: Request, num_device_hits: int
                             ) -> HybridLoads | list[int]:
        """The longest hit past the device's ``num_device_hits`` blocks that every group
        can resume from when each loads from the CPU tier what follows its device
        blocks; ``[]`` when there is none."""
        if not self.offload_enabled:
            return []
        hashes = request.update_block_hashes(self.block_size)
        k = self._two_tier_blocks(hashes, (request.num_tokens - 1) // self.block_size)
        if k <= num_device_hits:
            return []
        loads = HybridLoads([], [], k - num_device_hits)
        for g in self.groups:
            lo = self._first_needed(g, k)
            on_device = self._device_run(g, hashes, lo, k)
            cpu = [self.cpu_pool.lookup(g.salted(h)) for h in hashes[lo + len(on_device):k]]
            assert None not in cpu, "the hit was looked up just now"
            loads.hits.append([RELEASED] * lo + on_device)
            loads.cpu.append(cpu)  # type: ignore[arg-type]
        return loads

    def offloaded_tokens(self, loads: HybridLoads | list[int]) -> int:
        """Tokens a ``get_offloaded_blocks`` answer adds to the hit."""
        return loads.num_blocks * self.block_size if isinstance(loads, HybridLoads) else 0

    def _device_run(self, g: KVCacheManager, hashes: list[BlockHash], lo: int, k: int
                    ) -> list[KVCacheBlock]:
        """Group ``g``'s device blocks from block ``lo`` on, up to the first it lacks."""
        run: list[KVCacheBlock] = []
        for h in hashes[lo:k]:
            block = self.pool.get_cached_block(g.salted(h))
            if block is None:
                break
            run.append(block)
        return run

    def _two_tier_blocks(self, hashes: list[BlockHash], max_blocks: int) -> int:
        """The most leading blocks (up to ``max_blocks``) every group can resume from,
        each taking its device blocks from the first it needs, then the CPU tier's."""
        k = min(max_blocks, len(hashes))
        moved = True
        while moved and k:  # the last block some group cannot get, from the right
            moved = False
            for g in self.groups:
                lo = self._first_needed(g, k)
                start = lo + len(self._device_run(g, hashes, lo, k))
                miss = next((i for i in range(k - 1, start - 1, -1)
                             if self.cpu_pool.lookup(g.salted(hashes[i])) is None), None)
                if miss is not None:
                    k, moved = miss, True
        return k

    # ---- allocation ------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[list[KVCacheBlock]] | None = None,
                       offloaded: HybridLoads | list[int] | None = None
                       ) -> list[tuple[int, int]] | None:
        """Every group's ``allocate_slots``, or ``None`` with nothing changed. With
        ``offloaded`` (``get_offloaded_blocks``) its hits replace ``computed_blocks``."""
        loads = offloaded if isinstance(offloaded, HybridLoads) else None
        if loads is not None:
            computed_blocks = loads.hits
        if not computed_blocks and self._has_room(request, num_new_tokens):
            return []  # every decode step but one in B
        hits = computed_blocks or [None] * len(self.groups)
        cpu = loads.cpu if loads is not None else [None] * len(self.groups)
        cost = sum(g.slots_cost(request, num_new_tokens, h, c)
                   for g, h, c in zip(self.groups, hits, cpu))
        if cost > self.pool.num_free_blocks:
            return None
        for g, h in zip(self.groups, hits):  # every group's hits, before any allocates
            if h:
                g.take_hits(h)
        hit_tokens = self.offload_stats["cpu_hit_tokens"]
        copies: list[tuple[int, int]] = []
        for g, h, c in zip(self.groups, hits, cpu):
            copies.extend(g.commit_slots(request, num_new_tokens, h, c, hits_taken=True))
        if loads is not None:  # the hit's tokens, once (each group counted its own loads)
            self.offload_stats["cpu_hit_tokens"] = hit_tokens + self.offloaded_tokens(loads)
        return copies

    def _has_room(self, request: Request, num_new_tokens: int) -> bool:
        """Every group's ``has_room``: the groups' tables are equally long, so group 0
        answers for all but whether each group's partial block is its own (a fork
        shares it until one of them writes)."""
        first = self.groups[0]
        if not first.has_room(request, num_new_tokens):
            return False
        if request.num_computed_tokens % self.block_size == 0:
            return True
        rid, idx = request.request_id, request.num_computed_tokens // self.block_size
        n = len(first.req_blocks[rid])
        for g in self.groups[1:]:
            blocks = g.req_blocks[rid]
            if len(blocks) != n or blocks[idx].ref_cnt != 1:
                return False
        return True

    def cache_blocks(self, request: Request) -> None:
        """Name each group's newly full blocks (each group from the same start)."""
        start = request.num_hashed_blocks
        for g in self.groups:
            request.num_hashed_blocks = start
            g.cache_blocks(request)

    def fork(self, parent: Request, child: Request) -> None:
        for g in self.groups:
            g.fork(parent, child)

    def release_behind_window(self, request: Request) -> int:
        """Every sliding group's ``release_behind_window``; groups of one window release
        the same entries of one request at the same steps, so one check per window
        skips them all on the steps (most) where nothing falls behind it."""
        released = 0
        for window, groups in self._by_window:
            upto = (request.num_computed_tokens - window + 1) // self.block_size
            if upto > groups[0].released_upto(request.request_id):
                released += sum(g.release_behind_window(request) for g in groups)
        return released

    def free(self, request: Request) -> None:
        for g in self.groups:
            g.free(request)

    # ---- swap --------------------------------------------------------------------------

    def can_swap_out(self, request: Request) -> bool:
        held = sum(1 for g in self.groups for b in g.req_blocks.get(request.request_id, ())
                   if b is not RELEASED)
        return held <= self.cpu_pool.num_available_blocks

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        return [p for g in self.groups for p in g.swap_out(request)]

    def num_blocks_to_swap_in(self, request: Request) -> int:
        return sum(g.num_blocks_to_swap_in(request) for g in self.groups)

    def swap_in_cost(self, request: Request, num_new_tokens: int) -> int:
        return sum(g.swap_in_cost(request, num_new_tokens) for g in self.groups)

    def swap_in(self, request: Request) -> list[tuple[int, int]] | None:
        if self.num_blocks_to_swap_in(request) > self.pool.num_free_blocks:
            return None
        pairs: list[tuple[int, int]] = []
        for g in self.groups:
            got = g.swap_in(request)
            assert got is not None, "the summed check was exact"
            pairs.extend(got)
        return pairs

    # ---- steps ---------------------------------------------------------------------------

    def end_step(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The step's offload copies of every group's evicted blocks (one pool, so
        group 0 copies them all) and every group's loads of CPU hits."""
        loads = [p for g in self.groups[1:] for p in g.pop_loads()]
        outs, first = self.groups[0].end_step()
        return outs, first + loads

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_prefix_cache() + self.cpu_pool.reset()

    # ---- KV shipped between replicas (``kv_import``) ------------------------------------------

    def shippable_prefix(self, hashes: list[BlockHash], num_tokens: int
                         ) -> tuple[list[int], list[BlockHash]]:
        """Device ids and salted hashes of the blocks a prompt of ``num_tokens`` tokens
        would hit here: group by group, what a decode replica needs for the same hit."""
        k = self._hit_blocks(hashes, (num_tokens - 1) // self.block_size)
        ids: list[int] = []
        names: list[BlockHash] = []
        for g in self.groups:
            for h in hashes[self._first_needed(g, k):k]:
                name = g.salted(h)
                block = self.pool.get_cached_block(name)
                assert block is not None, "the hit was looked up just now"
                ids.append(block.block_id)
                names.append(name)
        return ids, names

    def prefix_hit_tokens(self, hashes: list[BlockHash], num_tokens: int) -> int:
        return self._hit_blocks(hashes, (num_tokens - 1) // self.block_size) * self.block_size

    def cached_prefix(self, hashes: list[BlockHash]) -> list[int]:
        raise RuntimeError("a hybrid KV cache ships by shippable_prefix (one hash chain "
                           "per group)")

    def reserve_import(self, hashes: list[BlockHash]) -> ImportReservation:
        """Fresh blocks for the shipped (salted) hashes this pool lacks, or none at all
        when they do not all fit: a hit needs every group's blocks, so part of them
        would only evict cached prefixes for nothing."""
        if not self.pool.enable_caching:
            return ImportReservation(list(hashes), [], [], [])
        held, missing = self.cached_and_missing(hashes, one_chain=False)  # (one per group)
        reviving = sum(1 for b in held if b.ref_cnt == 0)  # (free now, pinned below)
        if len(missing) > self.pool.num_free_blocks - reviving:
            return ImportReservation(list(hashes), [], [], [])
        self.pool.touch(held)
        fresh = self.pool.allocate(len(missing))
        return self.keep_evicted(ImportReservation(list(hashes), missing, fresh, held))
