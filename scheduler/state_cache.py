"""Prefix caching for models with recurrent layers (Mamba-2, gated DeltaNet): which
block boundaries the workers hold a snapshot of a sequence's state at.

A cached prefix's KV blocks are not enough for these models: their recurrent layers
need the state a sequence had after exactly those tokens, which no block holds. So
the workers keep copies of states at block boundaries (``worker.mamba_state``),
named by the chained hash of the block that ends there, and this directory, the
scheduler's, decides which: a prefix hit resumes only at the last hit block whose
snapshot is held (fewer blocks otherwise, down to none), and the plan says what to
restore, save and drop, so the workers never decide.

Snapshots are taken where a step ends on a boundary, which decode steps do every
``block_size`` tokens; a prompt's prefill is cut at its last boundary before its
last token (one more step for the tail) so that the prompt's own state is kept.
Each running sequence holds two: its prompt's (a repeated prompt, a shared one
extended) and its latest (a conversation continued from where it stopped),
replaced as it goes. A prompt whose cached KV reaches past the last snapshot it
could resume from (a system prompt shared with an earlier request, whose own
snapshots lie past where the prompts part) is also cut at the end of that KV, the
junction, and keeps a snapshot there: the requests after it resume there (vLLM's
"shared-prefix checkpoint"). All of them stay in a least-recently-used directory of
``capacity`` entries, the workers' room (vLLM's ``mamba_cache_mode: align`` keeps
one per block; keeping two a sequence costs two states, not one per block).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from pagedserve.scheduler.block_hash import BlockHash
from pagedserve.scheduler.outputs import ScheduledRequest
from pagedserve.scheduler.request import Request


class StateSnapshots:
    """The scheduler's directory of the workers' state snapshots (module docstring)."""

    def __init__(self, capacity: int, block_size: int) -> None:
        if capacity < 1:
            raise ValueError(f"state snapshot capacity must be >= 1, got {capacity}")
        self.capacity, self.block_size = capacity, block_size
        self.held: OrderedDict[BlockHash, None] = OrderedDict()
        self._drops: list[BlockHash] = []
        self._restores: dict[str, BlockHash] = {}
        # This plan's rows that save each hash: a hash dropped later in the same plan
        # takes their saves back (workers free a plan's drops before its saves).
        self._marked: dict[BlockHash, list[ScheduledRequest]] = {}

    def trim(self, req: Request, hits: list[Any], num_hit: int) -> tuple[list[Any], int]:
        """The prefix hit ``req`` can resume from: the longest run of ``hits`` whose last
        block has a snapshot (its restore recorded for the plan), else none."""
        hashes = req.update_block_hashes(self.block_size)
        blocks = num_hit // self.block_size
        # Where the cached KV ends, if no snapshot does: this request keeps one there.
        req.state_junction = num_hit
        for j in range(blocks, 0, -1):
            if hashes[j - 1] in self.held:
                self.held.move_to_end(hashes[j - 1])
                self._restores[req.request_id] = hashes[j - 1]
                if j == blocks:
                    req.state_junction = 0
                return hits[:j], j * self.block_size
        self._restores.pop(req.request_id, None)
        return [], 0

    def align(self, req: Request, start: int, num_new: int) -> int:
        """``num_new`` cut so that a step from ``start`` ends on the junction (where its
        cached KV ended) and on the last block boundary before the sequence's last
        token rather than past them."""
        last = (req.num_tokens - 1) // self.block_size * self.block_size
        for boundary in sorted({req.state_junction, last}):
            if start < boundary < start + num_new:
                return boundary - start
        return num_new

    def mark(self, req: Request, sched: ScheduledRequest) -> None:
        """Put on ``req``'s row its restore (if admitted from a hit) and, when the row
        ends on a block boundary, the snapshot to save there."""
        sched.restore_state = self._restores.pop(req.request_id, None)
        end = sched.num_computed_tokens + sched.num_tokens
        if end == 0 or end % self.block_size or sched.draft_token_ids:
            return
        hashes = req.update_block_hashes(self.block_size)
        if len(hashes) < end // self.block_size:
            return
        h = hashes[end // self.block_size - 1]
        sched.save_state = h
        self._marked.setdefault(h, []).append(sched)
        prompt_end = (req.num_prompt_tokens - 1) // self.block_size * self.block_size
        if end == req.state_junction:  # (kept like the prompt's: never replaced)
            req.state_junction = 0
        elif end == prompt_end:
            req.prompt_state = h
        else:
            old, req.latest_state = req.latest_state, h
            if old is not None and old not in (h, req.prompt_state):
                self._drop(old)
        self.held[h] = None
        self.held.move_to_end(h)
        while len(self.held) > self.capacity:
            self._drop(next(iter(self.held)))

    def _drop(self, h: BlockHash) -> None:
        if h in self.held:
            del self.held[h]
            self._drops.append(h)
            for sched in self._marked.pop(h, ()):
                sched.save_state = None

    def take_drops(self) -> list[BlockHash]:
        """The snapshots the plan frees (before its saves, so a full directory's room
        is enough) and the end of the plan's bookkeeping."""
        drops, self._drops = self._drops, []
        self._marked.clear()
        self._restores.clear()  # (requests not admitted after all look again next step)
        return drops

    def reset(self) -> None:
        """Forget every snapshot (the prefix cache was reset; new weights make them
        stale): the next plan frees them."""
        self._drops.extend(self.held)
        self.held.clear()
