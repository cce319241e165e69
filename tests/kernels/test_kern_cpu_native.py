"""The compiled CPU decode kernel: against the oracle, at its edges, and its fallback.

The oracle sweep over every CPU backend (test_kern_attention.py) already runs
it through ``get_backend("cpu")``; these cover what that sweep cannot reach:
the per-sequence vs per-head work split, long contexts that regrow the score
buffer, bad block tables (an error, never a read outside the pool), and the
build cache and the switch that turns the kernel off.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedserve.kernels import available_backends, cpu_native, get_backend
from pagedserve.kernels.reference import dense_causal_attention
from pagedserve.kernels.testing import check_against_oracle, make_paged_batch

pytestmark = pytest.mark.skipif(
    "cpu" not in available_backends("cpu"), reason="no C compiler for the native kernel"
)
FP32_TOL = 1e-5


@pytest.mark.parametrize("num_seqs", [1, 3, 40])  # per-head split below 4 x threads
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_native_decode_matches_oracle(num_seqs: int, block_size: int) -> None:
    lens = [(7 * i) % 61 + 1 for i in range(num_seqs)]
    b = make_paged_batch([1] * num_seqs, lens, 12, 4, 64, block_size, seed=num_seqs)
    check_against_oracle(get_backend("cpu"), b, FP32_TOL, decode=True)


def test_native_decode_long_context_regrows_scratch() -> None:
    b = make_paged_batch([1, 1, 1], [17, 3000, 40], 9, 3, 64, 16, seed=3)
    check_against_oracle(get_backend("cpu"), b, FP32_TOL, decode=True)


def test_native_equals_torch_decode_with_empty_rows() -> None:
    b = make_paged_batch([1] * 5, [9, 33, 1, 64, 20], 9, 3, 64, 16, seed=5)
    lens = torch.tensor([9, 0, 1, 64, 0])
    args = (b.q[:5], b.key_cache, b.value_cache, b.block_table, lens, 0.125)
    native = get_backend("cpu").decode_attention(*args)
    ref = get_backend("torch").decode_attention(*args)
    torch.testing.assert_close(native, ref, atol=FP32_TOL, rtol=0)
    assert native[1].abs().max() == 0 and native[4].abs().max() == 0


def test_bad_block_table_raises_instead_of_reading_outside_the_pool() -> None:
    b = make_paged_batch([1, 1], [20, 20], 9, 3, 64, 16)
    lens = torch.tensor([20, 20])
    bad = b.block_table.clone()
    bad[1, 1] = b.key_cache.shape[0] + 5
    with pytest.raises(ValueError, match="block id outside"):
        cpu_native.paged_decode(b.q[:2], b.key_cache, b.value_cache, bad, lens, 20, 0.125)
    bad[1, 1] = -1
    with pytest.raises(ValueError, match="block id outside"):
        cpu_native.paged_decode(b.q[:2], b.key_cache, b.value_cache, bad, lens, 20, 0.125)
    with pytest.raises(ValueError, match="do not fit queries"):
        cpu_native.paged_decode(b.q[:2, :, :32], b.key_cache, b.value_cache, b.block_table,
                                lens, 20, 0.125)
    with pytest.raises(ValueError, match="overruns its block table"):
        cpu_native.paged_decode(b.q[:2], b.key_cache, b.value_cache, b.block_table,
                                torch.tensor([20, 99]), 99, 0.125)


@pytest.mark.parametrize("head_dim", [64, 128, 80])
def test_bf16_caches_are_widened_exactly(head_dim: int) -> None:
    """bf16 K/V read by the native kernel: with fp32 queries the result is the fp32
    math on the bf16 values (fp32 tolerance against the fp64 oracle on those values)."""
    lens = [20, 7, 130, 1]
    b = make_paged_batch([1] * 4, lens, 8, 2, head_dim, 16, dtype=torch.bfloat16, seed=head_dim)
    assert cpu_native.supports(b.q, b.key_cache, b.value_cache)
    scale = head_dim ** -0.5
    out = cpu_native.paged_decode(b.q.float(), b.key_cache, b.value_cache, b.block_table,
                                  torch.tensor(lens), max(lens), scale)
    assert out.dtype == torch.float32
    ref = dense_causal_attention(b.q.double(), b.k.double(), b.v.double(), b.query_lens,
                                 b.key_lens, scale)
    torch.testing.assert_close(out.double(), ref, atol=FP32_TOL, rtol=0)
    check_against_oracle(get_backend("cpu"), b, 2e-2, decode=True)  # bf16 in, bf16 out


def test_fp16_caches_take_the_torch_path() -> None:
    b = make_paged_batch([1, 1], [20, 7], 8, 2, 64, 16, dtype=torch.float16)
    assert not cpu_native.supports(b.q, b.key_cache, b.value_cache)
    check_against_oracle(get_backend("cpu"), b, 2e-2, decode=True)


def test_non_contiguous_caches_take_the_torch_path() -> None:
    b = make_paged_batch([1, 1], [20, 7], 8, 2, 64, 16)
    wide_k = torch.cat([b.key_cache, b.key_cache], dim=-1)[..., :64]  # same values, strided
    wide_v = torch.cat([b.value_cache, b.value_cache], dim=-1)[..., :64]
    assert not cpu_native.supports(b.q, wide_k, wide_v)
    lens = torch.tensor([20, 7])
    args = (b.q[:2], wide_k, wide_v, b.block_table, lens, 0.125)
    torch.testing.assert_close(get_backend("cpu").decode_attention(*args),
                               get_backend("torch").decode_attention(*args))


@pytest.fixture
def fresh_loader(monkeypatch: pytest.MonkeyPatch, tmp_path):
    """Forget the loaded library so load() runs again against a private cache dir."""
    monkeypatch.setattr(cpu_native, "_tried", False)
    monkeypatch.setattr(cpu_native, "_lib", None)
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_build_is_cached_per_source_and_cpu(fresh_loader) -> None:
    assert cpu_native.load() is not None
    built = list((fresh_loader / "native").glob("cpu_kernels_*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    cpu_native._tried = False
    assert cpu_native.load() is not None
    assert built[0].stat().st_mtime_ns == mtime  # reused, not rebuilt


def test_switch_off_falls_back_to_torch(fresh_loader, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_NATIVE_KERNELS", "0")
    assert "cpu" not in available_backends("cpu")
    assert get_backend().name == "torch"
    with pytest.raises(RuntimeError, match="PAGEDSERVE_NATIVE_KERNELS=0"):
        get_backend("cpu")


def test_missing_compiler_falls_back(fresh_loader, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", str(fresh_loader / "no-such-cc"))
    assert cpu_native.load() is None
    assert get_backend().name == "torch"


def test_a_failed_build_is_noted_and_not_retried(fresh_loader, monkeypatch: pytest.MonkeyPatch
                                                 ) -> None:
    """A compiler that fails leaves a ``.failed`` note: the next process goes straight to
    the torch path instead of compiling again (ranks starting together each paid the
    whole build before)."""
    cc = fresh_loader / "failing-cc"
    calls = fresh_loader / "calls"
    cc.write_text(f"#!/bin/sh\necho x >> {calls}\necho 'no such intrinsic' >&2\nexit 1\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    assert cpu_native.load() is None
    notes = list((fresh_loader / "native").glob("cpu_kernels_*.failed"))
    assert len(notes) == 1 and "no such intrinsic" in notes[0].read_text()
    compiled = len(calls.read_text().split())
    assert compiled >= 1  # (the first failure stops the others, which may not have run)
    cpu_native._tried = False
    assert cpu_native.load() is None
    assert len(calls.read_text().split()) == compiled  # not run again
    notes[0].unlink()
    cpu_native._tried = False
    assert cpu_native.load() is None
    assert len(calls.read_text().split()) > compiled  # deleting the note retries


def test_attention_kernels_build_at_o1_without_512_bit_vectors(monkeypatch) -> None:
    """Without AVX-512, GCC -O3 takes minutes on the attention kernels' split vectors;
    they build at -O1 with loop peeling there, and at -O3 elsewhere."""
    from pagedserve.kernels import cpu_native_build as native_build

    monkeypatch.setattr(native_build.platform, "machine", lambda: "x86_64")
    decode = native_build.HERE / "cpu_paged_decode.c"
    lora = native_build.HERE / "cpu_lora.c"
    avx2 = "flags : fpu sse2 avx avx2 fma"
    narrow = native_build.source_flags(decode, avx2)
    assert "-O1" in narrow and "-fpeel-loops" in narrow and "-O3" not in narrow
    assert native_build.source_flags(lora, avx2) == native_build.FLAGS
    assert native_build.source_flags(decode, avx2 + " avx512f avx512bw") == native_build.FLAGS


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "varlen"])
def test_latent_width_shared_cache_matches_oracle(decode: bool) -> None:
    """DeepSeek's latent attention as the kernels see it: one KV "head" 576 numbers wide
    (512 compressed + 64 rotated) under 16 query heads, the value cache being the key
    cache itself (``KVCache(shared_kv=True)``)."""
    q_lens = [1, 1, 1, 1] if decode else [5, 1, 17, 3]
    b = make_paged_batch(q_lens, [40, 7, 130, 3], 16, 1, 576, 16, seed=2)
    b = dataclasses.replace(b, v=b.k, value_cache=b.key_cache)
    assert cpu_native.supports(b.q, b.key_cache, b.value_cache)
    for name in ("cpu", "torch"):
        check_against_oracle(get_backend(name), b, FP32_TOL, decode=decode)
