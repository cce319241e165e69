"""Paged varlen attention with bidirectional spans: Gemma 3's image tokens.

Gemma 3 lets the tokens of one image attend to each other in both directions
(transformers' ``create_masks_for_vision_model``): full-attention layers use
OR(causal, same image), sliding layers AND(window, OR(causal, same image)). The
paged backends are causal only, so a step that prefills image tokens runs its
attention here instead: pure torch, any device, one sequence at a time (a step
with images is a prefill, where the per-sequence loop is a small cost).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedserve.kernels.backend import AttentionBackend
from pagedserve.kernels.kv_quant import dequantize, storage_view
from pagedserve.kernels.metadata import VarlenMetadata
from pagedserve.kernels.torch_ops import sdpa


def _check_spans(spans: Sequence[Sequence[tuple[int, int]]], k_lens: list[int]) -> None:
    if len(spans) != len(k_lens):
        raise ValueError(f"spans has {len(spans)} entries but the batch has {len(k_lens)} "
                         "sequences")
    for s, (seq_spans, k_len) in enumerate(zip(spans, k_lens)):
        for a, b in seq_spans:
            if not 0 <= a < b <= k_len:
                raise ValueError(f"spans[{s}] has ({a}, {b}): a span must satisfy "
                                 f"0 <= start < end <= k_len ({k_len})")


def _span_mask(q_len: int, k_len: int, k0: int, spans: Sequence[tuple[int, int]],
               window: int | None, device: torch.device) -> torch.Tensor:
    """[q_len, k_len - k0] visibility of keys ``k0..k_len-1`` from the step's queries."""
    p = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    j = torch.arange(k0, k_len, device=device)[None, :]
    vis = j <= p
    for a, b in spans:
        if b > k_len - q_len:  # spans wholly before the first query change nothing
            vis |= ((p >= a) & (p < b)) & ((j >= a) & (j < b))
    if window is not None:
        vis &= j > p - window
    return vis


def _gather(cache: torch.Tensor, table: torch.Tensor, k0: int, k_len: int,
            dtype: torch.dtype) -> torch.Tensor:
    """Keys ``k0..k_len-1`` (``k0`` a block boundary) of one table row -> [Hkv, L, D]."""
    _, bsz, hkv, d = cache.shape
    idx = table[k0 // bsz : -(-k_len // bsz)].to(cache.device, torch.long)
    raw = storage_view(cache).index_select(0, idx).view(cache.dtype)  # fp8 moves as bytes
    return dequantize(raw.reshape(-1, hkv, d)[: k_len - k0], dtype).transpose(0, 1)


def varlen_attention_spans(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    md: VarlenMetadata,
    scale: float,
    spans: Sequence[Sequence[tuple[int, int]]],
    window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged varlen attention of ``q [T, Hq, D]`` where each sequence's ``spans``
    (``[start, end)`` absolute positions, e.g. one image's tokens) are bidirectional.

    Query ``i`` of sequence ``s`` sits at ``p = k_len - q_len + i`` and sees key ``j``
    iff ``j < k_len``, ``j <= p`` or one span holds both, and (with a ``window``)
    ``j > p - window``; ``softcap`` caps the scaled scores before the softmax, ``sinks``
    ``[Hq]`` join it as zero-valued logits (``AttentionBackend.varlen_attention``). A
    span may start in cached context but must end by ``k_len`` (its later keys
    would be missing). Rows without a visible key (``p < 0``) and rows past the
    batch's queries are zero. Returns ``[T, Hq, D]`` in ``q``'s dtype. With ``out``
    (the batch through a causal kernel), only sequences with spans are computed here,
    written over their rows of ``out``: the rest of a mixed batch keeps the fast path.
    """
    AttentionBackend.check_window(window, softcap)
    q_lens, k_lens = md.host_query_lens(), md.host_key_lens()
    _check_spans(spans, k_lens)
    # fp16/bf16 matmuls on CPU are slow and lose accuracy; elsewhere keep q's dtype.
    cdt = q.dtype
    if q.device.type == "cpu" and q.dtype in (torch.float16, torch.bfloat16):
        cdt = torch.float32
    bsz = key_cache.shape[1]
    only_spans = out is not None
    if out is None:
        out = q.new_zeros(q.shape)
    start = 0
    for s, (q_len, k_len) in enumerate(zip(q_lens, k_lens)):
        rows = slice(start, start + q_len)
        start += q_len
        if q_len == 0 or k_len == 0 or (only_spans and not spans[s]):
            continue
        # With a window, keys before the first query's window are never visible: start
        # the gather at their block (earlier blocks may already be freed, -1).
        k0 = 0 if window is None else max(0, k_len - q_len - window + 1) // bsz * bsz
        table = block_table[s]
        k = _gather(key_cache, table, k0, k_len, cdt)
        v = _gather(value_cache, table, k0, k_len, cdt)
        mask = _span_mask(q_len, k_len, k0, spans[s], window, q.device)
        dead = max(0, q_len - k_len)  # queries before position 0 see no key
        if dead:
            mask[:dead, 0] = True  # keeps the softmax finite; the rows are zeroed below
        o = sdpa(q[rows].to(cdt).transpose(0, 1), k, v, mask, False, scale, softcap,
                 None if sinks is None else sinks.view(-1, 1, 1))
        o = o.transpose(0, 1)
        if dead:
            o[:dead] = 0
        out[rows] = o.to(q.dtype)
    return out
