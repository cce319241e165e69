"""Every available backend against the dense oracle on shuffled paged caches."""

import math
import random

import pytest
import torch
from pagedserve.kernels import build_varlen_metadata, dense_causal_attention, get_backend
from pagedserve.kernels.backend import available_backends
from pagedserve.kernels.testing import make_paged_batch

CPU_BACKENDS = available_backends("cpu")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}  # fp16: inputs and output rounded to 11 bits


def _lengths(block_size: int, seed: int) -> tuple[list[int], list[int]]:
    """Decode rows, no-context prefills and chunked prefills, edge lengths included."""
    rng = random.Random(seed)
    edges = [1, block_size, 2 * block_size, block_size + 1, block_size - 1]
    q_lens, k_lens = [], []
    for k in edges + [rng.randint(1, 3 * block_size) for _ in range(3)]:
        kind = rng.choice(["decode", "prefill", "chunk"])
        q = 1 if kind == "decode" else k if kind == "prefill" else rng.randint(1, k)
        q_lens.append(q)
        k_lens.append(k)
    return q_lens, k_lens


def _check(name: str, b, tol: float, *, decode: bool) -> None:
    be = get_backend(name, "cpu")
    d = b.q.shape[-1]
    scale = 1 / math.sqrt(d)
    ref = dense_causal_attention(b.q, b.k, b.v, b.query_lens, b.key_lens, scale)
    if decode:
        seqlens = torch.tensor(b.key_lens, dtype=torch.int32)
        out = be.decode_attention(b.q, b.key_cache, b.value_cache, b.block_table, seqlens, scale)
    else:
        md = build_varlen_metadata(b.query_lens, b.key_lens)
        out = be.varlen_attention(b.q, b.key_cache, b.value_cache, b.block_table, md, scale)
    assert out.shape == b.q.shape and out.dtype == b.q.dtype
    err = (out.double() - ref.double()).abs().max().item()
    assert err <= tol, f"{name}: max abs error {err} > {tol}"


@pytest.mark.parametrize("name", [n for n in CPU_BACKENDS if n == "torch"])
@pytest.mark.parametrize("gqa", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("seed", [0, 1])
def test_torch_varlen_matches_oracle(name: str, gqa: int, head_dim: int, seed: int) -> None:
    q_lens, k_lens = _lengths(16, seed)
    b = make_paged_batch(q_lens, k_lens, 2 * gqa, 2, head_dim, block_size=16, seed=seed)
    _check(name, b, TOL[torch.float32], decode=False)


@pytest.mark.parametrize("gqa", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_torch_decode_matches_oracle(gqa: int, head_dim: int) -> None:
    k_lens = [1, 16, 17, 32, 5, 47, 0]
    b = make_paged_batch([1] * len(k_lens), k_lens, 2 * gqa, 2, head_dim, block_size=16)
    _check("torch", b, TOL[torch.float32], decode=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_torch_half_precision(dtype: torch.dtype) -> None:
    q_lens, k_lens = _lengths(16, 5)
    b = make_paged_batch(q_lens, k_lens, 6, 2, 64, block_size=16, dtype=dtype, garbage=3.0)
    tol = {torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    _check("torch", b, tol, decode=False)


def test_torch_uniform_prefill_and_padded_groups() -> None:
    """Equal no-context prefills (is_causal path) and one long + many short rows."""
    b = make_paged_batch([20, 20, 20], [20, 20, 20], 4, 4, 64, block_size=16)
    _check("torch", b, TOL[torch.float32], decode=False)
    q_lens = [200] + [3] * 10 + [1] * 10
    k_lens = [200] + [9] * 10 + [33] * 10
    b = make_paged_batch(q_lens, k_lens, 6, 2, 64, block_size=16, seed=3)
    _check("torch", b, TOL[torch.float32], decode=False)


def test_rows_without_keys_are_zero() -> None:
    """q_len > k_len: the first q_len - k_len rows see nothing; k_len 0 is all zeros."""
    b = make_paged_batch([5, 4, 1], [2, 0, 0], 2, 1, 64, block_size=16)
    md = build_varlen_metadata(b.query_lens, b.key_lens)
    out = get_backend("torch").varlen_attention(
        b.q, b.key_cache, b.value_cache, b.block_table, md, 0.125
    )
    assert torch.equal(out[:3], torch.zeros_like(out[:3]))
    assert out[3:5].abs().sum() > 0
    assert torch.equal(out[5:], torch.zeros_like(out[5:]))
