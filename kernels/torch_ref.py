"""Torch reference backend: the CPU production path and the test oracle for paged KV.

Design (see DESIGN.md, "Kernels"): no per-token Python loops. K/V are
gathered a whole block at a time (``index_select`` on the block dimension
copies contiguous ``block_size * Hkv * D`` chunks) into a padded
``[S, L, Hkv, D]`` tensor and attended with ``scaled_dot_product_attention``
and a key mask; GQA uses SDPA's native grouping, so K/V are never repeated.
The gather target is a reusable workspace: fresh multi-megabyte allocations
page-fault on every call and cost several times the copy itself, and the
engine calls this once per layer per step.

Varlen batches are split: single-token queries (decode rows of a mixed batch)
go through the decode path, the rest are packed into groups whose padded cost
exceeds the real cost by at most one SDPA call's overhead: equal lengths and
many short sequences batch, one long prefill never pads short rows to its length.
"""

from __future__ import annotations

import itertools

import torch

from pagedserve.kernels.backend import AttentionBackend
from pagedserve.kernels.kv_quant import quantize, storage_view
from pagedserve.kernels.metadata import VarlenMetadata
from pagedserve.kernels.torch_ops import rebase_tables, sdpa, window_tables

# Grouping rule: padded q*k elements may exceed the real ones by _PAD_SLACK (about
# what one extra SDPA call costs on CPU, ~0.2 ms); measured padding waste costs more
# than separate calls beyond that, so the ratio allows no proportional waste.
_PAD_SLACK = 1 << 14
_PAD_RATIO = 1.0
_CPU_CHUNK_BYTES = 8 << 20  # gathered K+V per decode chunk: fits a typical L3


class _Workspace:
    """Grow-only scratch buffers keyed by (name, device, dtype)."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, torch.device, torch.dtype], torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        numel = 1
        for d in shape:
            numel *= d
        key = (name, like.device, like.dtype)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 1), dtype=like.dtype, device=like.device)
            self._bufs[key] = buf
        return buf[:numel].view(shape)


def store_kv_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new tokens' K/V into their slots, skipping padding slots (-1)."""
    slots = slot_mapping.to(key_cache.device, torch.long).reshape(-1)
    if slots.numel() == 0:
        return
    key = key.reshape(slots.numel(), *key_cache.shape[2:])
    value = value.reshape(slots.numel(), *value_cache.shape[2:])
    valid = slots >= 0
    if not bool(valid.all()):
        idx = valid.nonzero().squeeze(1)
        slots = slots.index_select(0, idx)
        key = key.index_select(0, idx)
        value = value.index_select(0, idx)
    # .view (not reshape) so a non-contiguous cache raises instead of writing a copy;
    # fp8 caches move as bytes (storage_view), after rounding like torch's cast.
    for new, cache in ((key, key_cache), (value, value_cache)):
        storage_view(cache).view(-1, *cache.shape[2:]).index_copy_(
            0, slots, storage_view(quantize(new, cache.dtype)))


def _plan_groups(ids: list[int], q_lens: list[int], k_lens: list[int]) -> list[list[int]]:
    """Greedy grouping of sequences so padding to a group's max lengths stays cheap."""
    order = sorted(ids, key=lambda s: (k_lens[s], q_lens[s]), reverse=True)
    groups: list[list[int]] = []
    cur: list[int] = []
    mq = mk = cost = 0
    for s in order:
        lq, lk = q_lens[s], k_lens[s]
        nq, nk = max(mq, lq), max(mk, lk)
        if cur and (len(cur) + 1) * nq * nk > _PAD_RATIO * (cost + lq * lk) + _PAD_SLACK:
            groups.append(cur)
            cur, mq, mk, cost = [], 0, 0, 0
            nq, nk = lq, lk
        cur.append(s)
        mq, mk, cost = nq, nk, cost + lq * lk
    if cur:
        groups.append(cur)
    return groups


class TorchBackend(AttentionBackend):
    """Pure-torch paged attention (CPU production path, any device works)."""

    name = "torch"

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__(device)
        self._ws = _Workspace()

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        store_kv_torch(key, value, key_cache, value_cache, slot_mapping)

    def _gather(
        self, key_cache: torch.Tensor, value_cache: torch.Tensor, tables: torch.Tensor,
        like: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks ``tables`` [n, nb] -> K, V [n, nb*B, Hkv, D] in ``like``'s dtype
        (workspace views); a narrower cache is gathered as stored, then widened."""
        n, nb = tables.shape
        _, bsz, hkv, d = key_cache.shape
        idx = tables.to(key_cache.device, torch.long).clamp_min(0).reshape(-1)
        shape = (n * nb, bsz, hkv, d)
        out = []
        for name, cache in (("k", key_cache), ("v", value_cache)):
            raw = storage_view(cache)
            buf = self._ws.get(name, shape, raw)
            torch.index_select(raw, 0, idx, out=buf)
            if cache.dtype != like.dtype:
                wide = self._ws.get(name + "_wide", shape, like)
                wide.copy_(buf.view(cache.dtype))
                buf = wide
            out.append(buf.view(n, nb * bsz, hkv, d))
        return out[0], out[1]

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
        s, hq, d = q.shape
        if window is not None and max(lens_host) > window:
            block_table, lens, lens_host = window_tables(block_table, lens, lens_host,
                                                          window, key_cache.shape[1])
        max_k, min_k = max(lens_host), min(lens_host)
        if max_k == 0:
            return q.new_zeros(s, hq, d)
        _, bsz, hkv, _ = key_cache.shape
        nb = -(-max_k // bsz)
        mask = None
        windowed = window is not None and max_k > window
        if min_k != max_k or windowed:
            j = torch.arange(max_k, device=q.device)[None, :]
            valid = j < lens[:, None]
            if windowed:
                valid &= j >= lens[:, None] - window
            if min_k == 0:
                valid[:, 0] |= lens == 0  # keep softmax finite; row is zeroed below
            mask = valid[:, None, None, :]
        qg = q.reshape(s, hkv, hq // hkv, d)
        # The group's query heads sit where SDPA's query positions go: so do their sinks.
        head_sinks = None if sinks is None else sinks.view(hkv, hq // hkv, 1)
        # On CPU, gather and attend a few sequences at a time so the gathered K/V
        # are still in the last-level cache when SDPA reads them.
        row_bytes = nb * bsz * hkv * d * q.element_size() * 2
        chunk = s if q.device.type != "cpu" else max(1, _CPU_CHUNK_BYTES // row_bytes)
        outs = []
        for s0 in range(0, s, chunk):
            s1 = min(s, s0 + chunk)
            k, v = self._gather(key_cache, value_cache, block_table[s0:s1, :nb], q)
            outs.append(
                sdpa(
                    qg[s0:s1],
                    k[:, :max_k].transpose(1, 2),
                    v[:, :max_k].transpose(1, 2),
                    None if mask is None else mask[s0:s1],
                    False, scale, softcap, head_sinks,
                )
            )
        o = (outs[0] if len(outs) == 1 else torch.cat(outs)).reshape(s, hq, d)
        if min_k == 0:
            o = o.masked_fill((lens == 0)[:, None, None], 0.0)
        return o

    def decode_attention(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        cache_seqlens: torch.Tensor,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self.check_window(window, softcap)
        self.check_sinks(sinks, q.shape[1])
        if q.shape[0] == 0:
            return q.new_empty(q.shape)
        lens = cache_seqlens.to(q.device, torch.long)
        return self._decode(
            q, key_cache, value_cache, block_table, lens, lens.tolist(), scale, window, softcap,
            sinks,
        ).to(q.dtype)

    def _prefill_group(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        ids: list[int],
        starts: list[int],
        q_lens: list[int],
        k_lens: list[int],
        scale: float,
        out: torch.Tensor,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        dev = q.device
        n = len(ids)
        hq, d = q.shape[1:]
        gq = [q_lens[s] for s in ids]
        gk = [k_lens[s] for s in ids]
        bsz = key_cache.shape[1]
        ids_t = torch.tensor(ids, device=dev)
        tables = block_table.index_select(0, ids_t.to(block_table.device))
        if window is not None:
            # Start each sequence's keys at the block of its first query's first visible
            # key: a chunk deep into a long prompt gathers and scores about window +
            # chunk keys, not the whole context.
            first = [max(0, k - lq - window + 1) // bsz for lq, k in zip(gq, gk)]
            if any(first):
                tables, gk = rebase_tables(tables, first, gk, bsz)
        mq, mk = max(gq), max(gk)
        nb = -(-mk // bsz)
        k, v = self._gather(key_cache, value_cache, tables[:, :nb], q)
        k, v = k[:, :mk], v[:, :mk]
        qi = torch.arange(mq, device=dev)
        ql = torch.tensor(gq, device=dev)
        kl = torch.tensor(gk, device=dev)
        rows = torch.tensor([starts[s] for s in ids], device=dev)[:, None] + qi[None, :]
        q_valid = qi[None, :] < ql[:, None]
        uniform = all(x == mq for x in gq) and all(x == mk for x in gk)
        if uniform:
            qp = q[starts[ids[0]] : starts[ids[0]] + n * mq].view(n, mq, hq, d)
            if sorted(ids) != ids or any(
                starts[b] != starts[a] + mq for a, b in itertools.pairwise(ids)
            ):
                qp = q.index_select(0, rows.reshape(-1)).view(n, mq, hq, d)
        else:
            qp = q.index_select(0, rows.clamp_max(q.shape[0] - 1).reshape(-1)).view(n, mq, hq, d)
        row_ok = None
        if gq == gk and (window is None or mk <= window):
            # No context: right-padded rows/keys plus top-left causal is exact for
            # the real rows (key j <= i < q_len never reaches padding), no mask needed.
            mask, causal = None, True
        else:
            causal = False
            kj = torch.arange(mk, device=dev)
            shift = (kl - ql)[:, None, None]
            mask = (kj[None, None, :] < kl[:, None, None]) & (
                kj[None, None, :] <= qi[None, :, None] + shift
            )
            if window is not None:
                mask &= kj[None, None, :] > qi[None, :, None] + shift - window
            row_ok = q_valid & (qi[None, :] + (kl - ql)[:, None] >= 0)
            mask[:, :, 0] |= ~row_ok
            mask = mask[:, None]
        o = sdpa(qp.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, causal,
                  scale, softcap, None if sinks is None else sinks.view(hq, 1, 1)
                  ).transpose(1, 2)  # [n, mq, hq, d]
        if row_ok is not None:
            o = o.masked_fill(~row_ok[:, :, None, None], 0.0)
        if uniform:
            out.index_copy_(0, rows.reshape(-1), o.reshape(n * mq, hq, d).to(out.dtype))
        else:
            out.index_copy_(0, rows[q_valid], o[q_valid].to(out.dtype))

    def varlen_attention(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        md: VarlenMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self.check_window(window, softcap)
        self.check_sinks(sinks, q.shape[1])
        q_lens, k_lens = md.host_query_lens(), md.host_key_lens()
        starts = [0]
        for lq in q_lens:
            starts.append(starts[-1] + lq)
        # Every row is written below except those of key-less sequences (and any
        # padding rows past the last sequence): zero only those, since zero-filling
        # a fresh output costs page faults comparable to a small prefill.
        out = torch.empty_like(q)
        out[starts[-1] :].zero_()
        for s in range(len(q_lens)):
            if k_lens[s] == 0 and q_lens[s] > 0:
                out[starts[s] : starts[s + 1]].zero_()
        seqs = [s for s in range(len(q_lens)) if q_lens[s] > 0 and k_lens[s] > 0]
        self._attend_seqs(q, key_cache, value_cache, block_table, md, seqs, starts, scale, out,
                          window, softcap, sinks)
        return out

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
        """Write the rows of sequences ``seqs`` (each with queries and keys) into ``out``:
        single-query rows through the decode path, the rest as padded SDPA groups."""
        q_lens, k_lens = md.host_query_lens(), md.host_key_lens()
        dec = [s for s in seqs if q_lens[s] == 1]
        rest = [s for s in seqs if q_lens[s] > 1]
        if dec:
            dev = q.device
            rows = torch.tensor([starts[s] for s in dec], device=dev)
            lens_host = [k_lens[s] for s in dec]
            ids_t = torch.tensor(dec, device=dev)
            o = self._decode(
                q.index_select(0, rows),
                key_cache,
                value_cache,
                block_table.index_select(0, ids_t.to(block_table.device)),
                torch.tensor(lens_host, device=dev),
                lens_host,
                scale,
                window,
                softcap,
                sinks,
            )
            out.index_copy_(0, rows, o.to(out.dtype))
        # Group no-context prefills apart: they run maskless with is_causal.
        no_ctx = [s for s in rest if q_lens[s] == k_lens[s]]
        ctx = [s for s in rest if q_lens[s] != k_lens[s]]
        for group in _plan_groups(no_ctx, q_lens, k_lens) + _plan_groups(ctx, q_lens, k_lens):
            self._prefill_group(
                q, key_cache, value_cache, block_table, sorted(group), starts,
                q_lens, k_lens, scale, out, window, softcap, sinks,
            )

