"""Narrow KV caches (fp16, bf16, fp8 E4M3 / E5M2) under an fp32 or bf16 model.

Every available backend must widen the cached elements exactly and attend in
the query's precision: against the dense oracle on the dequantised K/V the
fp32 tolerance of the full-precision tests holds. Stores round as torch's
cast does (fp8 saturating), -1 slots are skipped, and block copy / swap move
fp8 blocks bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import available_backends, get_backend
from pagedserve.kernels.kv_quant import (
    check_kv_cache_dtype,
    kv_dtype_name,
    quantize,
    resolve_kv_cache_dtype,
    storage_view,
)
from pagedserve.kernels.testing import check_against_oracle, make_paged_batch, mixed_lengths

CPU_BACKENDS = available_backends("cpu")
KV_DTYPES = [torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
FP32_TOL = 1e-5
IDS = [kv_dtype_name(d) for d in KV_DTYPES]


@pytest.mark.parametrize("name", CPU_BACKENDS)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=IDS)
@pytest.mark.parametrize(("gqa", "head_dim"), [(1, 64), (3, 128)])
def test_varlen_over_narrow_cache(name: str, kv_dtype: torch.dtype, gqa: int,
                                  head_dim: int) -> None:
    q_lens, k_lens = mixed_lengths(16, gqa + head_dim)
    b = make_paged_batch(q_lens, k_lens, 2 * gqa, 2, head_dim, block_size=16,
                         seed=gqa, kv_dtype=kv_dtype)
    assert b.key_cache.dtype == kv_dtype
    check_against_oracle(get_backend(name, "cpu"), b, FP32_TOL, decode=False)


@pytest.mark.parametrize("name", CPU_BACKENDS)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=IDS)
@pytest.mark.parametrize(("gqa", "head_dim"), [(4, 64), (1, 128)])
def test_decode_over_narrow_cache(name: str, kv_dtype: torch.dtype, gqa: int,
                                  head_dim: int) -> None:
    k_lens = [1, 16, 17, 32, 5, 47, 0]
    b = make_paged_batch([1] * len(k_lens), k_lens, 2 * gqa, 2, head_dim, block_size=16,
                         seed=head_dim, kv_dtype=kv_dtype)
    check_against_oracle(get_backend(name, "cpu"), b, FP32_TOL, decode=True)


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_bf16_model_over_fp8_cache(name: str) -> None:
    q_lens, k_lens = mixed_lengths(16, 9)
    b = make_paged_batch(q_lens, k_lens, 6, 2, 64, block_size=16, dtype=torch.bfloat16,
                         garbage=3.0, kv_dtype=torch.float8_e4m3fn)
    check_against_oracle(get_backend(name, "cpu"), b, 2e-2, decode=False)
    check_against_oracle(get_backend(name, "cpu"), make_paged_batch(
        [1, 1, 1], [3, 40, 16], 6, 2, 64, block_size=16, dtype=torch.bfloat16, garbage=3.0,
        kv_dtype=torch.float8_e4m3fn), 2e-2, decode=True)


@pytest.mark.parametrize("name", CPU_BACKENDS)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=IDS)
def test_store_rounds_like_torch_and_skips_padding(name: str, kv_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    key = torch.randn(5, 2, 64, generator=g) * 40
    value = torch.randn(5, 2, 64, generator=g)
    key[0, 0, :4] = torch.tensor([1000.0, -1000.0, 1e6, 3e-5])  # saturate, and a subnormal
    kc = torch.zeros(3, 4, 2, 64, dtype=kv_dtype)
    vc = torch.zeros(3, 4, 2, 64, dtype=kv_dtype)
    slots = torch.tensor([5, -1, 0, 11, 6])
    get_backend(name, "cpu").store_kv(key, value, kc, vc, slots)
    flat_k, flat_v = storage_view(kc).view(12, 2, 64), storage_view(vc).view(12, 2, 64)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat_k[s], storage_view(quantize(key[t], kv_dtype)))
            assert torch.equal(flat_v[s], storage_view(quantize(value[t], kv_dtype)))
    written = set(s for s in slots.tolist() if s >= 0)
    for s in set(range(12)) - written:
        assert not flat_k[s].any() and not flat_v[s].any()
    if kv_dtype != torch.bfloat16:  # bf16 has fp32's range
        top = torch.finfo(kv_dtype).max
        assert kc.view(12, 2, 64)[5, 0, 2].item() == top
        if top < 1000:
            assert kc.view(12, 2, 64)[5, 0, :2].float().tolist() == [top, -top]
    assert torch.isfinite(kc.float()).all()


@pytest.mark.parametrize("name", CPU_BACKENDS)
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=IDS[2:])
def test_copy_and_swap_fp8_blocks_bit_exact(name: str, kv_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    caches = [quantize(torch.randn(6, 4, 2, 64, generator=g) * 10, kv_dtype) for _ in range(4)]
    before = [c.clone() for c in caches]
    be = get_backend(name, "cpu")
    be.copy_blocks([caches[0]], [caches[1]], torch.tensor([[0, 5], [2, 3]]))
    for src, dst in ((0, 5), (2, 3)):
        assert torch.equal(storage_view(caches[0][dst]), storage_view(before[0][src]))
        assert torch.equal(storage_view(caches[1][dst]), storage_view(before[1][src]))
    cpu_tier = [torch.zeros(4, 4, 2, 64, dtype=kv_dtype) for _ in range(2)]
    be.swap_blocks(caches[2:], cpu_tier, torch.tensor([[1, 0], [4, 3]]))
    assert torch.equal(storage_view(cpu_tier[0][3]), storage_view(caches[2][4]))
    be.swap_blocks(cpu_tier, caches[:2], torch.tensor([[0, 1]]))
    assert torch.equal(storage_view(caches[0][1]), storage_view(before[2][1]))


def test_names_resolve_and_bad_names_name_the_field() -> None:
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("FP8", torch.float32) == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.float32) == torch.float8_e5m2
    assert resolve_kv_cache_dtype("bf16", torch.float32) == torch.bfloat16
    for bad in ("int8", "fp4", "", 8):
        with pytest.raises(ValueError, match="kv_cache_dtype"):
            check_kv_cache_dtype(bad)  # type: ignore[arg-type]


def test_flash_takes_only_the_model_dtype() -> None:
    from pagedserve.kernels.flash import FlashBackend

    fb = FlashBackend.__new__(FlashBackend)
    assert fb.supports_kv_cache_dtype(torch.bfloat16, torch.bfloat16)
    assert not fb.supports_kv_cache_dtype(torch.float8_e4m3fn, torch.bfloat16)
    assert get_backend("torch").supports_kv_cache_dtype(torch.float8_e5m2, torch.float32)


@pytest.mark.parametrize("name", CPU_BACKENDS)
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["float16", "fp8_e4m3", "fp8_e5m2"])
def test_every_finite_code_is_widened_exactly(name: str, kv_dtype: torch.dtype) -> None:
    """One key per sequence: softmax is 1, so decode returns the value row itself, and
    every finite code of the format (subnormals included) must come back as torch's
    own widening of it."""
    bits = 16 if kv_dtype == torch.float16 else 8
    if bits == 16 and name == "triton":
        pytest.skip("65536 codes are too many rows for the interpreter; fp8 covers its path")
    codes = torch.arange(2**bits, dtype=torch.int32).to(
        torch.int16 if bits == 16 else torch.uint8)
    values = codes.view(kv_dtype)
    finite = torch.isfinite(values.float())
    d = 64
    rows = values[finite]
    rows = torch.cat([rows, rows[: (-rows.numel()) % d]]).view(-1, 1, 1, d)  # [S, B=1, 1, D]
    s = rows.shape[0]
    value_cache = rows.contiguous()
    key_cache = torch.zeros_like(value_cache)
    q = torch.zeros(s, 1, d)
    out = get_backend(name, "cpu").decode_attention(
        q, key_cache, value_cache, torch.arange(s, dtype=torch.int32)[:, None],
        torch.ones(s, dtype=torch.int32), 0.125)
    assert torch.equal(out, value_cache.float().view(s, 1, d))


def test_kv_scales_keep_keys_beyond_the_fp8_range() -> None:
    """Keys in the thousands saturate an unscaled E4M3 pool (max 448); with scales set
    from the step's own K/V (``calculate_kv_scales``) attention stays close to fp32."""
    from pagedserve.kernels.metadata import build_varlen_metadata
    from pagedserve.kernels.reference import dense_causal_attention
    from pagedserve.worker.layers.attention import AttentionMetadata, PagedAttention

    g = torch.Generator().manual_seed(5)
    t, hq, hkv, d, bs = 40, 4, 2, 64, 16
    q = torch.randn(t, hq, d, generator=g) * 0.01
    k = torch.randn(t, hkv, d, generator=g) * 1000
    v = torch.randn(t, hkv, d, generator=g) * 1000
    want = dense_causal_attention(q, k, v, [t], [t], d ** -0.5)
    md = AttentionMetadata(torch.arange(t), torch.arange(3, dtype=torch.int32)[None],
                           torch.tensor([t], dtype=torch.int32), False,
                           build_varlen_metadata([t], [t]))
    errors = {}
    for scaled in (False, True):
        cache = (torch.zeros(3, bs, hkv, d, dtype=torch.float8_e4m3fn),
                 torch.zeros(3, bs, hkv, d, dtype=torch.float8_e4m3fn))
        attn = PagedAttention(hq, hkv, d, get_backend("torch"))
        if scaled:
            attn.use_kv_scales(torch.device("cpu"))
            attn.arm_calibration()
        out = attn(q, k, v, cache, md).view(t, hq, d)
        errors[scaled] = ((out - want).norm() / want.norm()).item()
        if scaled:
            assert not attn.calibrating and attn.k_scale.item() > 1  # set once, from this step
    assert errors[True] < 0.1 < 0.5 < errors[False], errors  # fp8 keeps ~3 mantissa bits
