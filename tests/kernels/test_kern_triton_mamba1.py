"""The Triton Mamba-1 kernels (``kernels/triton_mamba1.py``) against the torch paths of
``layers.mamba1``: the one-token update in place in scattered slots (only them
touched) and a prompt's scan, through the interpreter on CPU (compiled for GPUs in
``test_kern_triton_compile.py``; on CUDA in the GPU window)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_mamba
from pagedserve.kernels.backend import available_backends
from pagedserve.worker.layers import mamba1

needs_interpreter = pytest.mark.skipif(
    torch.cuda.is_available() or "triton" not in available_backends("cpu"),
    reason="the interpreter runs without CUDA, with triton imported after TRITON_INTERPRET")


def _inputs(rows: int, width: int, n: int, device: str, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x, dt = torch.randn(rows, width, generator=g), torch.rand(rows, width, generator=g)
    a = -torch.rand(width, n, generator=g) * 3
    b, c = torch.randn(rows, n, generator=g), torch.randn(rows, n, generator=g)
    return tuple(t.to(device) for t in (x, dt, a, b, c))


def _check(width: int, n: int, device: str, monkeypatch) -> None:
    from pagedserve.kernels import triton_mamba1

    x, dt, a, b, c = _inputs(3, width, n, device, width + n)
    ssm = torch.randn(9, width, n, generator=torch.Generator().manual_seed(n)).to(device)
    slots = torch.tensor([7, 2, 4], device=device)
    monkeypatch.setattr(cpu_mamba, "available", lambda s: False)
    want = ssm.clone()
    want_y = mamba1._state_update(want.cpu(), slots.cpu(), x.cpu(), dt.cpu(), a.cpu(),
                                  b.cpu(), c.cpu())
    got = ssm.clone()
    y = triton_mamba1.update(got, slots, x, dt, a, b, c)
    torch.testing.assert_close(y.cpu(), want_y, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
    x, dt, a, b, c = _inputs(21, width, n, device, 2 * width + n)
    h0 = torch.randn(width, n, generator=torch.Generator().manual_seed(1)).to(device)
    y, final = triton_mamba1.scan(x, dt, a, b, c, h0)
    want_y, want_final = mamba1.selective_scan(*(t.cpu() for t in (x, dt, a, b, c, h0)),
                                               chunk=8)
    torch.testing.assert_close(y.cpu(), want_y, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final.cpu(), want_final, atol=1e-4, rtol=1e-4)


@needs_interpreter
@pytest.mark.parametrize("width,n", [(24, 5), (130, 16)])
def test_kernels_equal_torch(width: int, n: int, monkeypatch) -> None:
    """Channels over one tile and off a multiple of it, state dims off a power of 2."""
    _check(width, n, "cpu", monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernels_on_cuda_equal_torch(monkeypatch) -> None:
    _check(1024, 16, "cuda", monkeypatch)
