"""Shared-prefix (cascade) decode on the native CPU kernel (``kernels/cpu_cascade.py``).

Rows whose block tables start with the same blocks attend to that prefix once per run
of rows and to the rest alone; the two halves merge by their softmax statistics.
Checked against attention computed in float64 from the very cache rows each row
reads (shared blocks hold one sequence's K/V, so a contiguous per-sequence oracle
would not describe them), for the split plan itself, and in an engine whose requests
share a prompt.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import available_backends, cpu_cascade, cpu_native
from pagedserve.kernels.cpu_backend import CpuNativeBackend
from pagedserve.kernels.metadata import build_varlen_metadata

pytestmark = pytest.mark.skipif(
    "cpu" not in available_backends("cpu"), reason="no C compiler for the native kernel"
)
B = 16


def shared_batch(lens: list[int], shared_blocks: list[int], heads: int = 9, kv_heads: int = 3,
                 head_dim: int = 64, kv_dtype: torch.dtype = torch.float32, seed: int = 0):
    """q, caches and a block table in which row r's first ``shared_blocks[r]`` blocks are
    the same physical blocks for every row (the rest its own, scattered)."""
    g = torch.Generator().manual_seed(seed)
    common = max(shared_blocks)
    need = [-(-n // B) for n in lens]
    own = [n - s for n, s in zip(need, shared_blocks, strict=True)]
    num_blocks = common + sum(own) + 2
    perm = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.full((len(lens), max(need) + 1), -1, dtype=torch.int32)
    nxt = common
    for r, (s, o) in enumerate(zip(shared_blocks, own, strict=True)):
        table[r, :s + o] = torch.tensor(perm[:s] + perm[nxt:nxt + o])
        nxt += o
    kc = torch.randn(num_blocks, B, kv_heads, head_dim, generator=g).to(kv_dtype)
    vc = torch.randn(num_blocks, B, kv_heads, head_dim, generator=g).to(kv_dtype)
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    return q, kc, vc, table


def reference(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, table: torch.Tensor,
              lens: list[int], scale: float, softcap: float | None = None) -> torch.Tensor:
    """float64 attention of each row over the cache rows its table names (scores
    capped to ``softcap * tanh(s / softcap)`` when given)."""
    group = q.shape[1] // kc.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for r, n in enumerate(lens):
        slots = [int(table[r, t // B]) * B + t % B for t in range(n)]
        k = kc.reshape(-1, *kc.shape[2:])[slots].double().repeat_interleave(group, 1)
        v = vc.reshape(-1, *vc.shape[2:])[slots].double().repeat_interleave(group, 1)
        s = torch.einsum("hd,thd->ht", q[r].double(), k) * scale
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        w = torch.softmax(s, dim=-1)
        out[r] = torch.einsum("ht,thd->hd", w, v)
    return out


def test_plan_groups_rows_by_their_common_leading_blocks() -> None:
    # Rows 0-2 share 40 blocks (row 2 only 30 of them), row 3 shares 40 with none
    # (its first block is its own), rows 4-5 are identical tables of equal length (n
    # samples right after their fork): their prefix stops a block short of the end.
    lens = [700, 650, 900, 700, 320, 320]
    *_, table = shared_batch(lens, [40, 40, 30, 0, 20, 20])
    table[4:6, :20] = table[0, 40:44].repeat(5)[:20]  # rows 4-5: a prefix of their own
    table[5] = table[4]
    plan = cpu_cascade.plan_shared_prefixes(table, lens, B, min_tokens=64)
    assert plan is not None
    assert plan.order.tolist() == [0, 1, 2, 4, 5]
    assert plan.prefix_lens.tolist() == [480, 480, 480, 304, 304]
    assert plan.suffix_lens.tolist() == [220, 170, 420, 700, 16, 16]
    # Each row's remaining table starts right after its prefix.
    assert plan.suffix_tables[0, 0] == table[0, 30]
    assert plan.suffix_tables[3].tolist() == table[3].tolist()
    # Below the threshold, or without two rows sharing, there is nothing to split.
    assert cpu_cascade.plan_shared_prefixes(table, lens, B, min_tokens=500) is None
    assert cpu_cascade.plan_shared_prefixes(table[3:4], lens[3:4], B, min_tokens=64) is None
    # What it saves: each run (here one per group) reads its prefix once, not per row.
    assert plan.counters() == {"shared_prefix_steps": 1, "shared_prefix_rows": 5,
                               "shared_prefix_keys_saved": 480 * 2 + 304 * 1}


def test_plan_counters_count_one_prefix_read_per_run_of_rows() -> None:
    # 20 rows sharing 25 blocks: runs of 16 and 4 rows, two prefix reads of 400 keys.
    lens = [450] * 20
    *_, table = shared_batch(lens, [25] * 20)
    plan = cpu_cascade.plan_shared_prefixes(table, lens, B)
    assert plan is not None and plan.chunks.tolist() == [0, 16, 20]
    assert plan.counters()["shared_prefix_keys_saved"] == 400 * (20 - 2)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128)])
def test_shared_prefix_decode_matches_float64_attention(kv_dtype: torch.dtype, heads: int,
                                                        kv_heads: int, head_dim: int) -> None:
    # 37 rows sharing 35 blocks (two runs of 16 and a tail), ragged lengths; plus three
    # rows that share nothing (one of a single key).
    lens = [600 + 13 * i for i in range(37)] + [300, 17, 1]
    shared = [35] * 37 + [0, 0, 0]
    q, kc, vc, table = shared_batch(lens, shared, heads, kv_heads, head_dim, kv_dtype)
    scale = head_dim ** -0.5
    plan = cpu_cascade.plan_shared_prefixes(table, lens, B)
    assert plan is not None and plan.order.numel() == 37
    got = cpu_cascade.shared_prefix_decode(q, kc, vc, plan, scale)
    want = reference(q, kc, vc, table, lens, scale)
    assert (got.double() - want).abs().max() < 1e-5


def test_shared_prefix_decode_with_a_softcap_merges_capped_statistics() -> None:
    # Gemma 2: each half's softmax statistics are of capped scores, so the merge is
    # still one softmax over capped scores (queries scaled so most scores are capped).
    lens = [300 + 7 * i for i in range(20)] + [40]
    q, kc, vc, table = shared_batch(lens, [16] * 20 + [0], 8, 4, 128, seed=4)
    q = q * 6.0
    plan = cpu_cascade.plan_shared_prefixes(table, lens, B)
    assert plan is not None
    got = cpu_cascade.shared_prefix_decode(q, kc, vc, plan, 128 ** -0.5, softcap=2.5)
    want = reference(q, kc, vc, table, lens, 128 ** -0.5, softcap=2.5)
    assert (got.double() - want).abs().max() < 1e-5
    uncapped = reference(q, kc, vc, table, lens, 128 ** -0.5)
    assert (got.double() - uncapped).abs().max() > 0.05


def test_merge_of_two_key_ranges_is_one_softmax() -> None:
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(5, 3, 40, generator=g) * 4
    v = torch.randn(5, 3, 40, 8, generator=g)

    def part(lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = scores[..., lo:hi]
        m = s.max(-1).values
        e = torch.exp(s - m.unsqueeze(-1))
        o = torch.einsum("sht,shtd->shd", e / e.sum(-1, keepdim=True), v[:, :, lo:hi])
        return o, torch.stack([m, e.sum(-1)], dim=-1)

    whole, _ = part(0, 40)
    merged = cpu_cascade.merge_attention(*part(0, 29), *part(29, 40))
    assert (merged - whole).abs().max() < 1e-5


def test_backend_splits_decode_steps_with_a_shared_prefix_only() -> None:
    lens = [520 + 9 * i for i in range(20)]
    q, kc, vc, table = shared_batch(lens, [30] * 20)
    scale = 0.125
    lens_t = torch.tensor(lens)
    be, off = CpuNativeBackend(), CpuNativeBackend()
    off.shared_prefix_min_tokens = 0
    got = be.decode_attention(q, kc, vc, table, lens_t, scale)
    assert be._prefix.get(table)[1] is not None  # split: 480 shared tokens >= 256
    plain = off.decode_attention(q, kc, vc, table, lens_t, scale)
    assert off._prefix.get(table) is None  # (never planned)
    assert (got - plain).abs().max() < 1e-5
    # A step whose rows share nothing is planned once (None) and runs plain.
    q2, kc2, vc2, table2 = shared_batch(lens, [0] * 20)
    assert torch.equal(be.decode_attention(q2, kc2, vc2, table2, lens_t, scale),
                       cpu_native.paged_decode(q2, kc2, vc2, table2, lens_t, max(lens),
                                               scale))
    assert be._prefix.get(table2)[1] is None


def test_layers_alternating_tables_reuse_each_tables_plan(monkeypatch) -> None:
    """A hybrid model's layers switch between their KV cache groups' tables within a
    step: each table is planned once, not at every switch."""
    lens = [520 + 9 * i for i in range(8)]
    q, kc, vc, table = shared_batch(lens, [30] * 8)
    table2 = table.clone()
    made: list[torch.Tensor] = []
    real = cpu_cascade.plan_shared_prefixes
    monkeypatch.setattr(cpu_cascade, "plan_shared_prefixes",
                        lambda t, *a: made.append(t) or real(t, *a))
    be = CpuNativeBackend()
    lens_t = torch.tensor(lens)
    outs = [be.decode_attention(q, kc, vc, t, lens_t, 0.125)
            for t in (table, table2, table, table2, table)]
    assert [t is table for t in made] == [True, False]
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_mixed_steps_split_their_decode_rows_too() -> None:
    # Six decode rows sharing 30 blocks beside a 40-token prefill: the decode rows go
    # through the split, the prefill through the native rows, in one varlen call.
    dec = [520 + 9 * i for i in range(6)]
    _, kc, vc, table = shared_batch([*dec, 40], [30] * 6 + [0])
    q_lens, k_lens = [1] * 6 + [40], [*dec, 40]
    q = torch.randn(sum(q_lens), 9, 64, generator=torch.Generator().manual_seed(3))
    md = build_varlen_metadata(q_lens, k_lens)
    be, off = CpuNativeBackend(), CpuNativeBackend()
    off.shared_prefix_min_tokens = 0
    got = be.varlen_attention(q, kc, vc, table, md, 0.125)
    split = be._mixed.get(table)[2]
    assert split is not None and split[0] == list(range(6))
    plain = off.varlen_attention(q, kc, vc, table, md, 0.125)
    assert off._mixed.get(table) is None
    assert (got - plain).abs().max() < 1e-5
    assert torch.equal(got[6:], plain[6:])  # the prefill rows: the same kernel call
