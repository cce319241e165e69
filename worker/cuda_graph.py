"""CUDA graph capture of the decode forward (CUDA only, off by default).

Decode steps are small and launch-bound on a GPU, so replaying a captured
graph removes most CPU overhead. Graphs are captured per padded batch size
over static input buffers, all of them when the KV cache is built
(``capture_all``), else on first use; padded rows write to slot -1 (skipped) and
attend to one key of block 0, whose result is discarded. Any capture failure
(e.g. a backend that synchronises with the host) disables graphs and falls
back to eager execution instead of failing the step. A hybrid model's KV cache
groups (``scheduler.kv_groups``) each have their own table and slot buffers.
Untested on CPU hosts.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from pagedserve.worker.layers.attention import AttentionMetadata

if TYPE_CHECKING:
    from pagedserve.worker.kv_cache import KVCache
    from pagedserve.worker.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 512)


class DecodeGraphRunner:
    """Captured decode forwards keyed by padded batch size."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, device: torch.device,
                 max_num_seqs: int, max_blocks: int, num_groups: int = 1):
        self.model, self.kv_cache, self.device = model, kv_cache, device
        # Every batch up to max_num_seqs has a graph: the last size is max_num_seqs itself.
        self.sizes = [b for b in _BATCH_SIZES if b < max_num_seqs] + [max_num_seqs]
        n = self.sizes[-1]
        self.max_blocks = max_blocks
        self.ids = torch.zeros(n, dtype=torch.long, device=device)
        self.pos = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = [torch.full((n,), -1, dtype=torch.long, device=device)
                      for _ in range(num_groups)]
        self.bt = [torch.zeros((n, max_blocks), dtype=torch.int32, device=device)
                   for _ in range(num_groups)]
        self.lens = torch.ones(n, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.disabled = False

    def _md(self, b: int) -> AttentionMetadata:
        mds = [AttentionMetadata(slots[:b], bt[:b], self.lens[:b], True, None)
               for slots, bt in zip(self.slots, self.bt, strict=True)]
        if len(mds) > 1:
            mds[0].groups = mds[1:]
        return mds[0]

    def _capture(self, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        layers = self.kv_cache.layers
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the graph (allocator, autotuning)
                self.model(self.ids[:b], self.pos[:b], layers, self._md(b))
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.model(self.ids[:b], self.pos[:b], layers, self._md(b))
        self.pool = graph.pool()
        return graph, out

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata
            ) -> torch.Tensor | None:
        """Hidden states via a graph replay, or None to make the caller run eagerly."""
        s = input_ids.shape[0]
        width = md.block_table.shape[1]
        if self.disabled or s > self.sizes[-1] or width > self.max_blocks:
            return None
        b = next(x for x in self.sizes if x >= s)
        self.ids[:s].copy_(input_ids)
        self.pos[:s].copy_(positions)
        for g, gmd in enumerate([md, *(md.groups or ())]):
            slots, bt = self.slots[g], self.bt[g]
            slots[:s].copy_(gmd.slot_mapping)
            slots[s:b].fill_(-1)
            bt[:s, :width].copy_(gmd.block_table)
            bt[:s, width:].fill_(-1)
            bt[s:b].fill_(0)
        self.lens[:s].copy_(md.seq_lens)
        self.lens[s:b].fill_(1)
        entry = self._graph(b)
        if entry is None:
            return None
        graph, out = entry
        graph.replay()
        return out[:s]

    def capture_all(self) -> None:
        """Capture every size now, largest first (smaller graphs then reuse its memory pool),
        so no serving step pays for a capture."""
        t0 = time.perf_counter()
        for b in reversed(self.sizes):
            if self._graph(b) is None:
                return
        logger.info("captured %d decode graphs (batch <= %d) in %.1fs", len(self.graphs),
                    self.sizes[-1], time.perf_counter() - t0)

    def _graph(self, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor] | None:
        """The graph of padded size ``b``, captured on first use; None once graphs are off."""
        entry = self.graphs.get(b)
        if entry is None and not self.disabled:
            try:
                entry = self._capture(b)
            except Exception as exc:  # pragma: no cover - CUDA only
                logger.warning("CUDA graph capture failed (%s); decoding eagerly", exc)
                self.disabled = True
                self.graphs.clear()
                torch.cuda.synchronize(self.device)
                return None
            self.graphs[b] = entry
        return entry
