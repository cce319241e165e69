"""Shared-prefix decode on the native CPU kernel (cascade attention).

Decode attention reads each row's whole context every step; at contexts of 2k tokens
that is about half of a 64-row SmolLM2 decode step on a 2-core CPU. Rows whose block tables
start with the same blocks (requests after one long system prompt, hit in the
prefix cache; the ``n`` samples or beams of one prompt) hold the same K/V there,
so reading it once per row is waste. Here
such a group attends to the shared prefix once per run of rows (the native kernel's
``chunks``: one K/V pass per 16 rows), each row attends to the rest of its context
alone, and the two partial results are merged by their softmax statistics
(max score and sum of exponentials), as vLLM's cascade attention and FlashInfer's
merge-state do on GPUs.

The backend (``CpuNativeBackend``) plans the split once per step, for a pure decode
step's rows and for the decode rows of a step that also carries prefill rows.

The merged result is the same attention summed in another order, within fp32
rounding of the one-pass kernel but not bit-equal to it, so batch-invariant mode
turns it off (``CpuNativeBackend.shared_prefix_min_tokens = 0``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kernels import cpu_native

# A group's shared prefix must cover at least this many tokens (and two rows share
# it) before it is split off: below, the second kernel call and the merge cost more
# than the K/V reads they save (``python bench/shared_prefix.py`` measures both).
MIN_PREFIX_TOKENS = 256


@dataclass
class SharedPrefixPlan:
    """One decode step's split: built once per step, used by every layer."""

    order: torch.Tensor  # rows in groups, group after group
    chunks: torch.Tensor  # runs of rows over ``order`` (offsets)
    prefix_tables: torch.Tensor  # [len(order), W]: each grouped row's table
    prefix_lens: torch.Tensor  # int32 [len(order)]: its group's prefix length
    suffix_tables: torch.Tensor  # [S, W]: each row's table past its prefix
    suffix_lens: torch.Tensor  # int32 [S]: its keys past the prefix
    max_prefix: int
    max_suffix: int

    def counters(self) -> dict[str, int]:
        """What the split saves per layer: rows that read a shared prefix, and prefix
        keys not read again (one read per run of rows instead of one per row)."""
        firsts = self.prefix_lens.index_select(0, self.chunks[:-1].long())
        return {"shared_prefix_steps": 1, "shared_prefix_rows": int(self.order.numel()),
                "shared_prefix_keys_saved": int(self.prefix_lens.sum() - firsts.sum())}


def plan_shared_prefixes(block_table: torch.Tensor, lens: list[int], block_size: int,
                         min_tokens: int = MIN_PREFIX_TOKENS) -> SharedPrefixPlan | None:
    """Group the rows whose tables start with the same block; each group's prefix is
    its leading blocks common to every row, cut to whole blocks that every row's keys
    pass (so each row keeps at least one key of its own). None when no group of two
    or more rows shares ``min_tokens`` or more."""
    tab = block_table.to("cpu", torch.int32)
    if tab.dim() != 2 or tab.shape[0] < 2 or tab.shape[1] == 0 or min_tokens <= 0:
        return None
    by_first: dict[int, list[int]] = {}
    for row, (first, n) in enumerate(zip(tab[:, 0].tolist(), lens, strict=True)):
        if n > min_tokens:
            by_first.setdefault(first, []).append(row)
    groups: list[tuple[list[int], int]] = []
    for rows in by_first.values():
        if len(rows) < 2:
            continue
        sub = tab[rows]
        common = int((sub == sub[0]).all(dim=0).to(torch.int32).cumprod(0).sum())
        blocks = min(common, (min(lens[r] for r in rows) - 1) // block_size)
        if blocks * block_size >= min_tokens:
            groups.append((rows, blocks * block_size))
    if not groups:
        return None
    order = torch.tensor([r for rows, _ in groups for r in rows])
    prefix = torch.zeros(tab.shape[0], dtype=torch.int32)
    for rows, p in groups:
        prefix[rows] = p
    width = tab.shape[1]
    cols = torch.arange(width).unsqueeze(0) + (prefix // block_size).unsqueeze(1)
    suffix_tables = torch.where(cols < width, tab.gather(1, cols.clamp(max=width - 1)), -1)
    suffix_lens = torch.tensor(lens, dtype=torch.int32) - prefix
    prefix_lens = prefix.index_select(0, order)
    return SharedPrefixPlan(
        order, cpu_native.row_chunks([len(r) for r, _ in groups]),
        tab.index_select(0, order), prefix_lens, suffix_tables.contiguous(), suffix_lens,
        int(prefix_lens.max()), int(suffix_lens.max()))


def merge_attention(o1: torch.Tensor, s1: torch.Tensor, o2: torch.Tensor,
                    s2: torch.Tensor) -> torch.Tensor:
    """Attention over two disjoint key ranges, each ``o [S, H, D]`` normalised with its
    softmax statistics ``s [S, H, 2]`` (max score, sum of exp), as one softmax over both."""
    m = torch.maximum(s1[..., 0], s2[..., 0])
    a = s1[..., 1] * torch.exp(s1[..., 0] - m)
    b = s2[..., 1] * torch.exp(s2[..., 0] - m)
    total = a + b
    return o1 * (a / total).unsqueeze(-1) + o2 * (b / total).unsqueeze(-1)


def shared_prefix_decode(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         plan: SharedPrefixPlan, scale: float,
                         softcap: float | None = None) -> torch.Tensor:
    """Decode attention [S, Hq, D] of ``q`` per ``plan``: each group's prefix once per
    run of rows, each row's remainder alone, merged (fp32 throughout; a ``softcap``
    caps every score, so each part's statistics are of capped scores)."""
    s, hq, _ = q.shape
    q32 = q.float()
    s2 = torch.empty(s, hq, 2)
    out = cpu_native.paged_decode(q32, key_cache, value_cache, plan.suffix_tables,
                                  plan.suffix_lens, plan.max_suffix, scale, stats=s2,
                                  softcap=softcap)
    n = plan.order.numel()
    s1 = torch.empty(n, hq, 2)
    o1 = cpu_native.paged_decode(q32.index_select(0, plan.order), key_cache, value_cache,
                                 plan.prefix_tables, plan.prefix_lens, plan.max_prefix, scale,
                                 chunks=plan.chunks, stats=s1, softcap=softcap)
    merged = merge_attention(o1, s1, out.index_select(0, plan.order),
                             s2.index_select(0, plan.order))
    out.index_copy_(0, plan.order, merged)
    return out if q.dtype == torch.float32 else out.to(q.dtype)
