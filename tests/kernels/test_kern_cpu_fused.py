"""The native fused row ops (RMSNorm with residual, SiLU-and-multiply, rotary
embedding) against torch.

The model calls them on CPU fp32 and falls back to torch ops when they answer
None; greedy parity with transformers (tests/cluster) covers them end to end.
These pin the numerics per op, strided rows, empty batches and the fallbacks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_fused, cpu_native

pytestmark = pytest.mark.skipif(cpu_native.load() is None, reason="no C compiler")
RTOL = 2e-6  # fp32, only the summation order and the exp polynomial differ


def _norm_ref(x: torch.Tensor, res: torch.Tensor | None, w: torch.Tensor, eps: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + res if res is not None else x
    return w * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)), s


@pytest.mark.parametrize("rows", [0, 1, 7, 300])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_torch(rows: int, with_residual: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g) * 3
    res = torch.randn(rows, 576, generator=g) if with_residual else None
    w = torch.rand(576, generator=g) + 0.5
    got = cpu_fused.rms_norm(x, res, w, 1e-5)
    assert got is not None
    ref_out, ref_res = _norm_ref(x, res, w, 1e-5)
    torch.testing.assert_close(got[0], ref_out, rtol=RTOL, atol=1e-6)
    torch.testing.assert_close(got[1], ref_res, rtol=0, atol=0)
    if res is None:
        assert got[1] is x  # nothing to add: the input is the next residual


@pytest.mark.parametrize("with_residual", [False, True])
def test_gemma_norm_on_the_native_kernel_matches_its_torch_path(with_residual: bool) -> None:
    """Gemma's ``(1 + w)`` norm (fp32 rows) runs natively with ``1 + w`` as the weight;
    its torch path (3-D q / k norms) gives the same within the kernel's tolerance, and a
    weight loaded anew (``.data.copy_``, no version bump, or a new tensor) is read."""
    from pagedserve.worker.layers.norm import GemmaRMSNorm

    g = torch.Generator().manual_seed(5)
    norm = GemmaRMSNorm(576, 1e-6, torch.float32, torch.device("cpu"))
    x = torch.randn(9, 576, generator=g) * 3
    res = torch.randn(9, 576, generator=g) if with_residual else None
    for weight in (torch.randn(576, generator=g), torch.randn(576, generator=g)):
        norm.weight.data.copy_(weight)
        got = norm(x, res)
        torch_path = norm(x.unsqueeze(0), None if res is None else res.unsqueeze(0))
        s = x + res if res is not None else x
        ref = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)) * (1 + weight)
        torch.testing.assert_close(got[0], ref, rtol=RTOL, atol=1e-5)
        torch.testing.assert_close(torch_path[0][0], ref, rtol=RTOL, atol=1e-5)
        torch.testing.assert_close(got[1], s, rtol=0, atol=0)
    norm.weight = torch.nn.Parameter(torch.zeros(576), requires_grad=False)
    torch.testing.assert_close(norm(x, res)[0], s * torch.rsqrt(
        s.pow(2).mean(-1, keepdim=True) + 1e-6), rtol=RTOL, atol=1e-5)


def test_rms_norm_reads_strided_rows_and_leaves_inputs_alone() -> None:
    big = torch.randn(5, 1000)
    x = big[:, 100:164]  # rows 1000 floats apart
    res = torch.randn(5, 64)
    x0, res0 = x.clone(), res.clone()
    w = torch.rand(64) + 0.5
    out, new_res = cpu_fused.rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(out, _norm_ref(x0, res0, w, 1e-6)[0], rtol=RTOL, atol=1e-6)
    assert torch.equal(x, x0) and torch.equal(res, res0) and new_res.data_ptr() != res.data_ptr()


@pytest.mark.parametrize("rows", [0, 1, 64, 257])
def test_silu_and_mul_matches_torch(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    gu = torch.randn(rows, 2 * 384, generator=g) * 6  # deep into both tails of the sigmoid
    got = cpu_fused.silu_and_mul(gu)
    assert got is not None
    ref = F.silu(gu[:, :384]) * gu[:, 384:]
    torch.testing.assert_close(got, ref, rtol=RTOL, atol=1e-6)
    strided = torch.randn(3, 1000)[:, :768]
    torch.testing.assert_close(cpu_fused.silu_and_mul(strided),
                               F.silu(strided[:, :384]) * strided[:, 384:],
                               rtol=RTOL, atol=1e-6)


def _rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``q * cos + rotate_half(q) * sin`` with full-width cos/sin."""
    c, s = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    half = x.shape[-1] // 2
    return x * c + torch.cat((-x[..., half:], x[..., :half]), -1) * s


@pytest.mark.parametrize("tokens", [0, 1, 64, 300])
def test_rope_matches_torch_on_strided_qkv_rows(tokens: int) -> None:
    """q and k are views into one fused qkv row per token (the model's case)."""
    from pagedserve.worker.layers.rotary import RotaryEmbedding

    g = torch.Generator().manual_seed(tokens)
    hq, hkv, d = 9, 3, 64
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=g) * 4
    rot = RotaryEmbedding(d, 1e5, None, torch.device("cpu"))
    cos, sin = rot.cos_sin(torch.randint(0, 8192, (tokens,), generator=g), torch.float32)
    q = qkv[:, : hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(tokens, hkv, d)
    before = qkv.clone()
    for x in (q, k):
        got = cpu_fused.rope(x, cos, sin)
        assert got is not None and got.is_contiguous()
        torch.testing.assert_close(got, _rope_ref(x, cos, sin), rtol=RTOL, atol=1e-5)
    assert torch.equal(qkv, before)


BF16_ULP = 2.0 ** -7  # bf16 keeps 8 significant bits: one unit in the last place, relative


@pytest.mark.parametrize("with_residual", [False, True])
def test_bf16_rms_norm_rounds_where_the_torch_path_does(with_residual: bool) -> None:
    """Residual sum, normalised row and output rounded to bf16 like RMSNorm's torch path
    (transformers' order): equal to it within one bf16 step (only the fp32 sum order
    differs)."""
    from pagedserve.worker.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(11)
    x = (torch.randn(70, 576, generator=g) * 3).bfloat16()
    res = torch.randn(70, 576, generator=g).bfloat16() if with_residual else None
    norm = RMSNorm(576, 1e-5, torch.bfloat16, torch.device("cpu"))
    norm.weight.data = (torch.rand(576, generator=g) + 0.5).bfloat16()
    got_out, got_res = cpu_fused.rms_norm(x, res, norm.weight, 1e-5)
    assert got_out.dtype == got_res.dtype == torch.bfloat16
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_fused, "rms_norm", lambda *a: None)  # the module's torch path
        ref_out, ref_res = norm(x, res)
    assert torch.equal(got_res, ref_res)
    torch.testing.assert_close(got_out.float(), ref_out.float(), rtol=BF16_ULP, atol=1e-6)


def test_bf16_rope_matches_the_fp32_math_rounded_once() -> None:
    from pagedserve.worker.layers.rotary import RotaryEmbedding

    g = torch.Generator().manual_seed(12)
    qkv = (torch.randn(33, 15 * 64, generator=g) * 4).bfloat16()
    q = qkv[:, : 9 * 64].view(33, 9, 64)
    rot = RotaryEmbedding(64, 1e5, None, torch.device("cpu"))
    cos, sin = rot.cos_sin(torch.randint(0, 8192, (33,), generator=g), torch.bfloat16)
    got = cpu_fused.rope(q, cos, sin)
    assert got is not None and got.dtype == torch.bfloat16
    want = _rope_ref(q.float(), cos.float(), sin.float()).bfloat16()
    torch.testing.assert_close(got.float(), want.float(), rtol=BF16_ULP, atol=1e-6)


def test_other_tensors_get_none_so_the_caller_uses_torch(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    w = torch.ones(8)
    assert cpu_fused.rms_norm(torch.randn(2, 8, dtype=torch.float16), None,
                               w.half(), 1e-5) is None
    assert cpu_fused.rms_norm(torch.randn(8, 2).t(), None, w.view(2, 4)[0], 1e-5) is None
    assert cpu_fused.rms_norm(torch.randn(2, 8), torch.randn(2, 4), w, 1e-5) is None
    assert cpu_fused.silu_and_mul(torch.randn(2, 7)) is None  # no even split
    assert cpu_fused.silu_and_mul(torch.randn(2, 8, dtype=torch.bfloat16)) is None
    cs = torch.randn(2, 1, 4)
    assert cpu_fused.rope(torch.randn(2, 3, 8).transpose(0, 1), cs, cs) is None  # odd strides
    assert cpu_fused.rope(torch.randn(2, 3, 8).half(), cs.half(), cs.half()) is None
    assert cpu_fused.rope(torch.randn(2, 3, 8), torch.randn(2, 1, 3), cs) is None
    monkeypatch.setattr(cpu_native, "_tried", True)
    monkeypatch.setattr(cpu_native, "_lib", None)  # no library (switched off, no compiler)
    assert cpu_fused.rms_norm(torch.randn(2, 8), None, w, 1e-5) is None
    assert cpu_fused.silu_and_mul(torch.randn(2, 8)) is None
    assert cpu_fused.rope(torch.randn(2, 3, 8), cs, cs) is None
