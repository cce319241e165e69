"""Top-k / top-p truncation and categorical draws over a batch of logits rows.

Kept apart from :mod:`sampler` (which holds per-request state) because this is
pure tensor math with one contract: every operation is row-wise, using only
kernels that never split a row across threads (topk, sort, softmax, cumsum,
searchsorted; no sum/logsumexp reductions), so a row's result is bitwise the
same alone or in any batch. That is what makes seeded requests reproducible.

Most rows are truncated (top-k and/or top-p), so their work is done on a
window of their most likely tokens (``top_k`` of them, or ``TOP_P_WINDOW``)
instead of the 49k vocabulary: one ``topk`` replaces a full sort. A top-p row
whose nucleus does not fit in its window (a very flat distribution) falls back
to the exact full-vocabulary path. A top-k window is exactly ``k`` wide, so
tokens tied with the k-th are not all kept (HF keeps ties; vLLM does not).
"""

from __future__ import annotations

import math

import torch

# Top-p rows first look for their nucleus among this many top tokens.
TOP_P_WINDOW = 256
# Larger top-k values run on the full vocabulary (topk cost grows with k).
MAX_TOP_K_WINDOW = 1024


def sample_rows(z: torch.Tensor, top_k: list[int], top_p: list[float], u: torch.Tensor,
                own_row: list[bool]) -> torch.Tensor:
    """One token per row of temperature-scaled logits ``z`` from uniforms ``u`` in [0, 1).

    ``own_row[i]`` asks for row ``i``'s draw to be computed on that row alone
    (seeded requests); the others are drawn in one batched call per window.
    """
    n, v = z.shape
    windows: dict[int, list[int]] = {}
    rest: list[int] = []
    for i in range(n):
        w = _window(top_k[i], top_p[i], v)
        if w:
            windows.setdefault(w, []).append(i)
        else:
            rest.append(i)
    out = torch.empty(n, dtype=torch.long, device=z.device)
    for w, rows in windows.items():
        rows_t = torch.tensor(rows, device=z.device)
        zw = z if len(rows) == n else z.index_select(0, rows_t)
        ks = [top_k[i] if 0 < top_k[i] < v else 0 for i in rows]
        tokens, covered = _sample_window(zw, ks, [top_p[i] for i in rows], u[rows_t],
                                         [own_row[i] for i in rows], w)
        out[rows_t] = tokens
        rest += [rows[j] for j, ok in enumerate(covered.tolist()) if not ok]
    if len(rest) == n:
        return _sample_full(z, [k if 0 < k < v else 0 for k in top_k], top_p, u, own_row)
    if rest:
        rest.sort()
        rest_t = torch.tensor(rest, device=z.device)
        out[rest_t] = _sample_full(z.index_select(0, rest_t),
                                   [top_k[i] if 0 < top_k[i] < v else 0 for i in rest],
                                   [top_p[i] for i in rest], u[rest_t], [own_row[i] for i in rest])
    return out


def _window(top_k: int, top_p: float, v: int) -> int:
    """Candidate window of a row, from its own parameters only (never from the batch).

    Kernels such as softmax sum in a length-dependent order, so a row must see
    the same window length alone or batched to stay bitwise reproducible.
    """
    if 0 < top_k < v:
        return top_k if top_k <= MAX_TOP_K_WINDOW else 0
    return min(v, TOP_P_WINDOW) if top_p < 1.0 and v > TOP_P_WINDOW else 0


def _sample_window(z: torch.Tensor, ks: list[int], ps: list[float], u: torch.Tensor,
                   own_row: list[bool], w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw within each row's top-``w`` tokens; also says which rows the window covers."""
    dev = z.device
    vals, ids = z.topk(w, dim=-1)
    # Top-k rows (k == w): the window is their whole support, renormalised.
    probs = torch.softmax(vals, dim=-1) if any(ks) else torch.empty_like(vals)
    no_k = [j for j, k in enumerate(ks) if k == 0]
    if no_k:  # top-p only: probabilities are relative to the whole vocabulary
        if len(no_k) == len(ks):
            probs = torch.softmax(z, dim=-1).gather(1, ids)
        else:
            no_k_t = torch.tensor(no_k, device=dev)
            full = torch.softmax(z.index_select(0, no_k_t), dim=-1)
            probs[no_k_t] = full.gather(1, ids.index_select(0, no_k_t))
    p_t = torch.tensor(ps, device=dev, dtype=probs.dtype)
    cum = probs.cumsum(dim=-1)
    covered = (p_t >= 1.0) | (cum[:, -1] >= p_t)
    keep = (cum - probs) < torch.where(p_t >= 1.0, torch.inf, p_t)[:, None]
    keep[:, 0] = True
    probs.masked_fill_(~keep, 0.0)
    pos = _draw(probs, u, own_row)
    return ids.gather(1, pos[:, None]).squeeze(1), covered


def _sample_full(z: torch.Tensor, ks: list[int], ps: list[float], u: torch.Tensor,
                 own_row: list[bool]) -> torch.Tensor:
    """Exact path over the full vocabulary (no truncation, wide top-k or wide nucleus)."""
    return _draw(truncated_probs(z, ks, ps), u, own_row)


def truncated_probs(z: torch.Tensor, ks: list[int], ps: list[float]) -> torch.Tensor:
    """Each row's distribution over the whole vocabulary, as the samplers draw from it:
    temperature-scaled logits ``z`` cut to the top ``ks[i]`` (0: all) and to the
    nucleus of mass ``ps[i]``, unnormalised after the nucleus cut (``inverse_cdf``
    takes that; divide by the row sum for probabilities)."""
    dev, v = z.device, z.shape[-1]
    ks = [k if 0 < k < v else 0 for k in ks]
    if any(ks):
        kth_idx = torch.tensor([(k or v) - 1 for k in ks], device=dev)
        kth = z.topk(max(k or v for k in ks), dim=-1).values.gather(1, kth_idx[:, None])
        z = z.masked_fill(z < kth, float("-inf"))
    probs = torch.softmax(z, dim=-1)
    p_rows = [j for j, p in enumerate(ps) if p < 1.0]
    if p_rows:
        rows_t = torch.tensor(p_rows, device=dev)
        vals, order = probs.index_select(0, rows_t).sort(dim=-1, descending=True, stable=True)
        p_t = torch.tensor([ps[j] for j in p_rows], device=dev, dtype=probs.dtype)
        keep = (vals.cumsum(dim=-1) - vals) < p_t[:, None]
        keep[:, 0] = True
        probs[rows_t] = torch.zeros_like(vals).scatter_(1, order, vals * keep)
    return probs


def _draw(probs: torch.Tensor, u: torch.Tensor, own_row: list[bool]) -> torch.Tensor:
    """Inverse-CDF draws; ``own_row`` rows are computed one by one. Consumes ``probs``."""
    out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    batch = [j for j, own in enumerate(own_row) if not own]
    if len(batch) == len(own_row):
        return inverse_cdf(probs, u, in_place=True)
    if batch:
        b = torch.tensor(batch, device=probs.device)
        out[b] = inverse_cdf(probs.index_select(0, b), u[b], in_place=True)
    for j, own in enumerate(own_row):
        if own:
            out[j] = inverse_cdf(probs[j:j + 1], u[j:j + 1], in_place=True)[0]
    return out


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """One draw per row of (unnormalised) ``probs`` from uniforms ``u`` in [0, 1).

    The point ``u * total`` is kept strictly below the total mass, and
    ``searchsorted(right=True)`` returns the first index whose cumulative mass
    exceeds it; that index always has non-zero probability, so masked tokens
    are never drawn.
    """
    cdf = probs.cumsum_(dim=-1) if in_place else probs.cumsum(dim=-1)
    total = cdf[:, -1].clone()
    point = torch.minimum(u.to(cdf.dtype) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, point.unsqueeze(1), right=True).squeeze(1)


def apply_min_p(z: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p`` times their row's largest.

    ``p_i >= min_p * p_max`` is ``z_i >= z_max + log(min_p)`` for softmax
    probabilities, so no softmax is needed, and a row's max is the same alone
    or batched. The likeliest token always survives. Returns a new tensor.
    """
    log_p = torch.tensor([math.log(p) if p > 0 else -math.inf for p in min_p],
                         device=z.device, dtype=z.dtype)
    floor = z.amax(dim=-1) + log_p
    return z.masked_fill(z < floor[:, None], float("-inf"))


def penalize_row(row: torch.Tensor, output_ids: list[int], prompt_ids: list[int],
                 presence: float, frequency: float, repetition: float) -> None:
    """Apply the penalties to one row of logits in place, with vLLM's semantics.

    Repetition (as in HF and vLLM) covers prompt and output tokens: a positive
    logit is divided by the penalty, a negative one multiplied. Frequency and
    presence (as in OpenAI) cover output tokens only: minus ``frequency`` per
    occurrence and ``presence`` once. Row-wise, so seeded draws stay batch-free.
    """
    v, dev = row.shape[0], row.device
    out_t = torch.tensor(output_ids, dtype=torch.long, device=dev)
    if repetition != 1.0 and (output_ids or prompt_ids):
        seen = torch.zeros(v, dtype=torch.bool, device=dev)
        seen[torch.tensor(prompt_ids, dtype=torch.long, device=dev)] = True
        seen[out_t] = True
        row.copy_(torch.where(seen, torch.where(row > 0, row / repetition, row * repetition),
                              row))
    if output_ids and (presence or frequency):
        counts = torch.bincount(out_t, minlength=v)[:v].to(row.dtype)
        row.sub_(counts * frequency + (counts > 0).to(row.dtype) * presence)
