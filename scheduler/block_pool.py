"""The device block pool: ref counts, an LRU free queue and the prefix-cache map.

Policy, in vLLM v1's terms:
- No null block. Padding in block tables and slot mappings is ``-1``, which
  kernels skip, so every one of ``num_blocks`` blocks is usable.
- A freed block keeps its hash and joins the tail of the free queue; it is
  evicted lazily, only when ``allocate`` pops it from the head. Until then a
  later request with the same prefix takes it back (``touch``), which is what
  makes a finished or preempted request's prefix a cache hit.
- Callers free a request's blocks tail first, so the tail of a sequence (the
  part least likely to be shared) is evicted before its prefix.
- With ``record_evictions`` (KV offloading), every hash that ``allocate``
  evicts is noted with its block in ``evicted``, so the step that reuses the
  block can copy the old content to the CPU tier first.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from pagedserve.scheduler.block_hash import BlockHash


class NoFreeBlocksError(RuntimeError):
    """The pool cannot satisfy an allocation; callers preempt or wait."""


class KVCacheBlock:
    """Metadata of one physical block; the tensor lives on the workers."""

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks: O(1) pop from the head, append, and
    removal from the middle (when a cached free block is hit again)."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def popleft(self) -> KVCacheBlock:
        first = self._head.next_free
        if first is None or first is self._tail:
            raise NoFreeBlocksError("no free blocks")
        self.remove(first)
        return first

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free

    def __len__(self) -> int:
        return self.num_free


class BlockPool:
    """All device blocks of one replica, owned by the scheduler."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        self.record_evictions = False
        self.evicted: list[tuple[int, BlockHash]] = []

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks, reviving free ones."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[KVCacheBlock]:
        """Pop ``n`` blocks from the head of the free queue, evicting their hashes.

        All or nothing: a failed allocation leaves the pool untouched.
        """
        if n > self.free_queue.num_free:
            raise NoFreeBlocksError(f"need {n} blocks, {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            b = self.free_queue.popleft()
            if self.record_evictions and b.block_hash is not None:
                self.evicted.append((b.block_id, b.block_hash))
            self._evict(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; unreferenced ones join the LRU tail."""
        for b in blocks:
            if b.ref_cnt <= 0:
                raise RuntimeError(f"double free of {b}")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queue.append(b)

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Name a block computed in full by its hash.

        If another block already holds this hash (two requests computed the
        same prefix at once), the first keeps it and this one stays unnamed:
        a hash always maps to exactly one block whose content it names.
        """
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> int:
        """Forget every hash of a free block; returns how many were dropped."""
        dropped = 0
        for b in self.free_queue:
            if b.block_hash is not None:
                self._evict(b)
                dropped += 1
        return dropped
