"""The Triton delta-rule decode step (``kernels/triton_deltanet.py``) against torch's
math, in place in scattered slots, through the interpreter on CPU (compiled for GPUs
in ``test_kern_triton_compile.py``; on CUDA in the GPU window)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.backend import available_backends

needs_interpreter = pytest.mark.skipif(
    torch.cuda.is_available() or "triton" not in available_backends("cpu"),
    reason="the interpreter runs without CUDA, with triton imported after TRITON_INTERPRET")


def _case(heads: int, dk: int, dv: int, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(heads * dk + dv)
    state = torch.randn(9, heads, dk, dv, generator=g)
    decay, beta = torch.rand(3, heads, generator=g), torch.rand(3, heads, generator=g)
    q, k = (torch.randn(3, heads, dk, generator=g) for _ in range(2))
    v = torch.randn(3, heads, dv, generator=g)
    return tuple(t.to(device) for t in (state, decay, beta, q, k, v))


def _expected(state, slots, decay, beta, q, k, v):
    s = state[slots] * decay[..., None, None]
    delta = (v - torch.einsum("shk,shkv->shv", k, s)) * beta[..., None]
    s = s + k[..., None] * delta[:, :, None, :]
    return s, torch.einsum("shk,shkv->shv", q, s)


@needs_interpreter
@pytest.mark.parametrize("heads,dk,dv", [(2, 16, 8), (3, 24, 40), (1, 128, 128)])
def test_decode_updates_the_slots_it_names_and_only_them(heads, dk, dv) -> None:
    """Key dims off a power of 2 (masked rows) and value dims over one tile."""
    from pagedserve.kernels import triton_deltanet

    state, decay, beta, q, k, v = _case(heads, dk, dv)
    slots = torch.tensor([7, 2, 4])
    want_state, want_out = _expected(state, slots, decay, beta, q, k, v)
    before = state.clone()
    out = triton_deltanet.decode(state, slots, decay, beta, q, k, v)
    torch.testing.assert_close(out, want_out, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(state[slots], want_state, atol=1e-5, rtol=1e-5)
    others = [i for i in range(9) if i not in slots.tolist()]
    assert torch.equal(state[others], before[others])
    assert triton_deltanet.block_v(128, 128) * 128 == 4096


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_decode_on_cuda_equals_torch() -> None:
    from pagedserve.kernels import triton_deltanet

    state, decay, beta, q, k, v = _case(32, 128, 128, "cuda")
    slots = torch.tensor([7, 2, 4], device="cuda")
    want_state, want_out = _expected(state, slots, decay, beta, q, k, v)
    out = triton_deltanet.decode(state, slots, decay, beta, q, k, v)
    torch.testing.assert_close(out, want_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state[slots], want_state, atol=1e-5, rtol=1e-5)
