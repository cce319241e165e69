"""varlen_attention_spans (Gemma 3's bidirectional image blocks) against a dense oracle
whose mask is built pair by pair from the rule: key ``j`` is visible from the query at
position ``p`` iff ``j < k_len`` and (``j <= p`` or one span holds both) and (no window
or ``j > p - window``). K/V live in shuffled, -1 padded paged caches with garbage in
the unused slots; the oracle reads them back position by position through the slot
formula, only for visible keys."""

from __future__ import annotations

import math
import random

import pytest
import torch

from pagedserve.kernels import build_varlen_metadata
from pagedserve.kernels.prefix_spans import varlen_attention_spans
from pagedserve.kernels.torch_ref import TorchBackend

B = 4  # block size of every case
SPANS = list[list[tuple[int, int]]]

# (q_len, k_len, spans) per sequence; B = 4.
CASES: list[tuple[int, int, list[tuple[int, int]]]] = [
    (1, 1, []),                  # length 1, no spans
    (4, 4, [(1, 3)]),            # exact multiple of B; span wholly in this step's queries
    (5, 5, [(0, 5)]),            # B + 1; span touching the sequence's start and end
    (3, 9, [(4, 8)]),            # span started in cached context (4, 5 cached)
    (6, 12, [(7, 9), (10, 12)]),  # two spans, the second touching the end
    (0, 0, []),                  # empty sequence
    (0, 5, [(1, 3)]),            # no queries this step
    (2, 8, [(0, 8)]),            # span from position 0, mostly cached
    (1, 7, [(2, 5)]),            # decode after an image: the span changes nothing
    (3, 21, [(16, 20)]),         # long context: a window skips its early blocks
]


def _formula_mask(q_len: int, k_len: int, spans: list[tuple[int, int]],
                  window: int | None) -> list[list[bool]]:
    rows = []
    for i in range(q_len):
        p = k_len - q_len + i
        row = []
        for j in range(k_len):
            ok = j <= p or any(a <= p < b and a <= j < b for a, b in spans)
            if window is not None and not j > p - window:
                ok = False
            row.append(ok)
        rows.append(row)
    return rows


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: list[list[bool]],
           scale: float, softcap: float | None) -> torch.Tensor:
    """float64 attention of q [Lq, Hq, D] over k, v [Lk, Hkv, D] under a Python mask."""
    lq, hq, d = q.shape
    out = torch.zeros(lq, hq, d, dtype=torch.float64)
    if lq == 0:
        return out
    g = hq // k.shape[1]
    for i in range(lq):
        js = [j for j, ok in enumerate(mask[i]) if ok]
        if not js:
            continue
        kk = k[js].double().repeat_interleave(g, 1)  # [n, Hq, D]: head h reads h // g
        vv = v[js].double().repeat_interleave(g, 1)
        s = torch.einsum("hd,nhd->hn", q[i].double(), kk) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        out[i] = torch.einsum("hn,nhd->hd", torch.softmax(s, 1), vv)
    return out


class _Batch:
    """Random q and a paged cache for (q_len, k_len) sequences, K/V stored via store_kv."""

    def __init__(self, seqs: list[tuple[int, int]], hq: int, hkv: int, d: int,
                 dtype: torch.dtype, seed: int, kv_dtype: torch.dtype | None = None) -> None:
        g = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        kv_dtype = kv_dtype or dtype
        self.q_lens = [lq for lq, _ in seqs]
        self.k_lens = [lk for _, lk in seqs]
        need = [-(-lk // B) for lk in self.k_lens]
        num_blocks = sum(need) + 3
        ids = list(range(num_blocks))
        rng.shuffle(ids)
        width = max(need) + 2
        table = []
        for n in need:
            table.append(ids[:n] + [-1] * (width - n))
            ids = ids[n:]
        self.table = torch.tensor(table, dtype=torch.int32)
        self.q = torch.randn(sum(self.q_lens), hq, d, generator=g).to(dtype)
        shape = (num_blocks, B, hkv, d)
        self.kc = (torch.randn(*shape, generator=g) * 30).to(kv_dtype)  # garbage elsewhere
        self.vc = (torch.randn(*shape, generator=g) * 30).to(kv_dtype)
        slots = [table[s][p // B] * B + p % B for s, lk in enumerate(self.k_lens)
                 for p in range(lk)]
        k = torch.randn(len(slots), hkv, d, generator=g).to(dtype)
        v = torch.randn(len(slots), hkv, d, generator=g).to(dtype)
        TorchBackend("cpu").store_kv(k, v, self.kc, self.vc, torch.tensor(slots))
        self.md = build_varlen_metadata(self.q_lens, self.k_lens)
        self.scale = 1.0 / math.sqrt(d)

    def free_outside_window(self, window: int) -> None:
        """Blocks no query of this step reaches through the window become -1 (freed)."""
        for s, (lq, lk) in enumerate(zip(self.q_lens, self.k_lens)):
            self.table[s, : max(0, lk - lq - window + 1) // B] = -1

    def oracle(self, spans: SPANS, window: int | None, softcap: float | None) -> torch.Tensor:
        kc, vc = self.kc.float().flatten(0, 1), self.vc.float().flatten(0, 1)
        outs, start = [], 0
        for s, (lq, lk) in enumerate(zip(self.q_lens, self.k_lens)):
            mask = _formula_mask(lq, lk, spans[s], window)
            seen = {j for row in mask for j, ok in enumerate(row) if ok}
            slot = [int(self.table[s, j // B]) * B + j % B if j in seen else 0
                    for j in range(lk)]
            outs.append(_dense(self.q[start : start + lq], kc[slot], vc[slot], mask,
                               self.scale, softcap))
            start += lq
        return torch.cat(outs)

    def run(self, spans: SPANS, window: int | None, softcap: float | None) -> torch.Tensor:
        return varlen_attention_spans(self.q, self.kc, self.vc, self.table, self.md,
                                      self.scale, spans, window=window, softcap=softcap)


def _random_seqs(seed: int) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """Random lengths (1, B, B + 1 among them) with random disjoint spans."""
    rng = random.Random(seed)
    out = []
    for lk in [1, B, B + 1, *(rng.randint(2, 3 * B) for _ in range(3))]:
        lq = rng.randint(1, lk)
        spans, a = [], 0
        while a < lk and rng.random() < 0.7:
            a += rng.randint(0, 3)
            b = min(lk, a + rng.randint(1, 5))
            if a < b:
                spans.append((a, b))
            a = b + 1
        out.append((lq, lk, spans))
    return out


@pytest.mark.parametrize("window", [None, 3, 6])
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize(("gqa", "head_dim"), [(1, 64), (3, 16), (4, 64), (4, 16)])
def test_spans_match_the_dense_oracle_fp32(window: int | None, softcap: float | None,
                                           gqa: int, head_dim: int) -> None:
    seed = gqa * 100 + head_dim + (window or 0)
    for cases in (CASES, _random_seqs(seed)):
        b = _Batch([(lq, lk) for lq, lk, _ in cases], 2 * gqa, 2, head_dim, torch.float32,
                   seed)
        b.q.mul_(3.0)  # scores past the softcap
        if window is not None:
            b.free_outside_window(window)
        spans = [sp for *_, sp in cases]
        got = b.run(spans, window, softcap)
        assert got.dtype == torch.float32 and got.shape == b.q.shape
        assert (got.double() - b.oracle(spans, window, softcap)).abs().max() <= 1e-5


# Half-precision q and cache: the math runs in fp32 on CPU, so the error is the output's
# rounding: fp16 ~ 2^-11, bf16 ~ 2^-8 relative on |o| <= ~3.
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float16, 3e-3), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (3, 2.0)])
def test_half_precision_q_and_cache(dtype: torch.dtype, tol: float, window: int | None,
                                    softcap: float | None) -> None:
    b = _Batch([(lq, lk) for lq, lk, _ in CASES], 8, 2, 64, dtype, 7)
    spans = [sp for *_, sp in CASES]
    got = b.run(spans, window, softcap)
    assert got.dtype == dtype
    assert (got.double() - b.oracle(spans, window, softcap)).abs().max() <= tol


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fp8_cache_matches_the_oracle_on_the_widened_values(dtype: torch.dtype,
                                                            tol: float) -> None:
    b = _Batch([(lq, lk) for lq, lk, _ in CASES], 6, 2, 16, dtype, 11,
               kv_dtype=torch.float8_e4m3fn)
    spans = [sp for *_, sp in CASES]
    for window, softcap in ((None, None), (6, 2.0)):
        got = b.run(spans, window, softcap)
        assert got.dtype == dtype
        assert (got.double() - b.oracle(spans, window, softcap)).abs().max() <= tol


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (3, None), (None, 2.0), (5, 2.0)])
def test_without_spans_it_is_the_causal_torch_backend(window: int | None,
                                                      softcap: float | None) -> None:
    seqs = [(lq, lk) for lq, lk, _ in CASES] + [(3, 2), (1, 0)]  # rows before position 0
    b = _Batch(seqs, 8, 2, 64, torch.float32, 3)
    want = TorchBackend("cpu").varlen_attention(b.q, b.kc, b.vc, b.table, b.md, b.scale,
                                                window=window, softcap=softcap)
    got = b.run([[] for _ in seqs], window, softcap)
    assert (got - want).abs().max() <= 1e-5


def test_padding_rows_and_empty_batches_are_zero() -> None:
    b = _Batch([(0, 0), (2, 3)], 4, 2, 16, torch.float32, 5)
    q = torch.cat([b.q, torch.full((3, 4, 16), 7.0)])  # rows past the batch's queries
    got = varlen_attention_spans(q, b.kc, b.vc, b.table, b.md, b.scale, [[], [(0, 3)]])
    assert got[2:].eq(0).all()
    empty = _Batch([(0, 0)], 4, 2, 16, torch.float32, 5)
    assert empty.run([[]], None, None).shape == (0, 4, 16)


@pytest.mark.parametrize("spans", [
    [[]],                       # one entry for two sequences
    [[], [], []],
    [[], [(2, 2)]],             # empty span
    [[], [(3, 1)]],             # start after end
    [[], [(-1, 2)]],            # before position 0
    [[], [(4, 8)]],             # ends past k_len (7): its later keys are missing
    [[(0, 1)], []],             # a span in a key-less sequence
])
def test_bad_spans_raise(spans: SPANS) -> None:
    b = _Batch([(0, 0), (3, 7)], 4, 2, 16, torch.float32, 1)
    with pytest.raises(ValueError, match="spans"):
        b.run(spans, None, None)


@pytest.mark.parametrize("window", [None, 3])
def test_the_rule_is_transformers_gemma3_mask(window: int | None) -> None:
    """One whole sequence with two images: the rule equals transformers' composition
    (full: OR(causal, block); sliding: AND(OR(causal, block), window)), evaluated
    element-wise and through create_masks_for_vision_model, and the op computes
    attention under exactly that mask."""
    gemma3 = pytest.importorskip("transformers.models.gemma3.modeling_gemma3")
    mu = pytest.importorskip("transformers.masking_utils")
    types = [0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 0]
    spans = [(2, 6), (8, 13)]
    n = len(types)
    block_ids = gemma3.get_block_sequence_ids_for_mask(torch.tensor([types]))
    fn = mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(block_ids))
    if window is not None:
        fn = mu.and_masks(fn, mu.sliding_window_overlay(window))
    zero = torch.tensor(0)
    tf = [[bool(fn(zero, zero, torch.tensor(i), torch.tensor(j))) for j in range(n)]
          for i in range(n)]
    assert tf == _formula_mask(n, n, spans, window)

    cfg = gemma3.Gemma3TextConfig(sliding_window=window or n, hidden_size=8,
                                  num_hidden_layers=2, num_attention_heads=1,
                                  num_key_value_heads=1, head_dim=8, vocab_size=16,
                                  intermediate_size=8)
    cfg._attn_implementation = "sdpa"
    masks = gemma3.create_masks_for_vision_model(cfg, torch.zeros(1, n, 8), None, None, None,
                                                 block_ids)
    key = "full_attention" if window is None else "sliding_attention"
    assert masks[key][0, 0].tolist() == tf

    b = _Batch([(n, n)], 4, 2, 16, torch.float32, 9)
    got = b.run([spans], window, None)
    kc, vc = b.kc.flatten(0, 1), b.vc.flatten(0, 1)
    slots = [int(b.table[0, j // B]) * B + j % B for j in range(n)]
    want = _dense(b.q, kc[slots], vc[slots], tf, b.scale, None)
    assert (got.double() - want).abs().max() <= 1e-5


def test_out_keeps_the_rows_of_sequences_without_spans() -> None:
    """With ``out`` (a causal kernel's result for the batch), only sequences with spans
    are recomputed; the others' rows are left as given, bit for bit."""
    from pagedserve.kernels import build_varlen_metadata
    from pagedserve.kernels.torch_ref import TorchBackend

    torch.manual_seed(0)
    bsz, hkv, hq, d = 4, 2, 4, 16
    q_lens, k_lens = [6, 5, 3], [6, 9, 3]
    kc = torch.randn(16, bsz, hkv, d)
    vc = torch.randn(16, bsz, hkv, d)
    table = torch.tensor([[0, 1, -1], [2, 3, 4], [5, -1, -1]], dtype=torch.int32)
    md = build_varlen_metadata(q_lens, k_lens)
    q = torch.randn(sum(q_lens), hq, d)
    spans = [[], [(5, 9)], []]
    causal = TorchBackend("cpu").varlen_attention(q, kc, vc, table, md, 0.25)
    given = causal.clone()
    mixed = varlen_attention_spans(q, kc, vc, table, md, 0.25, spans, out=given)
    whole = varlen_attention_spans(q, kc, vc, table, md, 0.25, spans)
    assert torch.equal(mixed[:6], causal[:6]) and torch.equal(mixed[11:], causal[11:])
    torch.testing.assert_close(mixed[6:11], whole[6:11], atol=1e-6, rtol=0)
    assert not torch.allclose(mixed[6:11], causal[6:11])
