"""The fused MoE Triton kernels (``kernels/triton_moe.py``) against a torch loop over
experts, through the interpreter on CPU (fp32); compiled for GPUs in
``test_kern_triton_compile.py``, launched in the GPU window."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.backend import available_backends
from tests.kernels.moe_helpers import expert_loop

needs_interpreter = pytest.mark.skipif(
    torch.cuda.is_available() or "triton" not in available_backends("cpu"),
    reason="the interpreter runs without CUDA, with triton imported after TRITON_INTERPRET")


@needs_interpreter
def test_align_groups_pairs_by_expert_in_padded_blocks() -> None:
    from pagedserve.kernels.triton_moe import align

    g = torch.Generator().manual_seed(0)
    for t, e, k, bm in ((1, 4, 2, 4), (7, 5, 3, 4), (40, 8, 2, 16), (3, 3, 3, 2)):
        chosen = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        pairs, block_experts = align(chosen, e, bm)
        n = t * k
        bound = -(-(n + e * (bm - 1)) // bm) * bm  # static: T, K, E and the block only
        assert pairs.shape == (bound,) and block_experts.shape == (bound // bm,)
        real = pairs[pairs < n]
        assert sorted(real.tolist()) == list(range(n))  # every pair exactly once
        flat = chosen.reshape(-1)
        for b, ex in enumerate(block_experts.tolist()):
            rows = pairs[b * bm:(b + 1) * bm]
            rows = rows[rows < n]
            if ex < 0:
                assert len(rows) == 0
            else:  # a block is one expert's, its pairs in their original order
                assert (flat[rows] == ex).all() and rows.tolist() == sorted(rows.tolist())
        used = block_experts[block_experts >= 0]
        assert used.tolist() == sorted(used.tolist())


@needs_interpreter
@pytest.mark.parametrize("e,h,i,k", [
    (8, 64, 48, 3),    # expert width not a multiple of the 64-column tile
    (4, 80, 32, 2),    # hidden size with a partial tile and a partial K step
    (5, 32, 16, 1),    # top-1
    (3, 48, 16, 3),    # every token takes every expert
])
def test_fused_experts_equal_the_expert_loop(e, h, i, k) -> None:
    from pagedserve.kernels import triton_moe

    g = torch.Generator().manual_seed(e * 10 + h)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h ** 0.5
    w2 = torch.randn(e, h, i, generator=g) / i ** 0.5
    for t in (1, 6, 37):
        x = torch.randn(t, h, generator=g)
        chosen = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        weights = torch.rand(t, k, generator=g)
        got = triton_moe.experts(x, chosen, weights, w13, w2)
        torch.testing.assert_close(got, expert_loop(x, chosen, weights, w13, w2),
                                   atol=1e-5, rtol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("e,k", [(5, 2), (2, 3)])
def test_another_ranks_choices_get_no_slot_and_add_nothing(e, k) -> None:
    """Expert parallelism: a choice of -1 (an expert another rank holds) is given no row
    of any block, its output row stays zero, and a rank may hold fewer experts than the
    top-k; the padded list keeps its static bound."""
    from pagedserve.kernels import triton_moe

    g = torch.Generator().manual_seed(e + k)
    h, i = 32, 16
    w13 = torch.randn(e, 2 * i, h, generator=g) / h ** 0.5
    w2 = torch.randn(e, h, i, generator=g) / i ** 0.5
    for t in (1, 9):
        x = torch.randn(t, h, generator=g)
        chosen = torch.randint(-1, e, (t, k), generator=g)
        chosen[0] = -1
        weights = torch.rand(t, k, generator=g)
        pairs, block_experts = triton_moe.align(chosen, e, 4)
        n = t * k
        assert pairs.shape == (-(-(n + e * 3) // 4) * 4,)
        held = torch.nonzero(chosen.reshape(-1) >= 0).reshape(-1)
        assert sorted(pairs[pairs < n].tolist()) == held.tolist()
        for b, ex in enumerate(block_experts.tolist()):  # a block is one held expert's
            rows = pairs[b * 4:(b + 1) * 4]
            assert (chosen.reshape(-1)[rows[rows < n]] == ex).all()
        got = triton_moe.experts(x, chosen, weights, w13, w2, partial=True)
        torch.testing.assert_close(got, expert_loop(x, chosen, weights, w13, w2),
                                   atol=1e-5, rtol=1e-5)
        assert not got[0].any()


@needs_interpreter
def test_sparse_moe_layer_uses_the_fused_kernels() -> None:
    """The layer's Triton path (what CUDA runs) equals its torch loop on the same weights."""
    from pagedserve.worker.layers import moe as moe_mod
    from pagedserve.worker.moe_config import MoEConfig
    from pagedserve.worker.parallel import ParallelContext

    cfg = MoEConfig(6, 2, 32, True, 48, (0,))
    layer = moe_mod.SparseMoE(64, cfg, ParallelContext(), torch.float32, torch.device("cpu"))
    torch.manual_seed(0)
    for p in layer.parameters():
        p.data.normal_(0, 0.2)
    x = torch.randn(21, 64)
    with torch.no_grad():
        loop = layer(x)
        layer.fused = True
        fused = layer(x)
    torch.testing.assert_close(fused, loop, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or "triton" not in available_backends("cuda"),
                    reason="needs a CUDA device with triton")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cuda_fused_experts_equal_the_expert_loop(dtype, tol) -> None:
    """Compiled on the GPU: Qwen3-30B-A3B's expert shapes (128 experts, top 8, 768 wide),
    a decode-sized and a prefill-sized batch; bf16 against the fp32 loop on the same
    (rounded) values."""
    from pagedserve.kernels import triton_moe

    g = torch.Generator(device="cuda").manual_seed(0)
    e, h, i, k = 128, 2048, 768, 8
    w13 = (torch.randn(e, 2 * i, h, generator=g, device="cuda") / h ** 0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g, device="cuda") / i ** 0.5).to(dtype)
    for t in (4, 300):
        x = torch.randn(t, h, generator=g, device="cuda").to(dtype)
        chosen = torch.rand(t, e, generator=g, device="cuda").topk(k, dim=-1).indices
        weights = torch.rand(t, k, generator=g, device="cuda")
        got = triton_moe.experts(x, chosen, weights, w13, w2).float()
        ref = expert_loop(x.float(), chosen, weights, w13.float(), w2.float())
        torch.testing.assert_close(got, ref, atol=tol * ref.abs().max().item(), rtol=tol)
        # Expert parallelism over 8 ranks: this rank holds experts 0-15, the rest are -1.
        mine = torch.where(chosen < 16, chosen, -1)
        got = triton_moe.experts(x, mine, weights, w13[:16], w2[:16], partial=True).float()
        ref = expert_loop(x.float(), mine, weights, w13[:16].float(), w2[:16].float())
        torch.testing.assert_close(got, ref, atol=tol * ref.abs().max().item(), rtol=tol)


@needs_interpreter
@pytest.mark.parametrize("e,h,i,k", [(4, 64, 48, 2), (5, 80, 32, 3)])
def test_gpt_oss_experts_equal_their_loop(e, h, i, k) -> None:
    """GPT-OSS's biases and clamped SwiGLU in the fused kernels, on products large enough
    for the clamp to bite; without the down bias (the ranks that do not add it)."""
    from pagedserve.kernels import triton_moe
    from tests.kernels.moe_helpers import gpt_oss_expert_loop

    g = torch.Generator().manual_seed(e + h)
    w13 = torch.randn(e, 2 * i, h, generator=g) * 3 / h ** 0.5
    w2 = torch.randn(e, h, i, generator=g) / i ** 0.5
    b13, b2 = torch.randn(e, 2 * i, generator=g), torch.randn(e, h, generator=g)
    x = torch.randn(23, h, generator=g)
    chosen = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(23)])
    weights = torch.rand(23, k, generator=g)
    assert (x @ w13[0, :i].T + b13[0, :i]).max() > 7.0  # the clamp at 7 is exercised
    for down_bias in (b2, torch.zeros_like(b2)):
        got = triton_moe.experts(x, chosen, weights, w13, w2, b13=b13,
                                 b2=down_bias if down_bias.any() else None,
                                 clamp=(1.702, 7.0))
        want = gpt_oss_expert_loop(x, chosen, weights, w13, w2, b13, down_bias, 1.702, 7.0)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("e,h,i,k", [(8, 64, 48, 3), (4, 80, 32, 2)])
def test_squared_relu_experts_equal_their_loop(e, h, i, k) -> None:
    """Nemotron 3's ungated experts (``relu2``: up rows alone) in the fused kernels,
    against ``down(relu(up(x)) ** 2)`` expert by expert, and with another rank's
    choices (expert parallelism) adding nothing."""
    from pagedserve.kernels import triton_moe

    g = torch.Generator().manual_seed(e * h)
    w1 = torch.randn(e, i, h, generator=g) / h ** 0.5
    w2 = torch.randn(e, h, i, generator=g) / i ** 0.5
    x = torch.randn(19, h, generator=g)
    chosen = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(19)])
    weights = torch.rand(19, k, generator=g)
    want = torch.zeros_like(x)
    for t in range(19):
        for j in range(k):
            ex = int(chosen[t, j])
            want[t] += weights[t, j] * (torch.relu(x[t] @ w1[ex].T).square() @ w2[ex].T)
    got = triton_moe.experts(x, chosen, weights, w1, w2, relu2=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    mine = torch.where(chosen < e // 2, chosen, -1)
    want_mine = torch.zeros_like(x)
    for t in range(19):
        for j in range(k):
            ex = int(mine[t, j])
            if ex >= 0:
                want_mine[t] += weights[t, j] * (torch.relu(x[t] @ w1[ex].T).square()
                                                 @ w2[ex].T)
    got = triton_moe.experts(x, mine, weights, w1, w2, partial=True, relu2=True)
    torch.testing.assert_close(got, want_mine, atol=1e-5, rtol=1e-5)
