"""The int8 linear kernel (``cpu_int8.c``) against its torch arithmetic, and that
arithmetic against plain matmuls.

The kernel's integer dot products are exact, so it must equal
``cpu_int8.reference`` to fp32 rounding on every shape: output tails that
are not whole 16-lane blocks, an odd last block, 1-9 rows (the 4-row
blocks' tails), strided rows, the symmetric (zero 128), Q4_0 (zero 8) and
Q4_1 (zero 0 plus offsets) encodings. Activations already on the int8 grid
make the whole product exact against a float64 matmul of the dequantised
weight, which checks the scales' bookkeeping end to end.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_int8

native = pytest.mark.skipif(not cpu_int8.native_available(),
                            reason="no native int8 kernel (AVX512-VNNI or AVX2) on this CPU / build")


def _weight(n: int, k: int, kind: str, seed: int = 0,
            pack: bool | None = None) -> cpu_int8.Int8Weight:
    """``sym``: online int8; ``q4_0`` / ``q4_1``: GGUF's 4-bit blocks held as 8-bit codes;
    ``q4_0/4`` / ``q4_1/4``: the same packed two codes to a byte."""
    g = torch.Generator().manual_seed(seed)
    if kind == "sym":
        w = torch.randn(n, k, generator=g) * 0.05
        codes, scale = cpu_int8.quantize_symmetric(w)
        return cpu_int8.make(codes, scale, 128, pack_for_kernel=pack)
    kind, _, bits = kind.partition("/")
    bits = int(bits or 8)
    scale = torch.rand(n, k // 32, generator=g) * 0.01 + 1e-3
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    if kind == "q4_0":
        return cpu_int8.make(codes, scale, 8, pack_for_kernel=pack, bits=bits)
    offs = -torch.rand(n, k // 32, generator=g) * 0.08
    return cpu_int8.make(codes, scale, 0, offs, pack_for_kernel=pack, bits=bits)


KINDS = ["sym", "q4_0", "q4_1", "q4_0/4", "q4_1/4"]


@native
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,k", [(1, 32), (15, 64), (17, 96), (48, 32), (33, 576), (960, 576)])
@pytest.mark.parametrize("m", [1, 3, 4, 5, 9])
def test_kernel_equals_reference(kind: str, n: int, k: int, m: int) -> None:
    packed = _weight(n, k, kind, seed=n + k)
    plain = _weight(n, k, kind, seed=n + k, pack=False)
    assert packed.packed and not plain.packed
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    got = cpu_int8.linear(x, packed)
    want = cpu_int8.reference(x, plain)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@native
def test_strided_rows_bias_and_bf16() -> None:
    w = _weight(40, 64, "q4_1", seed=3)
    g = torch.Generator().manual_seed(4)
    wide = torch.randn(6, 100, generator=g)
    x = wide[:, 10:74]  # rows 100 apart
    bias = torch.randn(40, generator=g)
    got = cpu_int8.linear(x, w, bias)
    want = cpu_int8.reference(x.contiguous(), w) + bias
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    xb = x.bfloat16()
    out = cpu_int8.linear(xb.reshape(2, 3, 64), w)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3, 40)
    torch.testing.assert_close(out.float().reshape(6, 40),
                               cpu_int8.reference(xb.float(), w).bfloat16().float())


@pytest.mark.parametrize("kind", KINDS)
def test_activations_on_the_grid_are_exact(kind: str) -> None:
    """Integer activations whose group maxima are 127 quantise to themselves, so the
    product equals a float64 matmul of the dequantised weight (both paths)."""
    n, k = 37, 128
    g = torch.Generator().manual_seed(7)
    x = torch.randint(-127, 128, (5, k), generator=g).float()
    x.view(5, k // 32, 32)[:, :, 0] = 127.0
    for pack in ([False, True] if cpu_int8.native_available() else [False]):
        w = _weight(n, k, kind, seed=11, pack=pack)
        exact = (x.double() @ w.dequantize().double().T).float()
        torch.testing.assert_close(cpu_int8.linear(x, w), exact, atol=2e-5, rtol=2e-6)


@native
@pytest.mark.parametrize("zero", [128, 0, 255])
def test_extreme_8bit_codes_do_not_saturate(zero: int) -> None:
    """Codes 0 and 255 (Q8_0's -128 and 127) against activations of +-127 in the same
    pair: the largest products any byte-multiply path forms (AVX2's vpmaddubsw sums a
    pair in 16 bits), exact against float64 for any zero point."""
    n, k = 33, 64
    codes = torch.zeros(n, k, dtype=torch.uint8)
    codes[::2] = 255
    codes[:, 1::4] = 0
    codes[5] = torch.arange(k, dtype=torch.uint8) * 4  # a spread of the byte range
    x = torch.full((3, k), 127.0)
    x[:, 2::3] = -127.0
    x[1] = -x[1]
    scale = torch.full((n, k // 32), 0.5)
    w = cpu_int8.make(codes, scale, zero, pack_for_kernel=True)
    exact = (x.double() @ w.dequantize().double().T).float()
    assert cpu_int8.linear(x, w).equal(exact)


def test_quantize_symmetric_round_trip_and_pack_unpack() -> None:
    w = torch.randn(50, 96) * 0.1
    w[3, :32] = 0.0  # an all-zero group: scale 0, codes at the zero point
    codes, scale = cpu_int8.quantize_symmetric(w)
    assert codes.dtype == torch.uint8 and scale.shape == (50, 3)
    assert int(codes[3, :32].min()) == int(codes[3, :32].max()) == 128
    plain = cpu_int8.make(codes, scale, 128, pack_for_kernel=False)
    err = (plain.dequantize() - w).abs().view(50, 3, 32)
    assert bool((err <= scale.unsqueeze(-1) / 2 + 1e-7).all())
    packed = cpu_int8.pack(plain)
    back = cpu_int8.unpack(packed)
    assert torch.equal(back[0], codes) and torch.equal(back[1], scale) and back[2] is None
    assert torch.equal(packed.dequantize(), plain.dequantize())
    assert packed.nbytes == 64 * 96 + 4 * 64 * 3  # rows padded to whole 16-lane blocks


def test_four_bit_codes_pack_two_to_a_byte() -> None:
    """``quantize_asymmetric4`` is Q4_1's scheme (error within half a step, a group of one
    value exact), and its packed form halves the codes' bytes and unpacks to the same."""
    w = torch.randn(40, 64) * 0.1
    w[5, 32:] = 0.25  # a constant group: scale 0, the minimum is the value
    codes, scale, offs = cpu_int8.quantize_asymmetric4(w)
    assert int(codes.max()) <= 15 and float(scale[5, 1]) == 0.0
    plain = cpu_int8.make(codes, scale, 0, offs, pack_for_kernel=False, bits=4)
    err = (plain.dequantize() - w).abs().view(40, 2, 32)
    assert bool((err <= scale.unsqueeze(-1) / 2 + 1e-6).all())
    assert torch.equal(plain.dequantize()[5, 32:], w[5, 32:])
    packed = cpu_int8.pack(plain)
    assert packed.codes.numel() == 48 * 64 // 2 and packed.bits == 4
    back = cpu_int8.unpack(packed)
    assert torch.equal(back[0], codes) and torch.equal(back[2], offs)
    assert torch.equal(packed.dequantize(), plain.dequantize())
    with pytest.raises(ValueError, match="bits must be 8, or 4"):
        cpu_int8.make(codes + 16, scale, 0, offs, bits=4)
    with pytest.raises(ValueError, match="bits must be 8, or 4"):
        cpu_int8.make(codes, scale, 0, offs, bits=2)


def test_four_bit_grid_weights_keep_their_grid() -> None:
    """Weights already on a 4-bit grid whose groups span 128 inputs (a GPTQ / AWQ
    checkpoint's) come back exactly, though a group of 32 often holds fewer than 16 of
    the levels (min-max over 32 would re-round those); weights off any grid keep Q4_1's
    min-max step. The native grid search agrees with the torch one, its oracle."""
    g = torch.Generator().manual_seed(3)
    scale = torch.rand(48, 2, 1, generator=g) * 0.02 + 0.001
    zero = torch.randint(4, 12, (48, 2, 1), generator=g)
    codes = torch.randint(0, 16, (48, 2, 128), generator=g)
    codes[:, :, 40:64] = torch.randint(5, 9, (48, 2, 24), generator=g)  # few levels there
    w = ((codes - zero) * scale).reshape(48, 256)
    q, step, offs = cpu_int8.quantize_asymmetric4(w)
    torch.testing.assert_close(cpu_int8.make(q, step, 0, offs, bits=4).dequantize(), w,
                               atol=1e-6, rtol=1e-5)
    minmax = (w.view(48, 8, 32).amax(-1) - w.view(48, 8, 32).amin(-1)) / 15
    assert not torch.allclose(step, minmax)
    groups = torch.cat([w.view(48, 8, 32), torch.randn(48, 8, 32, generator=g),
                        torch.full((1, 8, 32), 0.5)])  # on grids, off any, constant
    native = cpu_int8.grid_steps(groups)
    torch.testing.assert_close(native, cpu_int8.grid_steps(groups, native=False))
    assert bool((native[:48] > 0).all()) and not bool((native[48:] > 0).any())
    off = torch.randn(48, 256, generator=g)
    step = cpu_int8.quantize_asymmetric4(off)[1]
    torch.testing.assert_close(step, (off.view(48, 8, 32).amax(-1)
                                      - off.view(48, 8, 32).amin(-1)) / 15)


def test_reference_is_close_to_the_float_matmul() -> None:
    """Only the activations' rounding separates the int8 product from x @ W_deq^T:
    about 0.4% of a group's largest value per element."""
    w = _weight(300, 576, "sym", seed=5, pack=False)
    x = torch.randn(16, 576)
    ref = x @ w.dequantize().T
    got = cpu_int8.reference(x, w)
    assert float((got - ref).norm() / ref.norm()) < 0.01


def test_refusals_name_the_problem() -> None:
    with pytest.raises(ValueError, match="multiple of the group size"):
        cpu_int8.quantize_symmetric(torch.randn(4, 40))
    codes, scale = cpu_int8.quantize_symmetric(torch.randn(4, 64))
    with pytest.raises(ValueError, match="do not match groups"):
        cpu_int8.make(codes, scale[:, :1], 128)
    with pytest.raises(ValueError, match="zero point"):
        cpu_int8.make(codes, scale, 300)
    with pytest.raises(ValueError, match="offs"):
        cpu_int8.make(codes, scale, 0, torch.zeros(4, 1))
    w = cpu_int8.make(codes, scale, 128)
    with pytest.raises(ValueError, match="input has 32 features"):
        cpu_int8.linear(torch.randn(2, 32), w)


@native
def test_empty_batch() -> None:
    w = _weight(20, 64, "sym")
    assert cpu_int8.linear(torch.randn(0, 64), w).shape == (0, 20)
