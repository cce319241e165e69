"""Seed-000 worked examples and metadata construction."""

import math

import pytest
import torch

from pagedserve.kernels import (
    available_backends,
    build_varlen_metadata,
    dense_causal_attention,
    get_backend,
)
from pagedserve.kernels.testing import make_paged_batch


def test_seed_varlen_metadata_example() -> None:
    md = build_varlen_metadata([10, 3, 1], [0, 1, 7])
    assert md.cu_seq_lens_q.tolist() == [0, 10, 13, 14]
    assert md.cu_seq_lens_k.tolist() == [0, 0, 1, 8]
    assert md.seq_lens_k.tolist() == [0, 1, 7]
    assert md.max_length_q == 10
    assert md.max_length_k == 7
    assert md.cu_seq_lens_q.dtype == torch.int32
    assert md.cu_seq_lens_k.dtype == torch.int32
    assert md.seq_lens_k.dtype == torch.int32
    assert md.host_query_lens() == [10, 3, 1]


def test_metadata_without_host_lists_reads_tensors() -> None:
    md = build_varlen_metadata([2, 5], [4, 5])
    bare = type(md)(md.cu_seq_lens_q, md.cu_seq_lens_k, md.seq_lens_k, 5, 5)
    assert bare.host_query_lens() == [2, 5]
    assert bare.host_key_lens() == [4, 5]


def test_metadata_rejects_mismatch() -> None:
    with pytest.raises(ValueError, match="sequences"):
        build_varlen_metadata([1, 2], [1])


def test_empty_batch_metadata() -> None:
    md = build_varlen_metadata([], [])
    assert md.cu_seq_lens_q.tolist() == [0]
    assert md.max_length_q == 0 and md.max_length_k == 0


@pytest.mark.parametrize("name", available_backends("cpu"))
def test_seed_varlen_attention_example(name: str) -> None:
    """q [10,3,1] over k [0,1,7]: the zero-key sequence outputs zeros."""
    b = make_paged_batch([10, 3, 1], [0, 1, 7], 4, 2, 64, block_size=4, seed=1)
    md = build_varlen_metadata(b.query_lens, b.key_lens)
    scale = 1 / math.sqrt(64)
    out = get_backend(name, "cpu").varlen_attention(
        b.q, b.key_cache, b.value_cache, b.block_table, md, scale
    )
    ref = dense_causal_attention(b.q, b.k, b.v, b.query_lens, b.key_lens, scale)
    assert torch.equal(out[:10], torch.zeros_like(out[:10]))
    # k_len 1, q_len 3: only the last query sees the key.
    assert torch.equal(out[10:12], torch.zeros_like(out[10:12]))
    assert (out - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("name", available_backends("cpu"))
def test_seed_decode_example(name: str) -> None:
    """cache lengths [30,32,70], B=32, non-contiguous block table."""
    table = [[2, -1, -1, -1], [0, 1, -1, -1], [3, 5, 6, -1]]
    b = make_paged_batch([1, 1, 1], [30, 32, 70], 6, 2, 64, block_size=32, block_table=table)
    scale = 0.125
    seqlens = torch.tensor([30, 32, 70], dtype=torch.int32)
    out = get_backend(name, "cpu").decode_attention(
        b.q, b.key_cache, b.value_cache, b.block_table, seqlens, scale
    )
    ref = dense_causal_attention(b.q, b.k, b.v, b.query_lens, b.key_lens, scale)
    assert (out - ref).abs().max().item() <= 1e-5
