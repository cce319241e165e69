"""Prefill rows in chunks: a sequence's rows read its K/V together, each row's bits unchanged.

``cpu_native.paged_decode(..., chunks=...)`` runs runs of rows that share a block
table (one sequence's prefill rows) in one task that loads each K/V tile once for
all of them. Batch-invariant mode depends on every row coming out bit-identical to
the same row run alone (the one-row path decode uses), whatever run it lands in and
however the scheduler cut the prefill, so these compare with ``torch.equal``, not a
tolerance; the oracle checks cover the accuracy of the chunked path itself.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import available_backends, cpu_native, get_backend
from pagedserve.kernels.testing import check_against_oracle, make_paged_batch

pytestmark = pytest.mark.skipif(
    "cpu" not in available_backends("cpu"), reason="no C compiler for the native kernel"
)
KV_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn,
             torch.float8_e5m2]


def _prefill_rows(q_len: int, k_len: int, heads: int, kv_heads: int, head_dim: int,
                  kv_dtype: torch.dtype, seed: int = 0):
    """One sequence's last ``q_len`` rows of ``k_len`` keys, as native decode rows."""
    b = make_paged_batch([q_len], [k_len], heads, kv_heads, head_dim, 16, seed=seed,
                         kv_dtype=kv_dtype)
    tables = b.block_table.expand(q_len, -1).contiguous()
    lens = torch.arange(k_len - q_len + 1, k_len + 1, dtype=torch.int32)
    return b, tables, lens


def _run(b, tables, lens, chunks=None, window=None, softcap=None) -> torch.Tensor:
    q = b.q[: lens.numel()]
    return cpu_native.paged_decode(q, b.key_cache, b.value_cache, tables, lens,
                                   int(lens.max()), q.shape[-1] ** -0.5, chunks=chunks,
                                   window=window, softcap=softcap)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"),
                         [(9, 3, 64), (8, 2, 128), (6, 3, 80), (4, 4, 16)])
def test_chunked_rows_are_bit_identical_to_rows_alone(kv_dtype: torch.dtype, heads: int,
                                                      kv_heads: int, head_dim: int) -> None:
    # 45 new rows after 30 cached keys: tiles cut mid-row, a partial last tile.
    b, tables, lens = _prefill_rows(45, 75, heads, kv_heads, head_dim, kv_dtype)
    alone = _run(b, tables, lens)
    for rows in (2, 3, 16, 45):
        chunked = _run(b, tables, lens, cpu_native.row_chunks([45], rows))
        assert torch.equal(chunked, alone), f"{rows} rows per chunk"


def test_a_row_keeps_its_bits_across_chunk_cuts_and_neighbours() -> None:
    # The same rows run in every grouping the backend can produce: alone, in runs
    # starting at other offsets (a chunked prefill cut elsewhere), and beside rows of
    # other lengths, including a key-less row (zero output) inside a run.
    b, tables, lens = _prefill_rows(40, 300, 9, 3, 64, torch.float32, seed=3)
    alone = _run(b, tables, lens)
    for cut in ([0, 7, 23, 40], [0, 1, 17, 33, 40], [0, 40]):
        got = _run(b, tables, lens, torch.tensor(cut, dtype=torch.int32))
        assert torch.equal(got, alone), cut
    mixed = torch.tensor([300, 0, 5, 299, 17, 1], dtype=torch.int32)
    ref = _run(b, tables[:6], mixed)
    got = _run(b, tables[:6], mixed, torch.tensor([0, 6], dtype=torch.int32))
    assert torch.equal(got, ref)
    assert not got[1].any()  # the key-less row


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e5m2])
@pytest.mark.parametrize("window", [1, 5, 16, 17, 33, 60])
def test_windowed_runs_are_bit_identical_to_rows_alone(kv_dtype: torch.dtype,
                                                      window: int) -> None:
    # Under a sliding window each row of a run has its own first key (the run reads the
    # union of its rows' windows): rows whose windows start mid-tile, windows shorter
    # than a tile, or wider than the run's keys; every grouping the backend makes.
    b, tables, lens = _prefill_rows(45, 75, 8, 2, 64, kv_dtype, seed=window)
    alone = _run(b, tables, lens, window=window)
    for rows in (2, 3, 16, 45):
        got = _run(b, tables, lens, cpu_native.row_chunks([45], rows), window=window)
        assert torch.equal(got, alone), f"{rows} rows per chunk"
    for cut in ([0, 7, 23, 45], [0, 1, 17, 33, 45]):
        got = _run(b, tables, lens, torch.tensor(cut, dtype=torch.int32), window=window)
        assert torch.equal(got, alone), cut
    # Rows of unrelated lengths in one run (a key-less row among them).
    mixed = torch.tensor([75, 0, 5, 74, 17, 1, 40], dtype=torch.int32)
    ref = _run(b, tables[:7], mixed, window=window)
    got = _run(b, tables[:7], mixed, torch.tensor([0, 7], dtype=torch.int32), window=window)
    assert torch.equal(got, ref) and not got[1].any()


@pytest.mark.parametrize("window", [None, 17])
def test_softcapped_runs_are_bit_identical_to_rows_alone(window: int | None) -> None:
    # Gemma 2's cap is applied in the softmax both paths share.
    b, tables, lens = _prefill_rows(45, 75, 8, 4, 128, torch.bfloat16, seed=9)
    b.q.mul_(6.0)
    alone = _run(b, tables, lens, window=window, softcap=2.5)
    assert not torch.equal(alone, _run(b, tables, lens, window=window))
    for rows in (2, 5, 16):
        got = _run(b, tables, lens, cpu_native.row_chunks([45], rows), window, 2.5)
        assert torch.equal(got, alone), f"{rows} rows per chunk"


def test_windowed_runs_read_no_block_before_their_windows() -> None:
    # The blocks every row's window has left behind are -1 (released): a run must not
    # touch them (the kernel checks every block it reads), and still match rows alone.
    b, tables, lens = _prefill_rows(20, 100, 4, 2, 64, torch.float32, seed=5)
    window = 30  # rows end at keys 81..100: the first starts at 51, block 3
    tables = tables.clone()
    tables[:, :3] = -1
    alone = _run(b, tables, lens, window=window)
    got = _run(b, tables, lens, cpu_native.row_chunks([20], 16), window=window)
    assert torch.equal(got, alone)
    tables[:, 3] = -1
    with pytest.raises(ValueError, match="block id"):
        _run(b, tables, lens, cpu_native.row_chunks([20], 16), window=window)


def test_backend_chunks_long_prefills_and_matches_the_oracle() -> None:
    # Prefills up to ROWS_MAX_KEYS keys (with and without cached context, beside
    # decode rows) now run as chunked native rows: still within fp32 tolerance.
    q_lens = [1, 700, 333, 1, 64]
    k_lens = [900, 700, 1500, 17, 2048]
    b = make_paged_batch(q_lens, k_lens, 9, 3, 64, 16, seed=7)
    check_against_oracle(get_backend("cpu"), b, 1e-5, decode=False)


def test_row_chunks_cuts_each_sequence_separately() -> None:
    assert cpu_native.row_chunks([3, 0, 20, 1], rows=8).tolist() == [0, 3, 11, 19, 23, 24]
    assert cpu_native.row_chunks([16], rows=16).tolist() == [0, 16]
    with pytest.raises(ValueError, match="rows"):
        cpu_native.row_chunks([4], rows=0)


@pytest.mark.parametrize("chunks", [[0, 3], [1, 4], [0, 3, 2, 4], [0, 2, 2, 4]])
def test_bad_chunks_raise(chunks: list[int]) -> None:
    b, tables, lens = _prefill_rows(4, 4, 4, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="chunks"):
        _run(b, tables, lens, torch.tensor(chunks, dtype=torch.int32))
