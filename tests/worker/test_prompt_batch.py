"""Encoder attention over a step's whole prompts (``worker.models.prompt_batch``):
every plan (one prompt unpadded, padded groups, a banded mask, query chunks) equals
each prompt's own dense SDPA with the band written out."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.worker.models.prompt_batch import CHUNKED_FROM, PromptBatch, _Chunks


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int],
               window: int) -> torch.Tensor:
    out, start = [], 0
    for n in lens:
        pos = torch.arange(n)
        mask = (pos[:, None] - pos[None, :]).abs() <= window if window else None
        qs, ks, vs = (x[start:start + n].transpose(0, 1) for x in (q, k, v))
        out.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask).transpose(0, 1))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("lens", [[70], [9], [1, 5, 9, 17, 33, 70, 71, 2], [64, 40, 3]])
@pytest.mark.parametrize("window", [0, 4])
def test_every_plan_equals_each_prompts_dense_attention(lens: list[int], window: int) -> None:
    torch.manual_seed(sum(lens) + window)
    t = sum(lens)
    q, k, v = (torch.randn(t, 3, 8) for _ in range(3))
    batch = PromptBatch.of_lengths(lens, torch.device("cpu"))
    got = batch.attend(q, k, v, window)
    torch.testing.assert_close(got, _reference(q, k, v, lens, window), rtol=0, atol=1e-5)
    if window and max(lens) > CHUNKED_FROM * window:  # the long group ran in chunks
        assert any(isinstance(p, _Chunks) for p in batch.local[window])
    assert torch.equal(batch.attend(q, k, v, window), got)  # (the plan is kept, unchanged)
