"""Gemma 2's attention logit softcap (``softcap * tanh(s / softcap)`` on each scaled
score before the mask and softmax) on every available backend against the dense
oracle, alone and with a sliding window; queries are scaled up so most scores are past
the cap and capping changes the answer."""

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
    b = make_paged_batch(q_lens, k_lens, 2 * gqa, 2, head_dim, 16, seed=seed)
    b.q.mul_(6.0)
    return b


@pytest.mark.parametrize("name", CPU_BACKENDS)
@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize(("gqa", "head_dim", "window"), [(1, 64, None), (4, 128, None),
                                                         (2, 64, 9)])
def test_softcap_matches_oracle(name: str, decode: bool, gqa: int, head_dim: int,
                                window: int | None) -> None:
    b = _batch(decode, gqa, head_dim, gqa + head_dim)
    check_against_oracle(get_backend(name, "cpu"), b, 1e-5, decode=decode, window=window,
                         softcap=2.5)


def test_the_native_cpu_kernel_runs_softcapped_layers(monkeypatch) -> None:
    """Gemma 2's layers stay on the native kernel (decode rows, runs of prefill rows),
    not the torch path."""
    if "cpu" not in CPU_BACKENDS:
        pytest.skip("the native CPU kernels did not build")
    from pagedserve.kernels import cpu_native, torch_ref

    def refuse(*a, **k):
        raise AssertionError("a softcapped layer fell back to the torch path")

    monkeypatch.setattr(torch_ref.TorchBackend, "_attend_seqs", refuse)
    monkeypatch.setattr(torch_ref.TorchBackend, "_decode", refuse)
    caps: list[float | None] = []
    real = cpu_native.paged_decode

    def spy(*a, **k):
        caps.append(k.get("softcap"))
        return real(*a, **k)

    monkeypatch.setattr(cpu_native, "paged_decode", spy)
    for decode in (False, True):
        check_against_oracle(get_backend("cpu", "cpu"), _batch(decode, 2, 64, 5), 1e-5,
                             decode=decode, softcap=2.5)
    assert caps and all(c == 2.5 for c in caps)


def test_the_softcap_changes_the_answer() -> None:
    b = _batch(False, 2, 64, 3)
    scale = 1 / math.sqrt(64)
    args = (b.q, b.k, b.v, b.query_lens, b.key_lens, scale)
    capped = dense_causal_attention(*args, softcap=2.5)
    assert (capped - dense_causal_attention(*args)).abs().max() > 0.05
    assert (capped - dense_causal_attention(*args, softcap=3.0)).abs().max() > 1e-3


@pytest.mark.parametrize("name", CPU_BACKENDS)
@pytest.mark.parametrize("softcap", [0, -1.0, True, "50"])
def test_bad_softcap_is_a_value_error(name: str, softcap: object) -> None:
    b = _batch(True, 1, 64, 1)
    lens = torch.tensor(b.key_lens, dtype=torch.int32)
    with pytest.raises(ValueError, match="softcap"):
        get_backend(name, "cpu").decode_attention(b.q, b.key_cache, b.value_cache,
                                                  b.block_table, lens, 0.125,
                                                  softcap=softcap)  # type: ignore[arg-type]


@pytest.mark.skipif("triton" not in CPU_BACKENDS, reason="needs triton (interpreter on CPU)")
def test_triton_softcap_with_split_k() -> None:
    from pagedserve.kernels.triton_backend import TritonBackend

    b = _batch(True, 2, 64, 7)
    check_against_oracle(TritonBackend("cpu", num_splits=3), b, 1e-5, decode=True,
                         softcap=2.5)
