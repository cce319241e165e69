"""Helpers of the torch backend: windowed tables re-based to the keys a window reaches,
and SDPA with Gemma 2's score softcap and GPT-OSS's attention sinks written out (SDPA
has no hook for either)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def window_tables(block_table: torch.Tensor, lens: torch.Tensor, lens_host: list[int],
                  window: int, block_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Decode rows re-based to the first block their window reaches: each row's table
    starts there and its length shrinks by the blocks dropped, so a long context
    gathers only ``window + block_size - 1`` keys at most, and blocks before the
    window (possibly already freed, -1) are never read."""
    first = [max(0, n - window) // block_size for n in lens_host]
    if not any(first):
        return block_table, lens, lens_host
    tables, lens_host = rebase_tables(block_table, first, lens_host, block_size)
    base = torch.tensor(first, device=lens.device) * block_size
    return tables, lens - base, lens_host


def rebase_tables(tables: torch.Tensor, first: list[int], lens: list[int], block_size: int
                  ) -> tuple[torch.Tensor, list[int]]:
    """Row ``s`` of ``tables`` from its block ``first[s]`` on, and each length less the
    ``first[s] * block_size`` keys dropped."""
    width = max(max(-(-n // block_size) - f for n, f in zip(lens, first)), 1)
    offs = torch.tensor(first, device=tables.device)
    idx = offs[:, None] + torch.arange(width, device=tables.device)[None, :]
    rebased = tables.gather(1, idx.clamp_max(tables.shape[1] - 1))
    return rebased, [n - f * block_size for n, f in zip(lens, first)]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          causal: bool, scale: float, softcap: float | None,
          sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``scaled_dot_product_attention`` of ``q [.., Hq, Lq, D]`` over ``k, v [.., Hkv, Lk,
    D]`` (GQA by head groups). With a ``softcap`` (Gemma 2) or ``sinks`` (GPT-OSS), which
    SDPA has no hook for, the same steps written out as transformers' eager attention
    does them: the scaled scores capped to ``softcap * tanh(s / softcap)``, then masked,
    each head's sink logit appended as one more column, an fp32 softmax, the sink's
    share dropped, and the values. ``sinks`` comes shaped to broadcast against the
    scores' ``[.., Hq, Lq, 1]`` (the caller knows how it laid out the heads)."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              scale=scale, enable_gqa=k.shape[-3] != q.shape[-3])
    g = q.shape[-3] // k.shape[-3]
    if g > 1:
        k, v = k.repeat_interleave(g, dim=-3), v.repeat_interleave(g, dim=-3)
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if causal:
        tri = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~tri, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ v
    lk = s.shape[-1]
    s = torch.cat([s.float(), sinks.float().expand(*s.shape[:-1], 1)], dim=-1)
    return torch.softmax(s, dim=-1)[..., :lk].to(q.dtype) @ v
