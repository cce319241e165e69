"""A step's rotary positions under Qwen2-VL's multimodal RoPE (M-RoPE).

Hugging Face's ``get_rope_index`` gives each prompt token three positions (temporal,
row, column). Text tokens have the three equal and count on by one; an image of
``rows x cols`` tokens that starts where the positions stand at ``p`` puts its token
``(r, c)`` at ``(p, p + r, p + c)``, and the text after it continues from
``p + max(rows, cols)``. So past all of a request's images a token at index ``i``
turns as plain RoPE at ``i + rope_delta``: decode steps and CUDA graphs keep 1-D
positions. Only a chunk that computes tokens before its request's last image ends
needs the grids (``ScheduledRequest.mrope_grids``); a step with such a chunk runs on
``[3, T]`` positions, which ``RotaryEmbedding.cos_sin`` takes. A video is ``t`` such
grids one after another, slice ``k``'s tokens at time ``p + times[k]`` (Qwen2-VL:
``k``; Qwen2.5-VL: ``k`` seconds-per-slice in ``tokens_per_second`` units), and the
text after it continues past its largest position on any axis.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedserve.scheduler.outputs import MRopeGrid, ScheduledRequest


def grid_positions(start: int, count: int, grids: Sequence[MRopeGrid]) -> torch.Tensor:
    """``[3, count]`` positions of tokens ``start .. start + count - 1`` of a prompt
    whose images before them are ``grids`` (``(first token, rows, cols, times)``, in
    order; a video's slice ``k`` of ``rows x cols`` tokens sits at time ``times[k]``)."""
    index = torch.arange(start, start + count)
    out = index.expand(3, count).clone()
    delta = 0  # what the images so far add to a token's index
    for first, rows, cols, times in grids:
        area = rows * cols
        end = first + len(times) * area
        inside = (index >= first) & (index < end)
        if inside.any():
            j = index[inside] - first
            base = first + delta
            within = j % area
            out[0, inside] = base + torch.tensor(times)[torch.div(j, area, rounding_mode="floor")]
            out[1, inside] = base + torch.div(within, cols, rounding_mode="floor")
            out[2, inside] = base + within % cols
        advance = max(times[-1], rows - 1, cols - 1) + 1 - len(times) * area
        delta += advance
        out[:, index >= end] += advance
    return out


def step_positions(reqs: Sequence[ScheduledRequest], q_lens: Sequence[int],
                   positions: torch.Tensor, seq_idx: torch.Tensor) -> torch.Tensor:
    """``positions`` (token indices, ``[T]``) as M-RoPE turns them: shifted by each
    row's ``rope_delta``, or ``[3, T]`` when a row carries ``mrope_grids``."""
    gridded = [r.mrope_grids is not None for r in reqs]
    deltas = torch.tensor([0 if g else r.rope_delta for r, g in zip(reqs, gridded)])
    shifted = positions + deltas[seq_idx]
    if not any(gridded):
        return shifted
    out = shifted.expand(3, -1).clone()
    first = 0
    for r, q, g in zip(reqs, q_lens, gridded):
        if g:
            out[:, first:first + q] = grid_positions(r.num_computed_tokens, q, r.mrope_grids)
        first += q
    return out
