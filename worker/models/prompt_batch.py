"""Attention over a step's whole prompts, both ways, for the encoders (BERT, ModernBERT).

An encoder step's rows are whole prompts laid end to end. For SDPA they are
padded, in groups of similar length, into ``[S, L]`` batches, one call each with
a key mask. A local layer (ModernBERT's: each token sees ``window`` positions
either side) adds a band to that mask while a group is short; past
``CHUNKED_FROM`` windows it runs in query chunks of ``2 * window`` rows, each
against only the keys its band can reach, so its cost grows with the prompt's
length rather than its square (an 8,192-token prompt: 32 times fewer scores
than the full mask at ModernBERT's window).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedserve.worker.layers.attention import AttentionMetadata

# A step's prompts are padded in groups of similar length: a group holds prompts of
# at least 1 / GROUP_RATIO of its longest one's length, so attention pads little.
GROUP_RATIO = 1.3
# A local layer over a group longer than this many windows attends in chunks.
CHUNKED_FROM = 8


@dataclass
class _Group:
    """Prompts padded together: ``index[s, i]`` is the flat row of prompt ``s``'s token
    ``i`` (past its end, its first row again: a padded key is masked out and a padded
    query's output dropped, so no zero row is copied in), ``ok`` which of those are
    real, ``mask`` the keys' validity for SDPA (None: no padding), ``valid`` the real
    positions of the padded ``[S * L]`` batch and ``rows`` their flat rows, in the
    same order."""

    index: torch.Tensor
    ok: torch.Tensor
    mask: torch.Tensor | None
    valid: torch.Tensor
    rows: torch.Tensor


@dataclass
class _Chunks:
    """A group's local attention in query chunks: chunk ``j`` of prompt ``s`` is row
    ``s * n + j`` of ``queries`` (its ``C`` query rows) and ``keys`` (the ``C + 2w``
    rows its band reaches, from ``w`` before its first query), ``mask`` the band and
    the keys' validity; ``valid`` / ``rows`` as ``_Group``'s, over the chunked queries."""

    queries: torch.Tensor
    keys: torch.Tensor
    mask: torch.Tensor
    valid: torch.Tensor
    rows: torch.Tensor


def _chunks(g: _Group, window: int) -> _Chunks:
    s, longest = g.index.shape
    c = 2 * window
    n = -(-longest // c)
    tail = n * c - longest + window
    first = g.index[:, :1]
    index = torch.cat([first.expand(s, window), g.index, first.expand(s, tail)], 1)
    ok = F.pad(g.ok, (window, tail), value=False)
    reach = c + 2 * window
    keys = index.unfold(1, reach, c).reshape(s * n, reach)
    key_ok = ok.unfold(1, reach, c).reshape(s * n, 1, 1, reach)
    queries = index[:, window:window + n * c].reshape(s * n, c)
    query_ok = ok[:, window:window + n * c].reshape(-1)
    # Query i of a chunk sits at key column i + window: it sees columns i .. i + 2w.
    i, j = torch.arange(c, device=index.device), torch.arange(reach, device=index.device)
    band = (j[None, :] >= i[:, None]) & (j[None, :] <= i[:, None] + 2 * window)
    valid = torch.nonzero(query_ok).squeeze(1)
    return _Chunks(queries, keys, band[None, None] & key_ok, valid,
                   queries.reshape(-1).index_select(0, valid))


@dataclass
class PromptBatch:
    """A step's whole prompts as padded groups (``_Group``) for SDPA, and each flat row's
    prompt (``seq_of_row``, with the prompts' first rows in ``starts``). ``local``
    keeps each window's per-group plan (a mask or chunks), built once a step."""

    groups: list[_Group]
    seq_of_row: torch.Tensor
    starts: torch.Tensor
    local: dict[int, list[torch.Tensor | _Chunks | None]] = field(default_factory=dict)

    @classmethod
    def of(cls, md: AttentionMetadata, num_rows: int, device: torch.device) -> PromptBatch:
        """The step's prompts from its metadata; a row with cached context is an error
        (an encoder's prompt must run whole, in one step)."""
        if md.varlen is None:  # every prompt is one token (a "decode"-shaped step)
            q_lens, k_lens = [1] * num_rows, md.seq_lens.cpu().tolist()
        else:
            q_lens, k_lens = md.varlen.host_query_lens(), md.varlen.host_key_lens()
        if q_lens != k_lens:
            raise RuntimeError("an encoder step holds a prompt that does not start at "
                               "position 0 (chunked prefill or a prefix-cache hit); "
                               "encoders need each prompt whole in one step")
        return cls.of_lengths(q_lens, device)

    @classmethod
    def of_lengths(cls, q_lens: list[int], device: torch.device) -> PromptBatch:
        """Prompts of ``q_lens`` rows, laid end to end in that order."""
        lens = torch.tensor(q_lens, dtype=torch.long)
        starts = torch.cumsum(lens, 0) - lens
        order = sorted(range(len(q_lens)), key=lambda s: -q_lens[s])
        groups, first = [], 0
        for n in range(1, len(order) + 1):
            if n == len(order) or q_lens[order[n]] * GROUP_RATIO < q_lens[order[first]]:
                groups.append(_group(lens, starts, order[first:n], device))
                first = n
        seq_of_row = torch.repeat_interleave(torch.arange(len(q_lens)), lens)
        return cls(groups, seq_of_row.to(device), starts.to(device))

    def _local(self, window: int) -> list[torch.Tensor | _Chunks | None]:
        """Each group's plan when a row sees only keys within ``window`` positions of
        its own: its key mask (every key within reach), a banded mask, or chunks."""
        if window not in self.local:
            plans: list[torch.Tensor | _Chunks | None] = []
            for g in self.groups:
                longest = g.index.shape[1]
                if longest <= window + 1:
                    plans.append(g.mask)
                elif longest > CHUNKED_FROM * window:
                    plans.append(_chunks(g, window))
                else:
                    pos = torch.arange(longest, device=g.index.device)
                    band = ((pos[:, None] - pos[None, :]).abs() <= window)[None, None]
                    plans.append(band if g.mask is None else band & g.mask)
            self.local[window] = plans
        return self.local[window]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int = 0) -> torch.Tensor:
        """Each prompt's rows attending to its own rows (only those within ``window``
        positions when it is not 0): ``[T, H, D]`` in and out."""
        plans = self._local(window) if window else [g.mask for g in self.groups]
        if len(self.groups) == 1 and plans[0] is None and \
                self.groups[0].index.shape[0] == 1:  # one prompt: no padding, no gather
            out = F.scaled_dot_product_attention(*(x.transpose(0, 1)[None] for x in (q, k, v)))
            return out[0].transpose(0, 1)
        out = torch.empty_like(q)
        for g, plan in zip(self.groups, plans):
            if isinstance(plan, _Chunks):
                qp = q[plan.queries].transpose(1, 2)
                kp, vp = (x[plan.keys].transpose(1, 2) for x in (k, v))
                o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=plan.mask)
                valid, rows = plan.valid, plan.rows
            else:
                # [S, L, H, D] -> [S, H, L, D]; the key mask keeps padding out of every row.
                qp, kp, vp = (x[g.index].transpose(1, 2) for x in (q, k, v))
                o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=plan)
                valid, rows = g.valid, g.rows
            o = o.transpose(1, 2).reshape(-1, *q.shape[1:]).index_select(0, valid)
            out.index_copy_(0, rows, o)
        return out


def _group(lens: torch.Tensor, starts: torch.Tensor, seqs: list[int],
           device: torch.device) -> _Group:
    """Prompts ``seqs`` (longest first) padded to the longest."""
    sel = torch.tensor(seqs, dtype=torch.long)
    g_lens, g_starts = lens[sel], starts[sel]
    longest = int(g_lens[0])
    pos = torch.arange(longest)
    ok = pos[None, :] < g_lens[:, None]
    index = torch.where(ok, g_starts[:, None] + pos[None, :], g_starts[:, None])
    valid = torch.nonzero(ok.reshape(-1)).squeeze(1)
    mask = None if bool(ok.all()) else ok.view(len(seqs), 1, 1, longest).to(device)
    return _Group(index.to(device), ok.to(device), mask, valid.to(device),
                  index.reshape(-1).index_select(0, valid).to(device))
