"""GPT-OSS's routed experts: Mixtral-style top-k routing with a biased router, biased
gate/up and down projections, and a clamped SwiGLU.

Per token the router (a linear layer with a bias) scores every expert; the top k
are kept and their scores softmaxed (the same weights as a softmax over all
experts renormalised over the k). An expert computes ``gate_up = x W13 + b13``,
then ``(clamp(up, -L, L) + 1) * g * sigmoid(alpha g)`` with ``g = min(gate, L)``
(``swiglu_alpha`` 1.702, ``swiglu_limit`` L 7.0 in the releases), then ``h W2 +
b2``, scaled by its routing weight: Hugging Face's ``GptOssExperts``, whose sums
run in ascending expert order as ours do.

The checkpoint stores each layer's experts stacked and transposed (``gate_up_proj
[E, H, 2I]`` with gate and up interleaved column by column, ``down_proj [E, I,
H]``); they load into ``SparseMoE``'s layout (gate rows, then up rows), so tensor
and expert parallelism shard them as any other mixture's. Under tensor
parallelism each rank's down output is a partial sum that the layer's all-reduce
adds up: the down bias joins on rank 0 only (under expert parallelism, on the
rank holding the expert). On CUDA the fused Triton kernels take the biases and
the clamp (``triton_moe.experts``), so decode steps are captured in CUDA graphs;
on CPU the native expert kernel, which bakes plain SwiGLU in, is not used
(``plain_swiglu``): experts run the loop over the experts some row chose.
"""

from __future__ import annotations

import torch

from pagedserve.worker.layers.linear import LazyTensor
from pagedserve.worker.layers.moe import SparseMoE, _check, _param
from pagedserve.worker.moe_config import MoEConfig
from pagedserve.worker.parallel import ParallelContext

_NAMES = ("router.weight", "router.bias", "experts.gate_up_proj", "experts.gate_up_proj_bias",
          "experts.down_proj", "experts.down_proj_bias")


class GptOssMoE(SparseMoE):
    """A GPT-OSS layer's router and experts (``mlp.router``, ``mlp.experts``)."""

    plain_swiglu = False

    def __init__(self, hidden: int, moe: MoEConfig, ctx: ParallelContext, dtype: torch.dtype,
                 device: torch.device):
        super().__init__(hidden, moe, ctx, dtype, device)
        self.router_bias = _param((moe.num_experts,), dtype, device)
        self.w13_bias = _param((self.num_local_experts, 2 * self.local_i), dtype, device)
        self.w2_bias = _param((self.num_local_experts, hidden), dtype, device)
        # Sliced experts' partial sums meet in the all-reduce: one rank adds the bias.
        self.adds_down_bias = self.expert_parallel or ctx.rank == 0
        self.alpha, self.limit = moe.swiglu_alpha, moe.swiglu_limit

    def _routed(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
                ) -> torch.Tensor:
        if not self.fused:
            return super()._routed(x, experts, weights)
        from pagedserve.kernels import triton_moe

        return triton_moe.experts(x, experts, weights, self.w13, self.w2,
                                  partial=self.expert_parallel, b13=self.w13_bias,
                                  b2=self.w2_bias if self.adds_down_bias else None,
                                  clamp=(self.alpha, self.limit))

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate_linear(x, self.router) + self.router_bias

    def _gate_up(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return super()._gate_up(e, x) + self.w13_bias[e]

    def _activate(self, e: int, gate_up: torch.Tensor) -> torch.Tensor:
        i = gate_up.shape[1] // 2
        gate = gate_up[:, :i].clamp(max=self.limit)
        up = gate_up[:, i:].clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def _down(self, e: int, h: torch.Tensor) -> torch.Tensor:
        y = super()._down(e, h)
        return y + self.w2_bias[e] if self.adds_down_bias else y

    def expected_names(self) -> set[str]:
        return set(_NAMES)

    def load(self, name: str, lazy: LazyTensor) -> bool:
        """This rank's share of ``name`` (under ``mlp.``): gate and up de-interleaved into
        ``w13``'s halves, each cut to the rank's intermediate slice, down transposed."""
        e_all, h, full, li = self.num_experts, self.hidden, self.full_i, self.local_i
        if name == "router.weight":
            _check(name, lazy, (e_all, h))
            self.router.data.copy_(lazy[:])
            return True
        if name == "router.bias":
            _check(name, lazy, (e_all,))
            self.router_bias.data.copy_(lazy[:])
            return True
        shapes = {"experts.gate_up_proj": (e_all, h, 2 * full),
                  "experts.gate_up_proj_bias": (e_all, 2 * full),
                  "experts.down_proj": (e_all, full, h),
                  "experts.down_proj_bias": (e_all, h)}
        if name not in shapes:
            return False
        _check(name, lazy, shapes[name])
        rank = 0 if self.expert_parallel else self.ctx.rank
        lo, hi = rank * li, (rank + 1) * li
        for e, g in enumerate(self.held):  # another rank's experts are never read
            t = lazy[g:g + 1][0]
            if name == "experts.gate_up_proj":  # [H, 2I] -> gate rows, up rows of [2I, H]
                self.w13.data[e, :li].copy_(t[:, 0::2][:, lo:hi].T)
                self.w13.data[e, li:].copy_(t[:, 1::2][:, lo:hi].T)
            elif name == "experts.gate_up_proj_bias":
                self.w13_bias.data[e, :li].copy_(t[0::2][lo:hi])
                self.w13_bias.data[e, li:].copy_(t[1::2][lo:hi])
            elif name == "experts.down_proj":  # [I, H] -> [H, I] columns of the slice
                self.w2.data[e].copy_(t[lo:hi].T)
            else:
                self.w2_bias.data[e].copy_(t)
        return True
