"""Every available backend against the dense oracle on shuffled paged caches.

On CPU the backends are torch and (under TRITON_INTERPRET=1) triton; the same
tests run on a GPU box through test_kern_gpu.py. Batches mix decode rows
(q_len 1), no-context prefills (q_len == k_len) and chunked prefills over
context, with lengths 1, B-1, B, B+1 and 2B.
"""


import pytest
import torch

from pagedserve.kernels import (
    available_backends,
    build_varlen_metadata,
    get_backend,
)
from pagedserve.kernels.testing import (
    check_against_oracle,
    make_paged_batch,
    mixed_lengths,
)

CPU_BACKENDS = available_backends("cpu")
FP32_TOL = 1e-5
HALF_TOL = {torch.float16: 2e-3, torch.bfloat16: 2e-2}  # 11 / 8 mantissa bits on in/out


@pytest.mark.parametrize("name", CPU_BACKENDS)
@pytest.mark.parametrize("gqa", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_varlen_matches_oracle(name: str, gqa: int, head_dim: int) -> None:
    seed = gqa * 7 + head_dim
    q_lens, k_lens = mixed_lengths(16, seed)
    b = make_paged_batch(q_lens, k_lens, 2 * gqa, 2, head_dim, block_size=16, seed=seed)
    check_against_oracle(get_backend(name, "cpu"), b, FP32_TOL, decode=False)


@pytest.mark.parametrize("name", CPU_BACKENDS)
@pytest.mark.parametrize("gqa", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_matches_oracle(name: str, gqa: int, head_dim: int) -> None:
    k_lens = [1, 16, 17, 32, 5, 47, 0]
    b = make_paged_batch([1] * len(k_lens), k_lens, 2 * gqa, 2, head_dim, block_size=16)
    check_against_oracle(get_backend(name, "cpu"), b, FP32_TOL, decode=True)


@pytest.mark.parametrize("name", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(name: str, dtype: torch.dtype) -> None:
    q_lens, k_lens = mixed_lengths(16, 5)
    b = make_paged_batch(q_lens, k_lens, 6, 2, 64, block_size=16, dtype=dtype, garbage=3.0)
    check_against_oracle(get_backend(name, "cpu"), b, HALF_TOL[dtype], decode=False)


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_block_size_not_power_of_two_and_tiny(name: str) -> None:
    b = make_paged_batch([3, 1, 9], [7, 12, 9], 3, 1, 64, block_size=3, seed=4)
    check_against_oracle(get_backend(name, "cpu"), b, FP32_TOL, decode=False)


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_rows_without_keys_are_zero(name: str) -> None:
    """q_len > k_len: the first q_len - k_len rows see nothing; k_len 0 is all zeros."""
    b = make_paged_batch([5, 4, 1], [2, 0, 0], 2, 1, 64, block_size=16)
    md = build_varlen_metadata(b.query_lens, b.key_lens)
    out = get_backend(name, "cpu").varlen_attention(
        b.q, b.key_cache, b.value_cache, b.block_table, md, 0.125
    )
    assert torch.equal(out[:3], torch.zeros_like(out[:3]))
    assert out[3:5].abs().sum() > 0
    assert torch.equal(out[5:], torch.zeros_like(out[5:]))


def test_torch_varlen_more_seeds() -> None:
    for seed in range(2, 6):
        q_lens, k_lens = mixed_lengths(32, seed)
        b = make_paged_batch(q_lens, k_lens, 9, 3, 64, block_size=32, seed=seed)
        check_against_oracle(get_backend("torch"), b, FP32_TOL, decode=False)


def test_torch_decode_in_cache_sized_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU decode path gathers a few sequences at a time; chunk edges must not matter."""
    from pagedserve.kernels import torch_ref

    monkeypatch.setattr(torch_ref, "_CPU_CHUNK_BYTES", 40_000)
    k_lens = [33, 0, 16, 1, 48, 20, 7, 64, 2]
    b = make_paged_batch([1] * len(k_lens), k_lens, 6, 2, 64, block_size=16, seed=9)
    check_against_oracle(get_backend("torch"), b, FP32_TOL, decode=True)
    b = make_paged_batch([1] * 5, [40] * 5, 6, 2, 64, block_size=16, seed=10)
    check_against_oracle(get_backend("torch"), b, FP32_TOL, decode=True)


def test_torch_uniform_prefill_and_padded_groups() -> None:
    """Equal no-context prefills (is_causal path) and one long + many short rows."""
    be = get_backend("torch")
    b = make_paged_batch([20, 20, 20], [20, 20, 20], 4, 4, 64, block_size=16)
    check_against_oracle(be, b, FP32_TOL, decode=False)
    ragged = [5, 17, 16, 33, 2]  # no context, different lengths: right-padded is_causal
    b = make_paged_batch(ragged, ragged, 6, 2, 64, block_size=16, seed=2)
    check_against_oracle(be, b, FP32_TOL, decode=False)
    q_lens = [200] + [3] * 10 + [1] * 10
    k_lens = [200] + [9] * 10 + [33] * 10
    b = make_paged_batch(q_lens, k_lens, 6, 2, 64, block_size=16, seed=3)
    check_against_oracle(be, b, FP32_TOL, decode=False)


@pytest.mark.skipif("triton" not in CPU_BACKENDS, reason="needs triton (interpreter)")
@pytest.mark.parametrize("splits", [2, 3])
def test_triton_split_k_matches_oracle(splits: int) -> None:
    """Flash-decoding path: key range split across programs, partials combined."""
    from pagedserve.kernels.triton_backend import TritonBackend

    be = TritonBackend("cpu", num_splits=splits)
    k_lens = [1, 16, 70, 33, 0]
    b = make_paged_batch([1] * 5, k_lens, 6, 2, 64, block_size=16, seed=splits)
    check_against_oracle(be, b, FP32_TOL, decode=True)
    b = make_paged_batch([4, 1, 20], [40, 7, 20], 8, 2, 64, block_size=16, seed=splits)
    check_against_oracle(be, b, FP32_TOL, decode=False)


@pytest.mark.skipif("triton" not in CPU_BACKENDS, reason="needs triton (interpreter)")
@pytest.mark.parametrize("block_n", [16, 128])
def test_triton_launch_overrides_keep_results(block_n: int) -> None:
    """The tile sizes ``bench/kernels.py --sweep`` tries: keys per step smaller and
    larger than a block (ragged lengths cross tile and block edges)."""
    from pagedserve.kernels.triton_backend import TritonBackend

    be = TritonBackend("cpu", block_n=block_n, num_warps=8, num_stages=2)
    b = make_paged_batch([1] * 4, [1, 17, 130, 64], 6, 2, 64, block_size=16, seed=block_n)
    check_against_oracle(be, b, FP32_TOL, decode=True)
    b = make_paged_batch([5, 20], [40, 20], 6, 2, 64, block_size=16, seed=block_n + 1)
    check_against_oracle(be, b, FP32_TOL, decode=False)
    with pytest.raises(ValueError, match="block_n"):
        TritonBackend("cpu", block_n=48)
    with pytest.raises(ValueError, match="num_stages"):
        TritonBackend("cpu", num_stages=0)


@pytest.mark.skipif("triton" not in CPU_BACKENDS, reason="needs triton (interpreter)")
def test_triton_decode_takes_two_stages_only_when_it_fills_the_gpu() -> None:
    """The launch rule the H200 sweep chose: two pipeline stages for decode whose grid
    (split K included) spans ``DECODE_FULL_WAVES`` waves; Triton's default elsewhere."""
    from pagedserve.kernels.triton_backend import DECODE_FULL_WAVES, TritonBackend

    be = TritonBackend("cpu")
    be._num_sms = 132
    many = DECODE_FULL_WAVES * 132
    assert be._stages(many, 1, 16) == {"num_stages": 2}
    assert be._stages(many - 1, 1, 16) == {}  # 64 sequences x 3 KV heads were slower
    assert be._stages(192, 4, 16) == {"num_stages": 2}  # the same grid, split K
    assert be._stages(96, 4, 16) == {}
    assert be._stages(many, 1, 64) == {}  # prefill tiles
    assert TritonBackend("cpu", num_stages=3)._stages(many, 1, 16) == {"num_stages": 3}
    assert TritonBackend("cpu")._stages(many, 1, 16) == {}  # SM count unknown (no CUDA)


@pytest.mark.skipif("triton" not in CPU_BACKENDS, reason="needs triton (interpreter)")
def test_triton_split_rule_fills_short_decode_grids() -> None:
    """K splits on an H200-sized GPU (132 SMs), 3 KV heads. Under one wave: towards two
    waves, >= 256 keys a split. Decode between one and ``DECODE_FULL_WAVES`` waves: up
    to that many, >= 1024 keys a split (64 x 8192 becomes the grid of 256 x 2048).
    Prefill past one wave, and full decode grids, stay whole."""
    from pagedserve.kernels.triton_backend import DECODE_FULL_WAVES, TritonBackend, plan_splits

    sms = 132
    assert plan_splits(8 * 3, 8192, 16, sms) == 8
    assert plan_splits(8 * 3, 512, 16, sms) == 2
    assert plan_splits(8 * 3, 200, 16, sms) == 1
    assert plan_splits(64 * 3, 8192, 16, sms) == 4
    assert plan_splits(64 * 3, 2048, 16, sms) == 2
    assert plan_splits(64 * 3, 1500, 16, sms) == 1
    assert plan_splits(128 * 3, 8192, 16, sms) == 2
    assert plan_splits(176 * 3, 8192, 16, sms) == 1
    assert plan_splits(64 * 3, 8192, 64, sms) == 1
    for programs in range(sms, DECODE_FULL_WAVES * sms):
        splits = plan_splits(programs, 1 << 20, 16, sms)
        assert splits & (splits - 1) == 0
        assert DECODE_FULL_WAVES * sms <= programs * splits < 2 * DECODE_FULL_WAVES * sms
    be = TritonBackend("cpu")
    be._num_sms = sms
    assert be._splits(64 * 3, 8192, 16) == 4
    assert TritonBackend("cpu", num_splits=3)._splits(64 * 3, 8192, 16) == 3
    assert TritonBackend("cpu")._splits(64 * 3, 8192, 16) == 1  # interpreter: no rule


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_empty_batches(name: str) -> None:
    be = get_backend(name, "cpu")
    kc = torch.zeros(4, 16, 2, 64)
    q = torch.zeros(0, 4, 64)
    bt = torch.zeros(0, 2, dtype=torch.int32)
    md = build_varlen_metadata([], [])
    assert be.varlen_attention(q, kc, kc, bt, md, 0.1).shape == (0, 4, 64)
    lens = torch.zeros(0, dtype=torch.int32)
    assert be.decode_attention(q, kc, kc, bt, lens, 0.1).shape == (0, 4, 64)


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_strided_qkv_views(name: str) -> None:
    """q/k/v as column slices of one fused qkv projection, as the model produces them."""
    be = get_backend(name, "cpu")
    hq, hkv, d = 6, 2, 64
    q_lens, k_lens = [3, 1, 5], [3, 9, 5]
    b = make_paged_batch(q_lens, k_lens, hq, hkv, d, block_size=16, seed=11)
    qkv = torch.cat([b.q.reshape(-1, hq * d), torch.zeros(b.q.shape[0], 2 * hkv * d)], dim=1)
    q = qkv[:, : hq * d].view(-1, hq, d)
    assert not q.is_contiguous()
    b.q = q
    check_against_oracle(be, b, FP32_TOL, decode=False)
    # store_kv from strided views lands in the right slots
    kc, vc = torch.zeros_like(b.key_cache), torch.zeros_like(b.value_cache)
    fused = torch.cat([b.k.reshape(-1, hkv * d), b.v.reshape(-1, hkv * d)], dim=1)
    k_view = fused[:, : hkv * d].view(-1, hkv, d)
    v_view = fused[:, hkv * d :].view(-1, hkv, d)
    be.store_kv(k_view, v_view, kc, vc, b.slot_mapping)
    assert torch.equal(kc.view(-1, hkv, d)[b.slot_mapping], b.k)
    assert torch.equal(vc.view(-1, hkv, d)[b.slot_mapping], b.v)
