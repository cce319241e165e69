"""The native MoE kernel (``kernels/cpu_moe.c``) against a torch loop over experts, fp32
and bf16."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_moe, cpu_native
from tests.kernels.moe_helpers import expert_loop

pytestmark = pytest.mark.skipif(cpu_native.load() is None,
                                reason="no C compiler: native CPU kernels off")


def _routing(t: int, e: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    chosen = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    return chosen, torch.rand(t, k, generator=g)


@pytest.mark.parametrize("e,h,i,k", [
    (8, 64, 48, 3),     # gate/up: one 32-column tile and a 16 tail
    (4, 80, 32, 2),     # down: one 64-column tile and a 16 tail
    (16, 128, 256, 4),  # whole tiles only
    (5, 16, 16, 1),     # the smallest shapes, top-1
    (3, 48, 16, 3),     # every token takes every expert
])
def test_kernel_equals_expert_loop(e, h, i, k) -> None:
    g = torch.Generator().manual_seed(e * 100 + h)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h ** 0.5
    w2 = torch.randn(e, h, i, generator=g) / i ** 0.5
    p13, p2 = cpu_moe.pack(w13, w2)
    for t in (1, 2, 5, 37, 130):
        x = torch.randn(t, h, generator=g)
        chosen, weights = _routing(t, e, k, g)
        got = cpu_moe.experts(x, chosen, weights, p13, p2)
        torch.testing.assert_close(got, expert_loop(x, chosen, weights, w13, w2),
                                   atol=2e-5, rtol=2e-5)


def test_strided_rows_and_idle_experts() -> None:
    """Rows of a wider tensor (a column slice) and experts no token chose."""
    g = torch.Generator().manual_seed(7)
    w13, w2 = torch.randn(6, 64, 32, generator=g), torch.randn(6, 32, 32, generator=g)
    p13, p2 = cpu_moe.pack(w13, w2)
    wide = torch.randn(9, 48, generator=g)
    x = wide[:, 8:40]
    chosen = torch.tensor([[1, 4]] * 9)  # experts 0, 2, 3, 5 idle
    weights = torch.rand(9, 2, generator=g)
    torch.testing.assert_close(cpu_moe.experts(x, chosen, weights, p13, p2),
                               expert_loop(x, chosen, weights, w13, w2), atol=1e-4, rtol=1e-5)


def test_out_of_range_routing_is_refused_not_computed() -> None:
    w13, w2 = torch.randn(4, 32, 16), torch.randn(4, 16, 16)
    p13, p2 = cpu_moe.pack(w13, w2)
    x = torch.randn(3, 16)
    with pytest.raises(ValueError, match="out of range"):  # an expert past the last
        cpu_moe.experts(x, torch.tensor([[0, 4]] * 3), torch.rand(3, 2), p13, p2)


@pytest.mark.parametrize("e,k", [(6, 2), (2, 4), (1, 3)])
def test_another_ranks_choices_are_skipped(e, k) -> None:
    """Expert parallelism: a choice of -1 is an expert another rank holds. It runs
    nothing and adds nothing, a token with none here gets zeros, and a rank may hold
    fewer experts than a token's top-k (DeepSeek-V3: 256 experts, top 8, over 64 ranks
    is 4 a rank)."""
    g = torch.Generator().manual_seed(e * 10 + k)
    w13, w2 = torch.randn(e, 64, 32, generator=g) / 6, torch.randn(e, 32, 32, generator=g) / 6
    p13, p2 = cpu_moe.pack(w13, w2)
    for t in (1, 3, 40):
        x = torch.randn(t, 32, generator=g)
        chosen = torch.randint(-1, e, (t, k), generator=g)
        chosen[0] = -1  # the first token's experts are all elsewhere
        weights = torch.rand(t, k, generator=g)
        got = cpu_moe.experts(x, chosen, weights, p13, p2)
        torch.testing.assert_close(got, expert_loop(x, chosen, weights, w13, w2),
                                   atol=2e-5, rtol=2e-5)
        assert not got[0].any()


def test_bf16_experts_within_one_rounding_of_fp32() -> None:
    """bf16 weights and rows widened exactly, summed in fp32, rounded once: the result is
    the fp32 computation on the same (bf16) values, to bf16 precision."""
    g = torch.Generator().manual_seed(3)
    w13 = (torch.randn(8, 96, 80, generator=g) / 9).bfloat16()
    w2 = (torch.randn(8, 80, 48, generator=g) / 7).bfloat16()
    p13, p2 = cpu_moe.pack(w13, w2)
    assert p13.dtype == torch.bfloat16
    for t in (1, 6, 50):
        x = torch.randn(t, 80, generator=g).bfloat16()
        chosen, weights = _routing(t, 8, 2, g)
        got = cpu_moe.experts(x, chosen, weights, p13, p2)
        assert got.dtype == torch.bfloat16
        ref = expert_loop(x.float(), chosen, weights, w13.float(), w2.float())
        torch.testing.assert_close(got.float(), ref, atol=1e-2, rtol=8e-3)
    with pytest.raises(ValueError, match="activations"):
        cpu_moe.experts(x.float(), chosen, weights, p13, p2)


def test_availability_and_pack_checks() -> None:
    cpu = torch.device("cpu")
    assert cpu_moe.available(cpu, torch.float32, 64, 32)
    assert cpu_moe.available(cpu, torch.bfloat16, 64, 32)
    assert not cpu_moe.available(cpu, torch.float16, 64, 32)
    assert not cpu_moe.available(cpu, torch.float32, 64, 24)  # width not a multiple of 16
    assert not cpu_moe.available(torch.device("meta"), torch.float32, 64, 32)
    with pytest.raises(ValueError, match="do not pair"):
        cpu_moe.pack(torch.randn(4, 32, 16), torch.randn(4, 16, 8))
