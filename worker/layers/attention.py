"""Paged attention layer: store this step's K/V into the cache, then attend over it.

Keys are only ever read back from the paged cache, so prefill, chunked
prefill and decode share one code path. The per-step metadata is built once
by the model runner and passed down explicitly (no global forward context).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kernels import AttentionBackend, VarlenMetadata


@dataclass
class AttentionMetadata:
    """Everything the attention kernels need for one step, shared by all layers.

    ``is_decode`` is true when every sequence has exactly one new token; then
    ``seq_lens`` (int32 ``[S]``, cached + new) feeds ``decode_attention`` and
    ``varlen`` may be None.
    """

    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    is_decode: bool
    varlen: VarlenMetadata | None = None


class PagedAttention:
    """Scaled dot-product attention of ``q`` over this layer's paged K/V cache."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 backend: AttentionBackend):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.backend = backend

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_cache: tuple[torch.Tensor, torch.Tensor], md: AttentionMetadata
                 ) -> torch.Tensor:
        """``q[T,Hq,D]``, ``k/v[T,Hkv,D]`` -> ``[T, Hq*D]``."""
        key_cache, value_cache = kv_cache
        self.backend.store_kv(k, v, key_cache, value_cache, md.slot_mapping)
        if md.is_decode:
            out = self.backend.decode_attention(
                q, key_cache, value_cache, md.block_table, md.seq_lens, self.scale
            )
        else:
            assert md.varlen is not None, "prefill step without varlen metadata"
            out = self.backend.varlen_attention(
                q, key_cache, value_cache, md.block_table, md.varlen, self.scale
            )
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
