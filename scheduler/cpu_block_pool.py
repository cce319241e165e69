"""The CPU tier: blocks of swapped-out requests and, with offloading, a prefix cache.

Two kinds of tenant share one pool of ``num_blocks`` CPU blocks:
- a swapped request *owns* its copies (never shared, freed with the request);
- with ``enable_caching`` (KV offloading), a full block evicted from the
  device pool is copied here under its prefix hash, and a later request whose
  prefix continues past the device's cache loads it back instead of computing
  it (vLLM's CPU offloading, SGLang's hierarchical cache). Cached blocks
  belong to no request: they are evicted least recently used first whenever
  a swap-out or a newer offload needs room, so swapping never loses space to
  the cache.

A block that the step being planned reads or writes is *pinned* until the
plan is complete (``release_pins``, from ``KVCacheManager.end_step``): its
content must not be reused within one plan, since the worker applies all
swap-outs before all swap-ins and a batched copy with repeated destinations
has no defined winner. Across plans no pin is needed: every rank runs plans
in the order they were made (pipelined plans too: a stage holds only its own
layers' blocks and takes plans in order), so a later plan's copies run after
this one's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from pagedserve.scheduler.block_hash import BlockHash
from pagedserve.scheduler.block_pool import NoFreeBlocksError


class CpuBlockPool:
    """CPU block ids (their own id space, never device ids) and who holds each."""

    def __init__(self, num_blocks: int, enable_caching: bool = False) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._owned: set[int] = set()
        # hash -> block, least recently used first; only unowned blocks live here.
        self.cached: OrderedDict[BlockHash, int] = OrderedDict()
        self._hash_of: dict[int, BlockHash] = {}
        self._pinned: set[int] = set()
        self._pinned_cached = 0
        self._deferred: list[int] = []  # freed while pinned: free once the plan is built

    # ---- counts ------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks holding nothing at all (cached and owned blocks not counted)."""
        return len(self._free)

    @property
    def num_owned_blocks(self) -> int:
        return len(self._owned)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    @property
    def num_available_blocks(self) -> int:
        """What an allocation may take now: free blocks plus unpinned cached ones."""
        return len(self._free) + len(self.cached) - self._pinned_cached

    # ---- ownership (swap) --------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks for one owner, evicting cached blocks (LRU first) if the free
        ones run out. All or nothing: a failed allocation changes nothing."""
        if n > self.num_available_blocks:
            raise NoFreeBlocksError(
                f"need {n} CPU blocks, {self.num_available_blocks} available")
        out = [self._take() for _ in range(n)]
        self._owned.update(out)
        return out

    def free(self, block_ids: Iterable[int],
             hashes: Iterable[BlockHash | None] | None = None) -> None:
        """Release an owner's blocks. With caching, a block named by a hash the cache
        lacks joins the cache (its content is that full block's) instead of the free
        list, so a swapped request's prefix outlives it here too."""
        ids = list(block_ids)
        names = list(hashes) if hashes is not None else [None] * len(ids)
        for b, h in zip(ids, names, strict=True):
            if b not in self._owned:
                raise RuntimeError(f"double free of CPU block {b}")
            self._owned.remove(b)
            if self.enable_caching and h is not None and h not in self.cached:
                self._name(b, h)
            elif b in self._pinned:
                self._deferred.append(b)
            else:
                self._free.append(b)

    # ---- the prefix cache --------------------------------------------------------

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def touch(self, block_ids: Iterable[int]) -> None:
        """Mark cached blocks as just used (most recently used end)."""
        for b in block_ids:
            self.cached.move_to_end(self._hash_of[b])

    def take_cached(self, block_hash: BlockHash) -> int | None:
        """Hand the cached block named ``block_hash`` to an owner (a swap-out of a
        block with this content), or ``None`` if there is none or the plan uses it."""
        b = self.lookup(block_hash)
        if b is None or b in self._pinned:
            return None
        self._unname(b)
        self._owned.add(b)
        return b

    def store(self, block_hash: BlockHash) -> int | None:
        """A block to copy a device block named ``block_hash`` into, or ``None``: the
        hash is cached here already (then it is touched), or every block is owned or
        pinned. The returned block is named and pinned at once."""
        if not self.enable_caching:
            return None
        have = self.cached.get(block_hash)
        if have is not None:
            self.cached.move_to_end(block_hash)
            return None
        if self.num_available_blocks == 0:
            return None
        b = self._take()
        self._name(b, block_hash)
        self.pin([b])
        return b

    def reset(self) -> int:
        """Forget every cached block the plan being built does not use; returns how many."""
        dropped = [b for b in self.cached.values() if b not in self._pinned]
        for b in dropped:
            self._unname(b)
            self._free.append(b)
        return len(dropped)

    # ---- pins ----------------------------------------------------------------------

    def pin(self, block_ids: Iterable[int]) -> None:
        """Keep these blocks' content for the step being planned (read or written by it)."""
        for b in block_ids:
            if b not in self._pinned:
                self._pinned.add(b)
                self._pinned_cached += b in self._hash_of

    def release_pins(self) -> None:
        """The plan is built: later plans may reuse its blocks (they run after it)."""
        self._pinned.clear()
        self._pinned_cached = 0
        self._free.extend(self._deferred)
        self._deferred.clear()

    # ---- internals -------------------------------------------------------------------

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        for b in self.cached.values():  # least recently used first
            if b not in self._pinned:
                self._unname(b)
                return b
        raise NoFreeBlocksError("no CPU block to take")  # callers check first

    def _name(self, b: int, h: BlockHash) -> None:
        self.cached[h] = b
        self._hash_of[b] = h
        self._pinned_cached += b in self._pinned

    def _unname(self, b: int) -> None:
        h = self._hash_of.pop(b)
        del self.cached[h]
        self._pinned_cached -= b in self._pinned
