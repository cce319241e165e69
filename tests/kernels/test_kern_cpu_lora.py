"""The native multi-LoRA kernel (``kernels/cpu_lora``) against plain torch math: ragged
segments and row tails, adapters that skip pieces or projections, padded ranks, strided
rows, and the refusals (bad segments, layouts the kernel does not take)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_lora, cpu_native
from pagedserve.worker.layers.lora import LoRABatch, LoRAWeights

pytestmark = pytest.mark.skipif(cpu_native.load() is None,
                                reason="no C compiler for the native kernels")

IN, WIDTHS = 96, [64, 32, 32]  # a fused q/k/v-like projection
OUT = sum(WIDTHS)


def make_table(ranks: dict[int, list[int | None]], seed: int = 0
               ) -> tuple[cpu_lora.NativeLoRATable, dict[int, list]]:
    """Slot -> per piece a rank (None: the adapter skips that piece); returns the table
    and the unpadded (A [r, in], B [w, r], column) per slot for the reference."""
    g = torch.Generator().manual_seed(seed)
    table = cpu_lora.NativeLoRATable(len(WIDTHS), IN, OUT)
    plain: dict[int, list] = {}
    for slot, per_piece in ranks.items():
        pieces, ref, col = [], [], 0
        for w, r in zip(WIDTHS, per_piece, strict=True):
            if r is not None:
                a = torch.randn(r, IN, generator=g) * 0.1
                b = torch.randn(w, r, generator=g) * 0.1
                pieces.append((*cpu_lora.pad_rank(a.t(), b.t()), col))
                ref.append((a, b, col))
            col += w
        table.set(slot, pieces)
        plain[slot] = ref
    return table, plain


def reference(y: torch.Tensor, x: torch.Tensor, segments: list[tuple[int, int, int]],
              plain: dict[int, list]) -> torch.Tensor:
    out = y.clone()
    for start, end, slot in segments:
        for a, b, col in plain.get(slot, []):
            out[start:end, col:col + b.shape[0]] += x[start:end] @ a.t() @ b.t()
    return out


RANKS = {0: [16, 16, 16], 1: [8, None, 8], 2: [None, 40, None], 3: [32, 24, 16]}


@pytest.mark.parametrize("segments", [
    [(0, 4, 0), (4, 8, 1), (8, 12, 2), (12, 16, 3)],  # decode: four rows each
    [(0, 7, 3), (7, 8, 1), (10, 37, 0), (37, 40, 2)],  # ragged, tails of 1-3 rows, a gap
    [(0, 40, 1)],  # one adapter over a long prefill chunk
    [(0, 5, 2), (5, 9, 7)],  # slot 7 is past the table: no piece of this projection
])
def test_deltas_equal_torch(segments: list[tuple[int, int, int]]) -> None:
    table, plain = make_table(RANKS)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(40, IN, generator=g), torch.randn(40, OUT, generator=g)
    want = reference(y, x, segments, plain)
    assert table.apply(y, x, torch.tensor(segments, dtype=torch.int64))
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)


def test_strided_rows_and_refusals() -> None:
    table, plain = make_table(RANKS)
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(12, IN + 5, generator=g)
    x = wide[:, :IN]  # rows with a stride: taken
    y = torch.randn(12, OUT, generator=g)
    segs = [(0, 6, 0), (6, 12, 3)]
    want = reference(y, x, segs, plain)
    assert table.apply(y, x, torch.tensor(segs, dtype=torch.int64))
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    before = y.clone()
    assert not table.apply(y, x.t().contiguous().t(), torch.tensor(segs))  # column stride
    assert not table.apply(y.double(), x.double(), torch.tensor(segs))
    for bad in ([(0, 13, 0)], [(3, 2, 0)], [(0, 4, -1)]):
        with pytest.raises(ValueError, match="out of range"):
            table.apply(y, x, torch.tensor(bad, dtype=torch.int64))
    assert torch.equal(y, before)  # nothing written by a refusal
    assert not table.fits(24, 0) and not table.fits(32, OUT - 16) and table.fits(32, 64)
    with pytest.raises(ValueError, match="native layout"):
        table.set(9, [(torch.zeros(IN, 16), torch.zeros(16, 24), 0)])
    with pytest.raises(ValueError, match="native layout"):
        table.set(9, [(torch.zeros(IN + 1, 16), torch.zeros(16, 32), 0)])


def test_lora_weights_fall_back_to_the_same_math() -> None:
    """Rows the kernel does not take (a column stride) run the pieces in torch."""
    table, plain = make_table(RANKS)
    batch = LoRABatch([(5, 0, 4), (6, 4, 9)], torch.tensor([(0, 4, 1), (4, 9, 3)]),
                      {5: 1, 6: 3})
    weights = LoRAWeights(batch, table)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(9, IN, generator=g), torch.randn(9, OUT, generator=g)
    want = reference(y, x, [(0, 4, 1), (4, 9, 3)], plain)
    native, fallback = y.clone(), y.clone()
    weights.apply(native, x)
    weights.apply(fallback, x.t().contiguous().t())
    torch.testing.assert_close(native, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fallback, want, rtol=1e-5, atol=1e-5)
    table.clear(3)
    cleared = y.clone()
    weights.apply(cleared, x)
    torch.testing.assert_close(cleared, reference(y, x, [(0, 4, 1)], plain),
                               rtol=1e-5, atol=1e-5)


def test_bf16_activations_take_one_rounding() -> None:
    """A bf16 model's rows: widened, summed in fp32, added to ``y`` with one rounding;
    rows outside every segment stay bit for bit."""
    table, plain = make_table(RANKS)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(40, IN, generator=g).bfloat16()
    y = torch.randn(40, OUT, generator=g).bfloat16()
    segs = [(0, 7, 3), (7, 8, 1), (10, 37, 0), (37, 40, 2)]
    want = reference(y.float(), x.float(), segs, plain)
    got = y.clone()
    assert table.apply(got, x, torch.tensor(segs, dtype=torch.int64))
    torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=8e-3)
    assert torch.equal(got[8:10], y[8:10])
    weights = LoRAWeights(LoRABatch([(5, 0, 7), (6, 10, 37)],
                                    torch.tensor([(0, 7, 3), (10, 37, 0)]), {5: 3, 6: 0}), table)
    fallback = y.clone()
    weights.apply(fallback, x.t().contiguous().t())  # the torch form of the same math
    want = reference(y.float(), x.float(), [(0, 7, 3), (10, 37, 0)], plain)
    torch.testing.assert_close(fallback.float(), want, rtol=8e-3, atol=8e-3)
