"""The flash-attn backend's plumbing, on CPU, against a stand-in ``flash_attn`` module.

flash-attn only builds for CUDA and has never run for this project (README, "Not yet
verified"), so what can be checked here is the adapter in ``kernels/flash.py``: that its
calls bind to flash-attn's public signatures (``flash_attn_varlen_func`` and
``flash_attn_with_kvcache``, parameter lists as in flash-attn 2.6+), with the dtypes and
layouts flash-attn documents (int32 cumulative lengths, cache lengths and block table,
``[num_blocks, block_size, Hkv, D]`` caches with ``block_size % 256 == 0``), and that
flash-attn's documented semantics (causal mask aligned to the bottom right, GQA head
groups, an all-masked row gives zeros) then give the oracle's answer. The stand-in
implements those documented semantics with plain torch; the real kernels are checked by
``tests/kernels/test_kern_gpu.py`` on a GPU box that has flash-attn.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from pagedserve.kernels.testing import check_against_oracle, make_paged_batch, mixed_lengths

TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2}


def _check_ints(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        assert t.dtype == torch.int32, f"flash-attn takes int32 {name}, got {t.dtype}"


def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    assert q.dtype in (torch.float16, torch.bfloat16) and k_cache.dtype == q.dtype
    assert v_cache.dtype == q.dtype and k_cache.shape == v_cache.shape
    assert k_cache.shape[1] % 256 == 0, "paged KV needs page_block_size % 256 == 0"
    assert q.shape[-2] % k_cache.shape[2] == 0 and q.shape[-1] == k_cache.shape[3]


def _gather(cache: torch.Tensor, table_row: torch.Tensor, n: int) -> torch.Tensor:
    """Positions ``[0, n)`` of one sequence through its block table row."""
    p = torch.arange(n)
    blocks = table_row[p // cache.shape[1]].long()
    assert bool((blocks >= 0).all()), "a position below the length maps to block -1"
    return cache[blocks, p % cache.shape[1]]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            causal: bool, window_size: tuple[int, int], softcap: float) -> torch.Tensor:
    """flash-attn's documented math for one sequence: q [Lq, Hq, D], k/v [Lk, Hkv, D]."""
    lq, lk = q.shape[0], k.shape[0]
    g = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if softcap > 0:  # softcap * tanh(s / softcap), before the mask
        s = torch.tanh(s / softcap) * softcap
    # Aligned to the bottom right: query i sits at key position i + lk - lq; causal keeps
    # keys j <= it, window_size (left, right) keeps j in [pos - left, pos + right].
    pos, j = torch.arange(lq)[:, None] + lk - lq, torch.arange(lk)[None]
    keep = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        assert window_size[1] in (-1, 0), "causal takes no right window"
        keep &= j <= pos
    if window_size[0] >= 0:
        keep &= j >= pos - window_size[0]
    if window_size[1] >= 0:
        keep &= j <= pos + window_size[1]
    s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)  # an all-masked row gives zeros
    return torch.einsum("hqk,khd->qhd", p, v).to(q.dtype)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    assert block_table is not None and dropout_p == 0.0
    _check_ints(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, block_table=block_table)
    _check_cache(q, k, v)
    q_lens, k_lens = cu_seqlens_q.diff().tolist(), cu_seqlens_k.diff().tolist()
    assert max_seqlen_q >= max(q_lens) and max_seqlen_k >= max(k_lens)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out = torch.empty_like(q)
    for b, (lq, lk) in enumerate(zip(q_lens, k_lens, strict=True)):
        s = int(cu_seqlens_q[b])
        out[s:s + lq] = _attend(q[s:s + lq], _gather(k, block_table[b], lk),
                                _gather(v, block_table[b], lk), scale, causal, window_size,
                                softcap)
    return out


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False):
    assert k is None and v is None and block_table is not None and q.dim() == 4
    _check_ints(cache_seqlens=cache_seqlens, block_table=block_table)
    _check_cache(q, k_cache, v_cache)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    return torch.stack([
        _attend(q[b], _gather(k_cache, block_table[b], n), _gather(v_cache, block_table[b], n),
                scale, causal, window_size, softcap)
        for b, n in enumerate(cache_seqlens.tolist())])


@pytest.fixture
def flash(monkeypatch: pytest.MonkeyPatch):
    """``FlashBackend`` on CPU over the stand-in (whose parameter lists are flash-attn's,
    so a call that would not bind there raises TypeError here); calls are recorded."""
    calls: list[str] = []
    module = types.ModuleType("flash_attn")
    for fn in (flash_attn_varlen_func, flash_attn_with_kvcache):

        def recorded(*a, _fn=fn, **k):
            calls.append(_fn.__name__)
            return _fn(*a, **k)

        setattr(module, fn.__name__, recorded)
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    from pagedserve.kernels.flash import FlashBackend

    be = FlashBackend("cpu")
    be.calls = calls
    return be


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("gqa", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_flash_adapter_matches_the_oracle(flash, dtype: torch.dtype, gqa: int,
                                          head_dim: int) -> None:
    """Mixed batches (decode rows, prefills, chunked prefills; lengths 1, 256, 257, 512,
    255) and decode batches with an empty sequence, through 256-token blocks."""
    q_lens, k_lens = mixed_lengths(256, gqa + head_dim)
    b = make_paged_batch(q_lens, k_lens, 2 * gqa, 2, head_dim, 256, dtype=dtype, garbage=3.0,
                         seed=gqa)
    check_against_oracle(flash, b, TOL[dtype], decode=False)
    b = make_paged_batch([1] * len(k_lens), [*k_lens[:-1], 0], 2 * gqa, 2, head_dim, 256,
                         dtype=dtype, garbage=3.0, seed=gqa + 1)
    check_against_oracle(flash, b, TOL[dtype], decode=True)
    assert flash.calls == ["flash_attn_varlen_func", "flash_attn_with_kvcache"]


@pytest.mark.parametrize("window", [1, 255, 256, 300])
def test_flash_adapter_passes_the_sliding_window(flash, window: int) -> None:
    """A sliding window becomes flash-attn's ``window_size=(window - 1, 0)`` in both calls."""
    q_lens, k_lens = mixed_lengths(256, window)
    b = make_paged_batch(q_lens, k_lens, 4, 2, 64, 256, dtype=torch.bfloat16, garbage=3.0)
    check_against_oracle(flash, b, TOL[torch.bfloat16], decode=False, window=window)
    b = make_paged_batch([1] * len(k_lens), k_lens, 4, 2, 64, 256, dtype=torch.bfloat16,
                         garbage=3.0, seed=1)
    check_against_oracle(flash, b, TOL[torch.bfloat16], decode=True, window=window)


def test_flash_adapter_passes_the_softcap(flash) -> None:
    """Gemma 2's attention softcap becomes flash-attn's ``softcap`` in both calls."""
    q_lens, k_lens = mixed_lengths(256, 3)
    b = make_paged_batch(q_lens, k_lens, 4, 2, 64, 256, dtype=torch.bfloat16, garbage=3.0)
    b.q.mul_(8)  # scores past the cap, so capping changes the answer
    check_against_oracle(flash, b, TOL[torch.bfloat16], decode=False, window=300, softcap=2.0)
    b = make_paged_batch([1] * len(k_lens), k_lens, 4, 2, 64, 256, dtype=torch.bfloat16,
                         garbage=3.0, seed=1)
    b.q.mul_(8)
    check_against_oracle(flash, b, TOL[torch.bfloat16], decode=True, softcap=2.0)


def test_flash_adapter_refuses_what_flash_attn_cannot_take(flash) -> None:
    """Blocks not a multiple of 256 and fp32 are refused before any call, naming why."""
    b = make_paged_batch([1, 1], [5, 40], 4, 2, 64, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="block_size % 256"):
        check_against_oracle(flash, b, 1.0, decode=True)
    b = make_paged_batch([1, 1], [5, 40], 4, 2, 64, 256)
    with pytest.raises(ValueError, match="fp16/bf16"):
        check_against_oracle(flash, b, 1.0, decode=True)
    assert flash.calls == []
    assert flash.supports_block_size(512) and not flash.supports_block_size(16)
    assert not flash.supports_kv_cache_dtype(torch.float8_e4m3fn, torch.float16)
