"""The W4A16 Triton GEMM (``kernels/triton_w4a16.py``) against the float matmul of the
weights it rebuilds: through the interpreter on CPU (fp32), compiled for GPUs in
``test_kern_triton_compile.py``, launched (16-bit) in the GPU window."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_int8
from pagedserve.kernels.backend import available_backends

needs_interpreter = pytest.mark.skipif(
    torch.cuda.is_available() or "triton" not in available_backends("cpu"),
    reason="the interpreter runs without CUDA, with triton imported after TRITON_INTERPRET")


def _weight(n: int, k: int, seed: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(device)
    return cpu_int8.quantize_asymmetric4(w)


@needs_interpreter
def test_packing_keeps_the_cpu_kernels_weights() -> None:
    """Codes, scales and minimums rebuild exactly the weights the CPU int4 kernel holds
    for the same codes (every nibble position, top bit set included)."""
    from pagedserve.kernels import triton_w4a16

    codes, scale, offs = _weight(48, 96, 0)
    codes[0, :8] = torch.arange(8, 16, dtype=torch.uint8)
    w4 = triton_w4a16.make(codes, scale, offs, torch.float32)
    assert w4.qweight.shape == (12, 48) and w4.qweight.dtype == torch.int32
    cpu = cpu_int8.make(codes, scale, 0, offs, bits=4)
    assert torch.equal(w4.dequantize(), cpu.dequantize())
    assert w4.nbytes == 12 * 48 * 4 + 2 * 3 * 48 * 4
    with pytest.raises(ValueError, match="groups of 32"):
        triton_w4a16.make(codes[:, :40], scale, offs, torch.float32)


@needs_interpreter
@pytest.mark.parametrize("m,n,k,bias", [
    (1, 96, 64, False),    # a decode row
    (17, 130, 96, True),   # rows past one 16-row tile, a partial column tile, a bias
    (40, 64, 32, False),   # one K step, a 64-row tile
    (0, 64, 32, False),    # no rows
])
def test_w4a16_equals_the_float_matmul(m, n, k, bias) -> None:
    from pagedserve.kernels import triton_w4a16

    w4 = triton_w4a16.make(*_weight(n, k, 1), torch.float32)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    ref = x @ w4.dequantize().t() + (b if bias else 0)
    got = triton_w4a16.linear(x, w4, b)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    x3 = torch.randn(2, 3, k, generator=g)  # leading dimensions kept
    torch.testing.assert_close(triton_w4a16.linear(x3, w4), x3 @ w4.dequantize().t(),
                               atol=1e-5, rtol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("splits", [2, 3, 7])
def test_split_k_adds_up_to_the_same_product(splits) -> None:
    """K cut into 2 or 3 runs of whole groups (7 asks for more than the 3 groups: one
    each), the partial sums added after, the bias counted once."""
    from pagedserve.kernels import triton_w4a16

    w4 = triton_w4a16.make(*_weight(80, 96, 5), torch.float32)
    g = torch.Generator().manual_seed(6)
    x, b = torch.randn(3, 96, generator=g), torch.randn(80, generator=g)
    torch.testing.assert_close(triton_w4a16.linear(x, w4, b, splits=splits),
                               x @ w4.dequantize().t() + b, atol=1e-5, rtol=1e-5)
    assert triton_w4a16.num_splits(64, 448, torch.device("cpu")) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cuda_w4a16_equals_the_float_matmul(dtype) -> None:
    """Compiled, Llama-8B's down projection shape, 1 / 16 / 33 / 200 rows: within 16-bit
    rounding of the fp32 matmul of the rebuilt weights (fp32: exact dots)."""
    from pagedserve.kernels import triton_w4a16

    n, k = 4096, 14336
    w4 = triton_w4a16.make(*_weight(n, k, 3, "cuda"), dtype)
    deq = w4.dequantize().t()
    for m in (1, 16, 33, 200):
        x = torch.randn(m, k, device="cuda").to(dtype)
        ref = x.float() @ deq
        got = triton_w4a16.linear(x, w4)
        tol = 1e-3 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), ref, atol=tol * ref.abs().max().item(),
                                   rtol=0)


@needs_interpreter
def test_a_projection_runs_its_int4_codes_and_moves_them() -> None:
    """A projection holding GPU int4 codes (``layers.quant`` on CUDA) multiplies through
    the kernel, bias included, and ``.to()`` carries the codes with the module (sleep
    moves a CUDA model to host memory and back)."""
    from torch import nn

    from pagedserve.kernels import triton_w4a16
    from pagedserve.worker.layers.packed import PackableLinear

    class Proj(PackableLinear):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(0), requires_grad=False)

    proj = Proj()
    proj.quant = triton_w4a16.make(*_weight(64, 96, 4), torch.float32)
    x, b = torch.randn(5, 96), torch.randn(64)
    torch.testing.assert_close(proj.matmul(x, b), x @ proj.quant.dequantize().t() + b,
                               atol=1e-5, rtol=1e-5)
    proj.to("meta")
    assert proj.quant.qweight.is_meta and proj.quant.scale.is_meta and proj.quant.offs.is_meta
