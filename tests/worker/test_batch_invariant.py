"""Batch-invariant GEMMs (``PackableLinear.row_multiple``, set by
``worker.batch_invariant``): a row's product has the same bits in a call of any
number of rows, at any offset, for plain and oneDNN-prepacked weights, fp32 and bf16,
on one and two threads; SmolLM2's projection shapes and its LM head. And the load-time
checks that refuse the mode where a GEMM or the attention kernel's runs of rows vary."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from pagedserve.kernels import available_backends, cpu_native
from pagedserve.worker.batch_invariant import (
    ROW_MULTIPLE,
    choose_row_multiple,
    varying_attention,
    varying_gemm,
)
from pagedserve.worker.layers.packed import PackableLinear, can_pack

SHAPES = [(576, 1728), (1536, 576), (576, 49152)]  # qkv, down, LM head
ROWS = [1, 2, 3, 5, 7, 9, 16, 17, 33, 65]


class Linear(PackableLinear):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{k}x{n}" for k, n in SHAPES])
def test_a_row_has_the_same_bits_in_any_call(threads: int, shape: tuple[int, int],
                                             dtype: torch.dtype, packed: bool) -> None:
    k, n = shape
    if packed and not can_pack(torch.device("cpu"), dtype):
        pytest.skip(f"oneDNN does not pack {dtype} on this CPU")
    gen = torch.Generator().manual_seed(k + n)
    layer = Linear(torch.randn(n, k, generator=gen).to(dtype))
    if packed:
        layer.pack()
    layer.row_multiple = ROW_MULTIPLE
    x = torch.randn(max(ROWS) + 1, k, generator=gen).to(dtype)
    alone = torch.cat([layer.matmul(x[i:i + 1]) for i in range(x.shape[0])])
    for rows in ROWS:
        for offset in (0, 1):
            got = layer.matmul(x[offset:offset + rows])
            assert got.shape == (rows, n)
            differ = (got != alone[offset:offset + rows]).any(-1).nonzero().flatten()
            assert differ.numel() == 0, f"{rows} rows at offset {offset}: rows {differ.tolist()}"


def test_rows_are_padded_only_when_needed() -> None:
    layer = Linear(torch.randn(4, 3))
    seen: list[int] = []
    plain = layer._matmul
    layer._matmul = lambda x, bias: (seen.append(x.shape[0]), plain(x, bias))[1]  # type: ignore
    layer.row_multiple = 8
    for rows in (1, 8, 9, 16):
        assert layer.matmul(torch.randn(rows, 3)).shape == (rows, 4)
    assert seen == [8, 8, 16, 16]


class RowCountLinear(Linear):
    """A GEMM whose rows depend on how many share the call, even padded: what a BLAS
    with another small-M path than the one measured here would do."""

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return super()._matmul(x, bias) * (1.0 + 1e-6 * x.shape[0])


class SmallCallLinear(Linear):
    """A GEMM whose calls of fewer than 16 rows take another path (another rounding):
    what a BLAS with a wider small-M path than the one measured here would do."""

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = super()._matmul(x, bias)
        return out * (1.0 + 1e-6) if x.shape[0] < 16 else out


def test_a_gemm_that_varies_even_padded_is_found_at_load() -> None:
    good, bad = Linear(torch.randn(12, 16)), RowCountLinear(torch.randn(12, 16))
    for layer in (good, bad):
        layer.row_multiple = 8
    assert varying_gemm(nn.ModuleList([good]), 16, torch.float32) is None
    assert varying_gemm(nn.ModuleList([good, bad]), 16, torch.float32) == "RowCountLinear"
    bad.row_multiple = 32  # every call padded past the sizes within one multiple...
    # ...still differs across padded sizes (33 and 67 rows against 32 alone).
    assert varying_gemm(nn.ModuleList([bad]), 16, torch.float32) == "RowCountLinear"
    with pytest.raises(ValueError, match=r"RowCountLinear.*multiple of 32"):
        choose_row_multiple(nn.ModuleList([good, bad]), 16, torch.float32)


def test_a_wider_small_call_path_gets_a_larger_multiple() -> None:
    model = nn.ModuleList([Linear(torch.randn(12, 16)), SmallCallLinear(torch.randn(12, 16))])
    assert choose_row_multiple(model, 16, torch.float32) == 16
    assert [layer.row_multiple for layer in model] == [16, 16]
    assert choose_row_multiple(nn.ModuleList([Linear(torch.randn(12, 16))]), 16,
                               torch.float32) == ROW_MULTIPLE


@pytest.mark.skipif("cpu" not in available_backends("cpu"), reason="no native kernel")
@pytest.mark.parametrize(("dtype", "kv_dtype"), [(torch.float32, torch.float32),
                                                 (torch.bfloat16, torch.bfloat16),
                                                 (torch.float32, torch.float8_e4m3fn)])
def test_attention_runs_of_rows_pass_the_load_check(dtype: torch.dtype,
                                                    kv_dtype: torch.dtype) -> None:
    smollm2 = SimpleNamespace(num_heads=9, num_kv_heads=3, head_dim=64)
    assert not varying_attention(smollm2, dtype, kv_dtype)  # type: ignore[arg-type]


@pytest.mark.skipif("cpu" not in available_backends("cpu"), reason="no native kernel")
def test_attention_whose_runs_of_rows_vary_is_found_at_load(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # What a compiler that builds the run-of-rows path with other rounding would do.
    plain = cpu_native.paged_decode

    def drifting(*args, chunks=None, **kwargs):
        out = plain(*args, chunks=chunks, **kwargs)
        return out if chunks is None else out * (1.0 + 1e-6)

    monkeypatch.setattr(cpu_native, "paged_decode", drifting)
    smollm2 = SimpleNamespace(num_heads=9, num_kv_heads=3, head_dim=64)
    assert varying_attention(smollm2, torch.float32, torch.float32)  # type: ignore[arg-type]


@pytest.mark.skipif("cpu" not in available_backends("cpu"), reason="no native kernel")
def test_windowed_runs_of_rows_that_vary_are_found_at_load(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Runs under a sliding window place each row's scores at its own start: a build
    # that rounds those differently must be caught even when unwindowed runs agree.
    plain = cpu_native.paged_decode

    def drifting(*args, chunks=None, window=None, **kwargs):
        out = plain(*args, chunks=chunks, window=window, **kwargs)
        return out if chunks is None or window is None else out * (1.0 + 1e-6)

    monkeypatch.setattr(cpu_native, "paged_decode", drifting)
    smollm2 = SimpleNamespace(num_heads=9, num_kv_heads=3, head_dim=64)
    assert varying_attention(smollm2, torch.float32, torch.float32)  # type: ignore[arg-type]
