"""GPT-OSS's attention sinks (a learnt logit per query head that joins every row's
softmax with a zero value) on every available backend against the dense oracle: decode
and mixed prefill batches, GQA, with a sliding window, through the native CPU kernel's
statistics and through Triton's split-K merge; and the oracle itself against Hugging
Face's eager GPT-OSS attention."""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve.kernels import available_backends, get_backend
from pagedserve.kernels.reference import dense_causal_attention
from pagedserve.kernels.testing import check_against_oracle, make_paged_batch, mixed_lengths

CPU_BACKENDS = available_backends("cpu")


def _batch(decode: bool, gqa: int, head_dim: int, seed: int):
    q_lens, k_lens = mixed_lengths(16, seed)
    if decode:
        q_lens = [1] * len(k_lens)
    return make_paged_batch(q_lens, k_lens, 2 * gqa, 2, head_dim, 16, seed=seed)


def _sinks(heads: int, seed: int) -> torch.Tensor:
    """Sinks on the scores' scale, some above the typical score (a large share)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(heads, generator=g) * 2.0


@pytest.mark.parametrize("name", CPU_BACKENDS)
@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize(("gqa", "head_dim", "window"), [(1, 64, None), (4, 128, None),
                                                         (3, 64, 9), (2, 64, 16)])
def test_sinks_match_oracle(name: str, decode: bool, gqa: int, head_dim: int,
                            window: int | None) -> None:
    b = _batch(decode, gqa, head_dim, gqa + head_dim)
    check_against_oracle(get_backend(name, "cpu"), b, 1e-5, decode=decode, window=window,
                         sinks=_sinks(2 * gqa, gqa))


def test_sinks_change_the_answer_as_hugging_face_does() -> None:
    """The oracle's sinks are transformers' eager GPT-OSS attention's: the sink column
    appended to the masked scores, softmaxed, then dropped."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    b = _batch(False, 2, 64, 3)
    scale = 1 / math.sqrt(64)
    sinks = _sinks(4, 1)
    args = (b.q, b.k, b.v, b.query_lens, b.key_lens, scale)
    with_sinks = dense_causal_attention(*args, sinks=sinks)
    assert (with_sinks - dense_causal_attention(*args)).abs().max() > 0.05
    # One no-context prompt through HF's function: [1, H, L, D] with a causal mask.
    lq = next(q for q, k in zip(b.query_lens, b.key_lens, strict=True) if q == k and q > 3)
    off = b.query_lens.index(lq)
    qo, ko = sum(b.query_lens[:off]), sum(b.key_lens[:off])
    q = b.q[qo:qo + lq].transpose(0, 1)[None]
    k = b.k[ko:ko + lq].transpose(0, 1)[None]
    v = b.v[ko:ko + lq].transpose(0, 1)[None]
    mask = torch.full((lq, lq), float("-inf")).triu(1)[None, None]

    class Module(torch.nn.Module):
        num_key_value_groups = 2
        training = False

    mod = Module()
    mod.sinks = sinks
    hf, _ = eager_attention_forward(mod, q, k, v, mask, scale)
    ours = with_sinks[qo:qo + lq]
    assert (hf[0] - ours).abs().max() < 1e-5


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_a_row_without_keys_stays_zero(name: str) -> None:
    b = make_paged_batch([1, 1], [0, 5], 4, 2, 64, 16, seed=2)
    check_against_oracle(get_backend(name, "cpu"), b, 1e-5, decode=True, sinks=_sinks(4, 2))


def test_the_native_cpu_kernel_runs_layers_with_sinks(monkeypatch) -> None:
    """Layers with sinks stay on the native kernel (decode rows, runs of prefill rows):
    its softmax statistics carry the sum the sink joins."""
    if "cpu" not in CPU_BACKENDS:
        pytest.skip("the native CPU kernels did not build")
    from pagedserve.kernels import cpu_native, torch_ref

    def refuse(*a, **k):
        raise AssertionError("a layer with sinks fell back to the torch path")

    monkeypatch.setattr(torch_ref.TorchBackend, "_attend_seqs", refuse)
    monkeypatch.setattr(torch_ref.TorchBackend, "_decode", refuse)
    seen: list[bool] = []
    real = cpu_native.paged_decode

    def spy(*a, **k):
        seen.append(k.get("sinks") is not None)
        return real(*a, **k)

    monkeypatch.setattr(cpu_native, "paged_decode", spy)
    for decode in (False, True):
        check_against_oracle(get_backend("cpu", "cpu"), _batch(decode, 2, 64, 5), 1e-5,
                             decode=decode, sinks=_sinks(4, 5))
    assert seen and all(seen)


def test_shared_prefixes_with_sinks_match_oracle() -> None:
    """Decode rows sharing a long prefix (which the CPU backend would otherwise split
    off, ``cpu_cascade``) still get the sink's share."""
    lens = [80, 81, 83, 90]
    b = make_paged_batch([1] * 4, lens, 4, 2, 64, 16, seed=9)
    b.block_table[1:, :5] = b.block_table[0, :5]  # the first 5 blocks shared
    for name in CPU_BACKENDS:
        be = get_backend(name, "cpu")
        seqlens = torch.tensor(lens, dtype=torch.int32)
        sinks = _sinks(4, 9)
        got = be.decode_attention(b.q, b.key_cache, b.value_cache, b.block_table, seqlens,
                                  0.125, sinks=sinks)
        want = be.decode_attention(b.q, b.key_cache, b.value_cache, b.block_table, seqlens,
                                   0.125)
        assert (got - want).abs().max() > 1e-3, name
        from pagedserve.kernels.torch_ref import TorchBackend

        ref = TorchBackend("cpu").decode_attention(b.q, b.key_cache, b.value_cache,
                                                   b.block_table, seqlens, 0.125, sinks=sinks)
        assert (got - ref).abs().max() < 1e-5, name


@pytest.mark.parametrize("name", CPU_BACKENDS)
@pytest.mark.parametrize("sinks", [torch.zeros(3), torch.zeros(4, 1),
                                   torch.zeros(4, dtype=torch.int64)])
def test_bad_sinks_are_a_value_error(name: str, sinks: torch.Tensor) -> None:
    b = _batch(True, 2, 64, 1)
    lens = torch.tensor(b.key_lens, dtype=torch.int32)
    with pytest.raises(ValueError, match="sinks"):
        get_backend(name, "cpu").decode_attention(b.q, b.key_cache, b.value_cache,
                                                  b.block_table, lens, 0.125, sinks=sinks)


@pytest.mark.skipif("triton" not in CPU_BACKENDS, reason="needs triton (interpreter on CPU)")
@pytest.mark.parametrize("window", [None, 9])
def test_triton_sinks_with_split_k(window: int | None) -> None:
    from pagedserve.kernels.triton_backend import TritonBackend

    b = _batch(True, 2, 64, 7)
    check_against_oracle(TritonBackend("cpu", num_splits=3), b, 1e-5, decode=True,
                         window=window, sinks=_sinks(4, 7))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_triton_sinks_match_oracle(dtype: torch.dtype) -> None:
    """The compiled kernel (GPT-OSS's shape: 8 query heads a KV head, head size 64, a
    128-token window), prefill and decode, one split and four."""
    from pagedserve.kernels.triton_backend import TritonBackend

    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    q_lens, k_lens = mixed_lengths(16, 3)
    k_lens = [k * 20 for k in k_lens]  # past the window
    q_lens = [min(q, k) for q, k in zip(q_lens, k_lens, strict=True)]
    for splits in (1, 4):
        be = TritonBackend("cuda", num_splits=splits)
        for decode in (False, True):
            ql = [1] * len(k_lens) if decode else q_lens
            b = make_paged_batch(ql, k_lens, 16, 2, 64, 16, dtype=dtype, device="cuda",
                                 seed=splits)
            check_against_oracle(be, b, tol, decode=decode, device="cuda", window=128,
                                 sinks=_sinks(16, splits).cuda())
