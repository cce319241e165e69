"""Dense oracle: causal attention over contiguous K/V, independent of paging.

Tests compare every paged backend against this. It is deliberately naive (a
per-sequence loop, float64 math, explicit mask) so that it shares no code or
tricks with the backends it checks.
"""

from __future__ import annotations

import torch


def dense_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_lens: list[int],
    key_lens: list[int],
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed q [Tq, Hq, D], contiguous packed k/v [Tk, Hkv, D] -> [Tq, Hq, D].

    Bottom-right aligned causal mask (flash-attn convention): query ``i`` of a
    sequence attends to key ``j`` iff ``j <= i + k_len - q_len``; with a sliding
    ``window`` also iff ``j > i + k_len - q_len - window`` (the query's own key and
    the ``window - 1`` before it, as Hugging Face's Mistral masks); a ``softcap`` maps
    each scaled score ``s`` to ``softcap * tanh(s / softcap)`` (Gemma 2); ``sinks``
    ``[Hq]`` add one more logit per head to every row's softmax, whose value is zero
    (GPT-OSS; Hugging Face's eager attention concatenates them so). Rows with no
    visible key are zero. Query head ``h`` reads kv head ``h // (Hq // Hkv)``.
    """
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv:
        raise ValueError(f"query heads {hq} not a multiple of kv heads {hkv}")
    out = torch.zeros(q.shape, dtype=torch.float64)
    qo = ko = 0
    for lq, lk in zip(query_lens, key_lens):
        qs = q[qo : qo + lq].double().transpose(0, 1)  # [Hq, lq, D]
        ks = k[ko : ko + lk].double().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        vs = v[ko : ko + lk].double().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        if lq and lk:
            scores = (qs @ ks.transpose(1, 2)) * scale  # [Hq, lq, lk]
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            i = torch.arange(lq)[:, None]
            j = torch.arange(lk)[None, :]
            visible = j <= i + (lk - lq)
            if window is not None:
                visible &= j > i + (lk - lq) - window
            scores = scores.masked_fill(~visible, float("-inf"))
            if sinks is not None:
                sink = sinks.double()[:, None, None].expand(hq, lq, 1)
                scores = torch.cat([scores, sink], dim=-1)
            probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)[..., :lk]
            out[qo : qo + lq] = (probs @ vs).transpose(0, 1)
        qo += lq
        ko += lk
    return out.to(q.dtype)
