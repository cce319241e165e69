"""The "cpu" attention backend: the torch backend with its hot paths on the native kernels.

Decode rows and the rows of prefills up to ``ROWS_MAX_KEYS`` keys run on the native
paged kernel (``cpu_native.paged_decode``): a prefill row is a decode row whose key
length stops at its own position, so a batch of prompts becomes one call over all
its rows instead of padded, masked SDPA groups. A sequence's rows go in runs of
``cpu_native.ROWS_PER_CHUNK`` that read its K/V once per run, tile by tile, with
each row's arithmetic unchanged: 1.7-2x SDPA's speed at 128-512 keys, 1.15-1.3x at
1-2k, even at 4k (where SDPA's GEMMs catch up, so longer prefills keep SDPA; under a
sliding window of at most ``ROWS_MAX_KEYS`` keys every prefill runs as rows, each row
reading only its window). Stores are one native call per layer.

Anything the native kernels do not take (fp16 queries, non-contiguous caches,
head sizes that are not multiples of 16) falls back to the inherited torch
path, so every batch the torch backend accepts works here too.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from typing import Any

import torch

from pagedserve.kernels import cpu_cascade, cpu_native
from pagedserve.kernels.metadata import VarlenMetadata
from pagedserve.kernels.torch_ref import TorchBackend

# Prefills whose key length is at most this run as native rows; longer ones use SDPA
# (``python bench/prefill_rows.py`` measures both sides).
ROWS_MAX_KEYS = 2048

# A mixed step's decode sequences, their rows in the batch, and the split of the
# prefixes they share.
_DecodeSplit = tuple[list[int], torch.Tensor, cpu_cascade.SharedPrefixPlan]


class _PerTable:
    """A step's plans keyed by the block table they were made for. Every layer of a
    step gets the same table, except that a hybrid model's layers alternate between
    their KV cache groups' tables (``scheduler.kv_groups``): each group's plan then
    stays made for all its layers instead of being made again at every switch."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[torch.Tensor, Any]] = {}

    def get(self, table: torch.Tensor) -> Any:
        entry = self._entries.get(id(table))
        return entry[1] if entry is not None and entry[0] is table else None

    def put(self, table: torch.Tensor, value: Any) -> None:
        if len(self._entries) >= 16 and id(table) not in self._entries:
            self._entries.clear()  # (a step has a table per group; older steps' go)
        self._entries[id(table)] = (table, value)  # the entry keeps ``id`` from reuse


class _Rows:
    """A step's prefill rows as native decode rows (built once, shared by every layer)."""

    def __init__(self, md: VarlenMetadata, block_table: torch.Tensor, seqs: list[int],
                 starts: list[int], rows_per_chunk: int) -> None:
        self.md, self.block_table, self.seqs = md, block_table, seqs
        q_lens, k_lens = md.host_query_lens(), md.host_key_lens()
        qs = torch.tensor([q_lens[s] for s in seqs])
        ks = torch.tensor([k_lens[s] for s in seqs])
        first = torch.tensor([starts[s] for s in seqs])
        n = int(qs.sum())
        within = torch.arange(n) - torch.repeat_interleave(qs.cumsum(0) - qs, qs)
        self.rows = torch.repeat_interleave(first, qs) + within
        self.lens = (torch.repeat_interleave(ks - qs, qs) + within + 1).to(torch.int32)
        self.max_len = max(k_lens[s] for s in seqs)
        seq_of_row = torch.repeat_interleave(torch.tensor(seqs), qs)
        self.tables = block_table.index_select(0, seq_of_row.to(block_table.device))
        # Each sequence's rows in runs that read its K/V once (bit-identical per row).
        self.chunks = cpu_native.row_chunks([q_lens[s] for s in seqs], rows_per_chunk)
        # Every row of the batch, in order: q and out are used as they are.
        self.dense = n == starts[-1] and all(a < b for a, b in itertools.pairwise(seqs))

    def matches(self, md: VarlenMetadata, block_table: torch.Tensor, seqs: list[int]) -> bool:
        return self.md is md and self.block_table is block_table and self.seqs == seqs


class CpuNativeBackend(TorchBackend):
    """The torch backend with stores, decode rows and short prefills on the native
    kernels (CPU; fp32 or bf16 queries over fp32, bf16, fp16 or fp8 caches)."""

    name = "cpu"

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__(device)
        self._rows = _PerTable()  # -> _Rows
        # Prefills with more keys than this go to SDPA. Batch-invariant mode
        # (``worker.batch_invariant``) lifts it: every row then runs the same per-row
        # kernel in prefill and decode, whatever else is in the step.
        self.rows_max_keys: float = ROWS_MAX_KEYS
        # Rows of one sequence that share K/V tiles (1: every row alone, as before runs).
        self.rows_per_chunk: int = cpu_native.ROWS_PER_CHUNK
        # Decode steps split off prefixes of at least this many tokens that rows share
        # (``cpu_cascade``); 0 turns it off (batch-invariant mode does).
        self.shared_prefix_min_tokens: int = cpu_cascade.MIN_PREFIX_TOKENS
        self._prefix = _PerTable()  # -> (lens, SharedPrefixPlan | None)
        # The same for the decode rows of a step that also carries prefill rows.
        self._mixed = _PerTable()  # -> (md, native rows, _DecodeSplit | None)
        self._counters: Counter[str] = Counter()

    def take_counters(self) -> dict[str, int]:
        counters, self._counters = dict(self._counters), Counter()
        return counters

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        if not cpu_native.store_kv(key, value, key_cache, value_cache, slot_mapping):
            super().store_kv(key, value, key_cache, value_cache, slot_mapping)

    def _decode(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        lens: torch.Tensor,
        lens_host: list[int],
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not cpu_native.supports(q, key_cache, value_cache):
            return super()._decode(q, key_cache, value_cache, block_table, lens, lens_host,
                                   scale, window, softcap, sinks)
        if window is not None and max(lens_host) <= window:
            window = None  # the window cuts no row: the unwindowed kernels, cascade included
        # A shared prefix may lie partly outside a sliding window: no cascade there (nor
        # with sinks, which the cascade's merge does not add).
        if (self.shared_prefix_min_tokens and len(lens_host) > 1 and window is None
                and sinks is None):
            plan = self.prefix_plan(block_table, lens_host, key_cache.shape[1])
            if plan is not None:
                return cpu_cascade.shared_prefix_decode(q, key_cache, value_cache, plan, scale,
                                                        softcap)
        return cpu_native.paged_decode(q, key_cache, value_cache, block_table, lens,
                                       max(lens_host), scale, window=window, softcap=softcap,
                                       sinks=sinks)

    def _attend_seqs(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        md: VarlenMetadata,
        seqs: list[int],
        starts: list[int],
        scale: float,
        out: torch.Tensor,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        if not cpu_native.supports(q, key_cache, value_cache):
            super()._attend_seqs(q, key_cache, value_cache, block_table, md, seqs, starts,
                                 scale, out, window, softcap, sinks)
            return
        q_lens, k_lens = md.host_query_lens(), md.host_key_lens()
        if window is not None and max(k_lens[s] for s in seqs) <= window:
            window = None  # no row's window cuts: runs of rows and cascade stay on
        # A row reads at most the window's keys, however long its sequence: what decides
        # between native rows and SDPA is the keys a row reads.
        windowed = window is not None and window <= self.rows_max_keys
        reach = math.inf if windowed else self.rows_max_keys
        native: list[int] = []
        rest: list[int] = []
        for s in seqs:
            (native if q_lens[s] == 1 or k_lens[s] <= reach else rest).append(s)
        if rest:
            super()._attend_seqs(q, key_cache, value_cache, block_table, md, rest, starts,
                                 scale, out, window, softcap, sinks)
        if native and self.shared_prefix_min_tokens and window is None and sinks is None:
            split = self._split_decode_rows(md, block_table, native, starts,
                                            key_cache.shape[1])
            if split is not None:
                dec, rows, plan = split
                o = cpu_cascade.shared_prefix_decode(q.index_select(0, rows), key_cache,
                                                     value_cache, plan, scale, softcap)
                out.index_copy_(0, rows, o.to(out.dtype))
                taken = set(dec)
                native = [s for s in native if s not in taken]
        if not native:
            return
        r = self._rows.get(block_table)
        if r is None or not r.matches(md, block_table, native):
            r = _Rows(md, block_table, native, starts, self.rows_per_chunk)
            self._rows.put(block_table, r)
        chunks = r.chunks
        n = r.rows.numel()
        if r.dense:
            # Every row in order: read q and write out in place.
            into = out[:n] if out.dtype == torch.float32 and out.is_contiguous() else None
            o = cpu_native.paged_decode(q[:n], key_cache, value_cache, r.tables, r.lens,
                                        r.max_len, scale, out=into, chunks=chunks,
                                        window=window, softcap=softcap, sinks=sinks)
            if into is None:
                out[:n] = o
            return
        o = cpu_native.paged_decode(q.index_select(0, r.rows), key_cache, value_cache, r.tables,
                                    r.lens, r.max_len, scale, chunks=chunks, window=window,
                                    softcap=softcap, sinks=sinks)
        out.index_copy_(0, r.rows, o.to(out.dtype))

    def _split_decode_rows(self, md: VarlenMetadata, block_table: torch.Tensor,
                           native: list[int], starts: list[int], block_size: int
                           ) -> _DecodeSplit | None:
        """A mixed step's decode sequences, their rows and the plan splitting off the
        prefixes they share (``cpu_cascade``), or None; planned once per step."""
        made = self._mixed.get(block_table)
        if made is not None and made[0] is md and made[1] == native:
            return made[2]
        q_lens, k_lens = md.host_query_lens(), md.host_key_lens()
        dec = [s for s in native if q_lens[s] == 1]
        split = None
        if len(dec) > 1:
            ids = torch.tensor(dec, device=block_table.device)
            plan = cpu_cascade.plan_shared_prefixes(
                block_table.index_select(0, ids), [k_lens[s] for s in dec], block_size,
                self.shared_prefix_min_tokens)
            if plan is not None:
                split = (dec, torch.tensor([starts[s] for s in dec]), plan)
                self._counters.update(plan.counters())
        self._mixed.put(block_table, (md, list(native), split))
        return split

    def prefix_plan(self, block_table: torch.Tensor, lens_host: list[int], block_size: int
                    ) -> cpu_cascade.SharedPrefixPlan | None:
        """A decode step's split of the prefixes its rows share, or None; planned once
        per step and table (a hybrid model's counters count each group's)."""
        made = self._prefix.get(block_table)
        if made is not None and made[0] == lens_host:
            return made[1]
        plan = cpu_cascade.plan_shared_prefixes(block_table, lens_host, block_size,
                                                self.shared_prefix_min_tokens)
        self._prefix.put(block_table, (lens_host, plan))
        if plan is not None:
            self._counters.update(plan.counters())
        return plan
