"""Per-request block tables on top of the pools: prefix hits, slot allocation,
fork and copy-on-write, swap between tiers, KV offloading, freeing.

Every method either succeeds or leaves all state untouched, so the scheduler
can try an allocation, fail, preempt someone and try again.
"""

from __future__ import annotations

import hashlib

from pagedserve.scheduler.block_hash import BlockHash
from pagedserve.scheduler.block_pool import BlockPool, KVCacheBlock
from pagedserve.scheduler.cpu_block_pool import CpuBlockPool
from pagedserve.scheduler.kv_import import KVImportMixin
from pagedserve.scheduler.kv_swap import RELEASED, KVSwapMixin, SwappedBlocks, held_on_cpu
from pagedserve.scheduler.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def first_seen_block(num_hit_blocks: int, window: int, block_size: int) -> int:
    """The first block that the query after ``num_hit_blocks`` full blocks sees
    through a sliding ``window``."""
    return max(0, (num_hit_blocks * block_size - window + 1) // block_size)


class KVCacheManager(KVSwapMixin, KVImportMixin):
    """Owns ``request_id -> [KVCacheBlock]`` and every change to it.

    With ``enable_offload`` the CPU tier is also a second level of the prefix
    cache (``cpu_block_pool``): full blocks evicted from the device are copied
    there by the step that reuses them (``end_step``), and an admitted request
    whose prefix continues there loads those blocks into fresh device blocks
    (``get_offloaded_blocks``), which it names by their hashes once the step ran,
    as it would blocks it computed. KV shipped from another replica goes through
    ``KVImportMixin`` (``kv_import``).

    With ``sliding_window`` (a model whose every layer attends through one, so one
    table serves them all) ``release_behind_window`` gives back the blocks no later
    query of a request can see, as vLLM's sliding-window manager does: a long
    request then holds about ``window / block_size`` blocks, not its whole length.
    """

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        num_cpu_blocks: int = 0,
        enable_caching: bool = True,
        enable_offload: bool = False,
        sliding_window: int | None = None,
        pool: BlockPool | None = None,
        cpu_pool: CpuBlockPool | None = None,
        hash_salt: bytes = b"",
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if enable_offload and not (enable_caching and num_cpu_blocks > 0):
            raise ValueError("kv_offloading needs enable_prefix_caching and CPU blocks "
                             f"(num_cpu_blocks={num_cpu_blocks}, "
                             f"enable_prefix_caching={enable_caching})")
        self.block_size = block_size
        # A hybrid model's groups (``hybrid_kv``) share one pool and tell their blocks
        # apart in its prefix cache by ``hash_salt``.
        self.pool = pool if pool is not None else BlockPool(num_gpu_blocks, enable_caching)
        self.pool.record_evictions = enable_offload
        self.cpu_pool = cpu_pool if cpu_pool is not None else CpuBlockPool(
            num_cpu_blocks, enable_caching=enable_offload)
        self.hash_salt = hash_salt
        self.offload_enabled = enable_offload
        self._loads: list[tuple[int, int]] = []  # (device, cpu) of this step's CPU hits
        self.offload_stats = {"cpu_hit_tokens": 0, "offloaded_blocks": 0, "loaded_blocks": 0,
                              "swap_copies_saved": 0}
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        # The same tables as plain ids, kept in step so plans copy them in C.
        self.req_block_ids: dict[str, list[int]] = {}
        # What ``block_ids`` last handed out per request: plans keep it (nothing changes
        # it), so a table that did not change since is not copied again.
        self._snapshots: dict[str, list[int]] = {}
        self.swapped: dict[str, SwappedBlocks] = {}
        self.sliding_window = sliding_window
        self._released: dict[str, int] = {}  # leading table entries now RELEASED
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ---- lookups -------------------------------------------------------------

    @property
    def group_managers(self) -> list[KVCacheManager]:
        """The per-group managers whose tables this one owns: itself alone."""
        return [self]

    @property
    def group_windows(self) -> tuple[int | None, ...]:
        return (self.sliding_window,)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's table as plain ids: a list no one changes (the same one until
        the table changes, so most decode steps copy nothing)."""
        snap = self._snapshots.get(request_id)
        if snap is None:
            ids = self.req_block_ids.get(request_id)
            if ids is None:
                return []
            snap = self._snapshots[request_id] = ids.copy()
        return snap

    def group_block_ids(self, request_id: str) -> list[list[int]] | None:
        """The tables of a hybrid model's other groups (``hybrid_kv``): none here."""
        return None

    def salted(self, block_hash: BlockHash) -> BlockHash:
        """``block_hash`` in this manager's group (unchanged without a salt)."""
        if not self.hash_salt:
            return block_hash
        return hashlib.blake2b(self.hash_salt + block_hash, digest_size=16).digest()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks, leaving at least one token to compute
        (the last prompt token's logits are what we sample from). Under a sliding
        window only the blocks the first computed query can see must be cached (vLLM
        looks for them from the right); those before come back RELEASED (not revived)."""
        hashes = request.update_block_hashes(self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        if self.sliding_window is not None:
            k = max_blocks
            while k and (miss := self.last_miss(hashes, k)) is not None:
                k = miss
            lo = first_seen_block(k, self.sliding_window, self.block_size)
            found = [self.pool.get_cached_block(self.salted(h)) for h in hashes[lo:k]]
            return [RELEASED] * lo + found, k * self.block_size
        hits: list[KVCacheBlock] = []
        for h in hashes[:max_blocks]:
            block = self.pool.get_cached_block(self.salted(h))
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def last_miss(self, hashes: list[BlockHash], num_hit_blocks: int) -> int | None:
        """The last block a hit of ``num_hit_blocks`` blocks needs and this manager's
        prefix cache lacks (a sliding window needs only the blocks it sees), or None."""
        lo = 0 if self.sliding_window is None else first_seen_block(
            num_hit_blocks, self.sliding_window, self.block_size)
        return next((i for i in range(num_hit_blocks - 1, lo - 1, -1)
                     if self.pool.get_cached_block(self.salted(hashes[i])) is None), None)

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count an admitted prompt's lookup once (a request that waits for room looks
        again every step; counting at lookup would count its hits each time)."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def get_offloaded_blocks(self, request: Request, num_device_hits: int) -> list[int]:
        """CPU blocks that continue the prefix after its ``num_device_hits`` device hits
        (the same one-token-left limit), for ``allocate_slots(..., offloaded=)``."""
        if not self.offload_enabled:
            return []
        hashes = request.update_block_hashes(self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        found: list[int] = []
        for h in hashes[num_device_hits:max_blocks]:
            cpu_id = self.cpu_pool.lookup(self.salted(h))
            if cpu_id is None:
                break
            found.append(cpu_id)
        return found

    def offloaded_tokens(self, loads: list[int]) -> int:
        """Tokens a ``get_offloaded_blocks`` answer adds to the hit."""
        return len(loads) * self.block_size

    # ---- allocation ----------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[KVCacheBlock] | None = None,
        offloaded: list[int] | None = None,
    ) -> list[tuple[int, int]] | None:
        """Make room for ``num_new_tokens`` after ``request.num_computed_tokens``.

        ``computed_blocks`` are prefix-cache hits for a request being admitted
        and ``offloaded`` the CPU blocks that follow them (its
        ``num_computed_tokens`` already counts both); each of the latter gets a
        fresh device block, loaded by this step's swap-ins. Returns the
        copy-on-write pairs to emit, or ``None`` (nothing changed) if the pool
        is short.
        """
        if not computed_blocks and self.has_room(request, num_new_tokens):
            return []  # every decode step but one in B
        if self.slots_cost(request, num_new_tokens, computed_blocks,
                           offloaded) > self.pool.num_free_blocks:
            return None
        return self.commit_slots(request, num_new_tokens, computed_blocks, offloaded)

    def has_room(self, request: Request, num_new_tokens: int) -> bool:
        """The request's blocks hold the step and the block it writes is its alone."""
        blocks = self.req_blocks.get(request.request_id, [])
        return request.num_computed_tokens + num_new_tokens <= len(blocks) * self.block_size and (
            request.num_computed_tokens % self.block_size == 0
            or blocks[request.num_computed_tokens // self.block_size].ref_cnt == 1)

    def slots_cost(self, request: Request, num_new_tokens: int,
                   computed_blocks: list[KVCacheBlock] | None = None,
                   offloaded: list[int] | None = None) -> int:
        """Free blocks ``allocate_slots`` would take: fresh ones, a copy-on-write's, and
        cached hits it revives."""
        if not computed_blocks and self.has_room(request, num_new_tokens):
            return 0
        blocks = self.req_blocks.get(request.request_id, [])
        total = request.num_computed_tokens + num_new_tokens
        computed_blocks, _ = self._within_window(computed_blocks or [], offloaded or [])
        need = max(0, cdiv(total, self.block_size) - len(blocks) - len(computed_blocks))
        need += self._cow_index(request, blocks, num_new_tokens) is not None
        return need + sum(1 for b in computed_blocks if b is not RELEASED and b.ref_cnt == 0)

    def commit_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[KVCacheBlock] | None = None,
        offloaded: list[int] | None = None,
        hits_taken: bool = False,
    ) -> list[tuple[int, int]]:
        """``allocate_slots`` once ``slots_cost`` is known to fit the pool; with
        ``hits_taken`` the caller has already taken ``computed_blocks`` from the pool
        (``take_hits``), before anything else allocated from it."""
        if not computed_blocks and self.has_room(request, num_new_tokens):
            return []
        rid = request.request_id
        self._snapshots.pop(rid, None)
        blocks = self.req_blocks.get(rid, [])
        computed_blocks, offloaded = self._within_window(computed_blocks or [], offloaded or [])
        if (computed_blocks or offloaded) and blocks:
            raise RuntimeError(f"{rid} already has blocks; prefix hits only at admission")
        total = request.num_computed_tokens + num_new_tokens
        have = len(blocks) + len(computed_blocks)
        need = max(0, cdiv(total, self.block_size) - have)
        cow = self._cow_index(request, blocks, num_new_tokens)
        need += cow is not None
        if not hits_taken:
            self.take_hits(computed_blocks)
        blocks = self.req_blocks.setdefault(rid, [])
        ids = self.req_block_ids.setdefault(rid, [])
        blocks.extend(computed_blocks)
        copies: list[tuple[int, int]] = []
        ids.extend(b.block_id for b in computed_blocks)
        if cow is not None:
            old = blocks[cow]
            (new,) = self.pool.allocate(1)
            self.pool.free([old])
            blocks[cow] = new
            ids[cow] = new.block_id
            copies.append((old.block_id, new.block_id))
            need -= 1
        fresh = self.pool.allocate(need)
        blocks.extend(fresh)
        ids.extend(b.block_id for b in fresh)
        if offloaded:
            self._loads.extend((b.block_id, c) for b, c in zip(fresh, offloaded))
            self.cpu_pool.pin(offloaded)
            self.cpu_pool.touch(offloaded)
            self.offload_stats["cpu_hit_tokens"] += len(offloaded) * self.block_size
            self.offload_stats["loaded_blocks"] += len(offloaded)
        return copies

    def _within_window(self, computed_blocks: list[KVCacheBlock], offloaded: list[int]
                       ) -> tuple[list[KVCacheBlock], list[int]]:
        """A hit less the CPU loads a sliding window has passed (their entries
        ``RELEASED``, never loaded): else a prompt longer than the pool, its prefix on
        the CPU, would ask a device block per block, never be admitted, stall the queue."""
        if self.sliding_window is None or not offloaded:
            return computed_blocks, offloaded
        lo = first_seen_block(len(computed_blocks) + len(offloaded), self.sliding_window,
                              self.block_size)
        skip = max(0, lo - len(computed_blocks))
        return computed_blocks + [RELEASED] * skip, offloaded[skip:]

    def take_hits(self, computed_blocks: list[KVCacheBlock]) -> None:
        """Hold prefix hits (cached blocks leave the free queue, where an allocation
        would evict them)."""
        self.pool.touch([b for b in computed_blocks if b is not RELEASED])

    def _cow_index(
        self, request: Request, blocks: list[KVCacheBlock], num_new_tokens: int
    ) -> int | None:
        """Index of a shared block the step writes into, if any.

        Only the partially filled last block can be written (full blocks are
        immutable), and only a fork shares a partial block.
        """
        if num_new_tokens <= 0 or request.num_computed_tokens % self.block_size == 0:
            return None
        idx = request.num_computed_tokens // self.block_size
        if idx < len(blocks) and blocks[idx].ref_cnt > 1:
            return idx
        return None

    def cache_blocks(self, request: Request) -> None:
        """Name every computed full block by its hash (called after the forward ran,
        so a hash never names a block whose content was not written)."""
        if not self.pool.enable_caching:
            return
        blocks = self.req_blocks.get(request.request_id, [])
        full = min(request.num_computed_tokens // self.block_size, len(blocks))
        if full <= request.num_hashed_blocks:
            return
        hashes = request.update_block_hashes(self.block_size)
        for i in range(request.num_hashed_blocks, full):
            b = blocks[i]
            if b.block_hash is None and b is not RELEASED:
                self.pool.cache_full_block(b, self.salted(hashes[i]))
        request.num_hashed_blocks = full

    def fork(self, parent: Request, child: Request) -> None:
        """Child shares every parent block, the partial last one included."""
        blocks = self.req_blocks.get(parent.request_id, [])
        if child.request_id in self.req_blocks:
            raise RuntimeError(f"{child.request_id} already has blocks")
        self.pool.touch([b for b in blocks if b is not RELEASED])
        self.req_blocks[child.request_id] = list(blocks)
        self.req_block_ids[child.request_id] = [b.block_id for b in blocks]
        self._snapshots.pop(child.request_id, None)
        if parent.request_id in self._released:
            self._released[child.request_id] = self._released[parent.request_id]

    def released_upto(self, request_id: str) -> int:
        """How many leading entries of the request's table a window has released."""
        return self._released.get(request_id, 0)

    def release_behind_window(self, request: Request) -> int:
        """Give back the blocks wholly before the window of ``request``'s next query
        (position ``num_computed_tokens``, which sees keys from ``num_computed_tokens -
        window + 1`` on); returns how many. A no-op without ``sliding_window``. Each
        block keeps its hash: a later prompt can still hit it until it is evicted."""
        if self.sliding_window is None:
            return 0
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        start = self._released.get(rid, 0)
        upto = (request.num_computed_tokens - self.sliding_window + 1) // self.block_size
        if blocks is None or upto <= start:
            return 0
        upto = min(upto, len(blocks))
        ids = self.req_block_ids[rid]
        self._snapshots.pop(rid, None)
        gone = [b for b in blocks[start:upto] if b is not RELEASED]
        blocks[start:upto] = [RELEASED] * (upto - start)
        ids[start:upto] = [-1] * (upto - start)
        self._released[rid] = upto
        self.pool.free(reversed(gone))  # the window's end first: prefixes outlive it
        return len(gone)

    def free(self, request: Request) -> None:
        """Release device blocks (tail first, so prefixes outlive tails) and CPU copies."""
        blocks = self.req_blocks.pop(request.request_id, None)
        self.req_block_ids.pop(request.request_id, None)
        self._snapshots.pop(request.request_id, None)
        self._released.pop(request.request_id, None)
        request.num_hashed_blocks = 0
        if blocks:
            self.pool.free(b for b in reversed(blocks) if b is not RELEASED)
        swapped = self.swapped.pop(request.request_id, None)
        if swapped:  # (with offloading its full blocks stay cached on the CPU)
            self.cpu_pool.free(*held_on_cpu(swapped))

    # ---- offloading ------------------------------------------------------------

    def end_step(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Close the step being planned: ``(swap_outs, swap_ins)`` to add to its plan.

        The swap-outs copy each device block this step evicted from the prefix cache
        into the CPU tier under its hash (the worker runs them before anything writes
        the reused block); the swap-ins load this step's CPU hits. Pins end here.
        """
        outs: list[tuple[int, int]] = []
        for block_id, block_hash in self.pool.evicted:  # (one pool: every group's)
            cpu_id = self.cpu_pool.store(block_hash)
            if cpu_id is not None:
                outs.append((block_id, cpu_id))
        self.pool.evicted.clear()
        loads = self.pop_loads()
        self.cpu_pool.release_pins()
        self.offload_stats["offloaded_blocks"] += len(outs)
        return outs, loads

    def pop_loads(self) -> list[tuple[int, int]]:
        """This step's ``(device, cpu)`` loads of CPU hits, handed over once."""
        loads, self._loads = self._loads, []
        return loads

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no request holds, on both tiers; returns how many."""
        return self.pool.reset_prefix_cache() + self.cpu_pool.reset()
