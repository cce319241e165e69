"""Long prompt chunks of latent attention through keys and values rebuilt per head
(vLLM's MLA prefill), the other rows through the latent itself.

The absorbed form (``deepseek.MLAAttention``) scores a query against a key with
``kv_lora_rank + qk_rope_head_dim`` numbers a head (576 in V3) and sums values as
wide. Rebuilding each key's per-head key and value from the latent through
``kv_b_proj`` (``kv_lora_rank x (nope + v)`` a head and key) lets attention use
``nope + rope`` numbers a score and ``v`` a value (192 and 128 in V3): 3.6x
fewer attention FLOPs, for a rebuild whose cost grows with the keys, not with
the queries. So a sequence whose chunk has more queries than the break-even
count (``decompress_above``: 158 at V3's sizes) attends densely over its rebuilt
keys and values (its context's latents and the chunk's own, stored first), and
every other row (decodes, verification rows, short chunks) attends in the
latent through the paged kernels. Only steps with prompt chunks split; decode
steps (and their CUDA graphs) never do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedserve.kernels.metadata import VarlenMetadata, build_varlen_metadata
from pagedserve.worker.layers.attention import AttentionMetadata
from pagedserve.worker.mla_config import MLAConfig


def decompress_above(mla: MLAConfig) -> float:
    """Queries a chunk needs before rebuilding its keys costs fewer FLOPs than scoring
    them in the latent: ``R (nope + v) / (2 (R + rope) - (nope + rope + v))``."""
    r, rope, nope, v = mla.kv_lora_rank, mla.qk_rope_head_dim, mla.qk_nope_head_dim, \
        mla.v_head_dim
    return r * (nope + v) / max(2 * (r + rope) - (nope + rope + v), 1)


@dataclass(frozen=True)
class StepSplit:
    """A step's rows cut into the two paths: ``dense`` sequences as (first token row,
    queries, keys), their token rows ``dense_rows`` and the cache slots of all their
    keys ``key_slots`` (in order); the other sequences' token rows ``latent_rows``
    with their own varlen metadata and block table rows."""

    dense: tuple[tuple[int, int, int], ...]
    dense_rows: torch.Tensor
    key_slots: torch.Tensor
    latent_rows: torch.Tensor
    latent_md: VarlenMetadata | None
    latent_table: torch.Tensor


def step_split(md: AttentionMetadata, block_size: int, above: float) -> StepSplit | None:
    """The step's split (computed once a step, kept on ``md``); None when no sequence
    has more than ``above`` queries (every row stays in the latent)."""
    cached = md.__dict__.get("_mla_split")
    if cached is not None and cached[0] == above:
        return cached[1]
    assert md.varlen is not None
    q_lens, k_lens = md.varlen.host_query_lens(), md.varlen.host_key_lens()
    dense, dense_rows, latent_seqs, latent_rows = [], [], [], []
    key_seq, key_pos = [], []
    start = 0
    for s, (q, k) in enumerate(zip(q_lens, k_lens, strict=True)):
        rows = range(start, start + q)
        if q > above:
            dense.append((start, q, k))
            dense_rows.extend(rows)
            key_seq.extend([s] * k)
            key_pos.extend(range(k))
        else:
            latent_seqs.append(s)
            latent_rows.extend(rows)
        start += q
    split = None
    if dense:
        dev = md.block_table.device
        seq = torch.tensor(key_seq, dtype=torch.long, device=dev)
        pos = torch.tensor(key_pos, dtype=torch.long, device=dev)
        blocks = md.block_table[seq, pos // block_size].long()
        idx = torch.tensor(latent_seqs, dtype=torch.long, device=dev)
        split = StepSplit(
            tuple(dense), torch.tensor(dense_rows, dtype=torch.long, device=dev),
            blocks * block_size + pos % block_size,
            torch.tensor(latent_rows, dtype=torch.long, device=dev),
            build_varlen_metadata([q_lens[s] for s in latent_seqs],
                                  [k_lens[s] for s in latent_seqs], dev)
            if latent_seqs else None,
            md.block_table.index_select(0, idx))
    md.__dict__["_mla_split"] = (above, split)
    return split


def dense_chunks(q_nope: torch.Tensor, q_pe: torch.Tensor, latents: torch.Tensor,
                 w_uk: torch.Tensor, w_uv: torch.Tensor, split: StepSplit, rank: int,
                 scale: float) -> torch.Tensor:
    """``[rows, H, v]`` for the dense sequences' query rows: ``q_nope [rows, H, nope]``,
    ``q_pe [rows, H, rope]`` (turned), ``latents [keys, R + rope]`` (their keys in
    order), ``w_uk [H, nope, R]``, ``w_uv [H, v, R]``."""
    h, nope, _ = w_uk.shape
    c, k_pe = latents[:, :rank], latents[:, rank:]
    k_nope = (c @ w_uk.reshape(h * nope, rank).T).view(-1, h, nope)
    v = (c @ w_uv.reshape(-1, rank).T).view(-1, h, w_uv.shape[1])
    k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, h, -1)], dim=-1)
    q = torch.cat([q_nope, q_pe], dim=-1)
    out = q.new_empty(q.shape[0], h, w_uv.shape[1])
    row = key = 0
    for _, n_q, n_k in split.dense:
        qs = q[row:row + n_q].transpose(0, 1)
        ks, vs = k[key:key + n_k].transpose(0, 1), v[key:key + n_k].transpose(0, 1)
        # Bottom-right causal: query i of n_q sees keys up to n_k - n_q + i.
        mask = None
        if n_q != n_k:
            mask = torch.arange(n_k, device=q.device)[None, :] \
                <= torch.arange(n_k - n_q, n_k, device=q.device)[:, None]
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None,
                                           scale=scale)
        out[row:row + n_q] = o.transpose(0, 1)
        row, key = row + n_q, key + n_k
    return out
