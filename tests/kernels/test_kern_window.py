"""Sliding-window attention on every available backend against the dense oracle.

A window ``W`` lets a query see its own key and the ``W - 1`` before it (Mistral's
convention, and Hugging Face's mask). Batches mix decode rows, no-context prefills and
chunked prefills over context, with windows below, at and just past the block size and
wider than every sequence; the oracle masks positions explicitly, so a backend that
ignores the window, or misplaces its start by one key, fails.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve.kernels import available_backends, build_varlen_metadata, get_backend
from pagedserve.kernels.reference import dense_causal_attention
from pagedserve.kernels.testing import check_against_oracle, make_paged_batch, mixed_lengths

CPU_BACKENDS = available_backends("cpu")
FP32_TOL = 1e-5
WINDOWS = [1, 5, 15, 16, 17, 40, 1000]


@pytest.mark.parametrize("name", CPU_BACKENDS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize(("gqa", "head_dim"), [(1, 64), (3, 128), (4, 64)])
def test_varlen_window_matches_oracle(name: str, window: int, gqa: int, head_dim: int) -> None:
    seed = window + gqa
    q_lens, k_lens = mixed_lengths(16, seed)
    b = make_paged_batch(q_lens, k_lens, 2 * gqa, 2, head_dim, block_size=16, seed=seed)
    check_against_oracle(get_backend(name, "cpu"), b, FP32_TOL, decode=False, window=window)


@pytest.mark.parametrize("name", CPU_BACKENDS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize(("gqa", "head_dim"), [(1, 128), (4, 64)])
def test_decode_window_matches_oracle(name: str, window: int, gqa: int, head_dim: int) -> None:
    k_lens = [1, 16, 17, 32, 5, 47, 0, 80]
    b = make_paged_batch([1] * len(k_lens), k_lens, 2 * gqa, 2, head_dim, block_size=16,
                         seed=window)
    check_against_oracle(get_backend(name, "cpu"), b, FP32_TOL, decode=True, window=window)


def test_the_window_changes_the_answer() -> None:
    """The cases above would catch a backend that ignores the window: the oracle's
    answer moves with it (and not at all once the window covers every sequence)."""
    q_lens, k_lens = mixed_lengths(16, 3)
    b = make_paged_batch(q_lens, k_lens, 4, 2, 64, 16, seed=3)
    scale = 1 / math.sqrt(64)
    full = dense_causal_attention(b.q, b.k, b.v, q_lens, k_lens, scale)
    for w in (1, 15, 16, 17):
        windowed = dense_causal_attention(b.q, b.k, b.v, q_lens, k_lens, scale, w)
        assert (windowed - full).abs().max() > 1e-2
        nearby = dense_causal_attention(b.q, b.k, b.v, q_lens, k_lens, scale, w + 1)
        assert (windowed - nearby).abs().max() > 1e-3
    wide = dense_causal_attention(b.q, b.k, b.v, q_lens, k_lens, scale, max(k_lens))
    assert torch.equal(wide, full)


def _drop_blocks_before_window(b, window: int, block_size: int) -> torch.Tensor:
    """The batch's table with every block no query's window reaches set to -1: what a
    scheduler that frees them leaves behind."""
    table = b.block_table.clone()
    for s, (lq, lk) in enumerate(zip(b.query_lens, b.key_lens, strict=True)):
        first_key = max(0, lk - lq - window + 1)
        table[s, : first_key // block_size] = -1
    return table


@pytest.mark.parametrize("name", CPU_BACKENDS)
@pytest.mark.parametrize("decode", [True, False])
def test_blocks_before_the_window_are_never_read(name: str, decode: bool) -> None:
    """Long sequences with a short window whose early table entries are -1: every
    backend still answers as the oracle (the native kernel checks each block it reads
    and would raise on -1)."""
    window, bs = 20, 16
    k_lens = [100, 37, 64, 21, 90]
    q_lens = [1] * 5 if decode else [1, 37, 5, 21, 30]
    b = make_paged_batch(q_lens, k_lens, 4, 2, 64, bs, seed=11)
    b.block_table = _drop_blocks_before_window(b, window, bs)
    assert int((b.block_table[0] == -1).sum()) == (100 - window) // bs
    check_against_oracle(get_backend(name, "cpu"), b, FP32_TOL, decode=decode, window=window)


@pytest.mark.parametrize("name", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_window(name: str, dtype: torch.dtype) -> None:
    q_lens, k_lens = mixed_lengths(16, 5)
    b = make_paged_batch(q_lens, k_lens, 6, 2, 64, block_size=16, dtype=dtype, garbage=3.0)
    tol = {torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    check_against_oracle(get_backend(name, "cpu"), b, tol, decode=False, window=9)


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_fp8_cache_window(name: str) -> None:
    backend = get_backend(name, "cpu")
    if not backend.supports_kv_cache_dtype(torch.float8_e4m3fn, torch.float32):
        pytest.skip(f"{name} reads no fp8 cache")
    q_lens, k_lens = mixed_lengths(16, 6)
    b = make_paged_batch(q_lens, k_lens, 4, 2, 64, 16, kv_dtype=torch.float8_e4m3fn)
    check_against_oracle(backend, b, FP32_TOL, decode=False, window=7)


@pytest.mark.parametrize("name", CPU_BACKENDS)
@pytest.mark.parametrize("window", [0, -3, 2.5, True, "8"])
def test_bad_window_is_a_value_error(name: str, window: object) -> None:
    b = make_paged_batch([1, 4], [9, 4], 4, 2, 64, 16)
    be = get_backend(name, "cpu")
    with pytest.raises(ValueError, match="sliding window"):
        be.decode_attention(b.q[:2], b.key_cache, b.value_cache, b.block_table,
                            torch.tensor([9, 4], dtype=torch.int32), 0.125, window=window)
    md = build_varlen_metadata(b.query_lens, b.key_lens)
    with pytest.raises(ValueError, match="sliding window"):
        be.varlen_attention(b.q, b.key_cache, b.value_cache, b.block_table, md, 0.125,
                            window=window)


@pytest.mark.skipif("triton" not in CPU_BACKENDS, reason="needs triton (interpreter on CPU)")
@pytest.mark.parametrize("splits", [2, 3])
@pytest.mark.parametrize("decode", [True, False])
def test_triton_splits_cover_only_the_window(splits: int, decode: bool) -> None:
    """Split-K over a window: the splits divide ``[first key, last key]`` of each tile,
    so every split still holds keys and the combine sees each key once."""
    from pagedserve.kernels.triton_backend import TritonBackend

    k_lens = [100, 37, 64, 21, 90]
    q_lens = [1] * 5 if decode else [1, 37, 5, 21, 30]
    b = make_paged_batch(q_lens, k_lens, 4, 2, 64, 16, seed=splits)
    check_against_oracle(TritonBackend("cpu", num_splits=splits), b, FP32_TOL, decode=decode,
                         window=24)


def test_a_window_that_cuts_nothing_keeps_the_fast_native_paths(monkeypatch) -> None:
    """Prompts and contexts no longer than the window (most of Mistral's or Gemma's): the
    native backend keeps runs of rows sharing K/V tiles and the shared-prefix split, with
    the same bits as no window; once a row is longer, its runs carry each row's start."""
    if "cpu" not in CPU_BACKENDS:
        pytest.skip("the native CPU kernels did not build")
    from pagedserve.kernels import cpu_native

    be = get_backend("cpu", "cpu")
    calls: list[tuple[bool, bool]] = []
    real = cpu_native.paged_decode

    def spy(*a, **k):
        calls.append((k.get("chunks") is not None, k.get("window") is not None))
        return real(*a, **k)

    monkeypatch.setattr(cpu_native, "paged_decode", spy)
    b = make_paged_batch([40, 24], [40, 30], 4, 2, 64, 16, seed=2)
    md = build_varlen_metadata(b.query_lens, b.key_lens)
    plain = be.varlen_attention(b.q, b.key_cache, b.value_cache, b.block_table, md, 0.125)
    wide = be.varlen_attention(b.q, b.key_cache, b.value_cache, b.block_table, md, 0.125,
                               window=40)
    assert torch.equal(plain, wide) and calls == [(True, False), (True, False)]
    be.varlen_attention(b.q, b.key_cache, b.value_cache, b.block_table, md, 0.125, window=39)
    assert calls[-1] == (True, True)


def test_long_windowed_prefills_run_as_native_rows(monkeypatch) -> None:
    """A prefill past ``ROWS_MAX_KEYS`` keys goes to SDPA, unless a window no longer
    than that bounds what each row reads: then it runs as native rows (in runs), and
    still equals the oracle."""
    if "cpu" not in CPU_BACKENDS:
        pytest.skip("the native CPU kernels did not build")
    from pagedserve.kernels import cpu_native, torch_ref

    be = get_backend("cpu", "cpu")
    be.rows_max_keys = 64
    to_sdpa: list[int] = []
    real_sdpa = torch_ref.TorchBackend._attend_seqs

    def spy_sdpa(self, q, kc, vc, table, md, seqs, *a, **k):
        to_sdpa.extend(seqs)
        return real_sdpa(self, q, kc, vc, table, md, seqs, *a, **k)

    monkeypatch.setattr(torch_ref.TorchBackend, "_attend_seqs", spy_sdpa)
    chunked: list[bool] = []
    real_rows = cpu_native.paged_decode

    def spy_rows(*a, **k):
        chunked.append(k.get("chunks") is not None)
        return real_rows(*a, **k)

    monkeypatch.setattr(cpu_native, "paged_decode", spy_rows)
    b = make_paged_batch([150, 1, 40], [150, 200, 90], 4, 2, 64, 16, seed=6)
    check_against_oracle(be, b, FP32_TOL, decode=False, window=48)
    assert to_sdpa == [] and chunked == [True]
    check_against_oracle(be, b, FP32_TOL, decode=False, window=65)  # wider than 64
    assert to_sdpa == [0, 2]
    to_sdpa.clear()
    check_against_oracle(be, b, FP32_TOL, decode=False)
    assert to_sdpa == [0, 2]
