"""NVIDIA's Nemotron 3 routed-expert blocks (``E`` in a Nemotron-H pattern: Nemotron 3
Nano 30B-A3B): DeepSeek-V3's routing (sigmoid scores, a learnt bias on the scores
that choose, groups ranked by their two best, the top k renormalised and scaled by
``routed_scaling_factor``) over experts that are not gated: ``down(relu(up(x))
** 2)``, as the dense MLP blocks are, and one shared expert of the same form
(``moe_shared_expert_intermediate_size`` wide) added to every token: transformers'
``NemotronHMoE``.

An expert's first projection is its up rows alone (``gate_up_parts`` 1), so tensor
and expert parallelism shard them as any other mixture's, and the shared expert's
down projection joins the routed experts' partial sums before the layer's one
all-reduce. On CUDA the fused Triton kernels run them (``triton_moe.experts``'s
``relu2``); the native CPU kernel bakes SwiGLU in, so on CPU this layer runs the loop
over the experts some row chose (oneDNN-packed).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from pagedserve.worker.layers.linear import ColumnParallelLinear, LazyTensor, RowParallelLinear
from pagedserve.worker.layers.moe import SparseMoE
from pagedserve.worker.moe_config import MoEConfig
from pagedserve.worker.parallel import ParallelContext

_SHARED = ("shared_experts.up_proj.weight", "shared_experts.down_proj.weight")


class NemotronMoE(SparseMoE):
    """A Nemotron 3 block's router, experts and shared expert (under ``mixer.``)."""

    plain_swiglu = False
    gate_up_parts = 1

    def __init__(self, hidden: int, moe: MoEConfig, ctx: ParallelContext, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__(hidden, replace(moe, shared_intermediate_size=0), ctx, dtype, device)
        self._names = {"up_proj": 0, "down_proj": 2}
        s = moe.shared_intermediate_size
        self.shared_up = ColumnParallelLinear(hidden, s, False, ctx, dtype, device) if s \
            else None
        self.shared_down = RowParallelLinear(s, hidden, False, ctx, dtype, device) if s \
            else None

    def _routed(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
                ) -> torch.Tensor:
        if not self.fused:
            return super()._routed(x, experts, weights)
        from pagedserve.kernels import triton_moe

        return triton_moe.experts(x, experts, weights, self.w13, self.w2,
                                  partial=self.expert_parallel, relu2=True)

    def _activate(self, e: int, up: torch.Tensor) -> torch.Tensor:
        return torch.relu(up).square()

    def _shared(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.shared_up is None:
            return None
        return self.shared_down.matmul(torch.relu(self.shared_up(x)).square())

    def expected_names(self) -> set[str]:
        names = super().expected_names()
        return names | set(_SHARED) if self.shared_up is not None else names

    def load(self, name: str, lazy: LazyTensor) -> bool:
        if name in _SHARED and self.shared_up is not None:
            (self.shared_up if "up_proj" in name else self.shared_down).load(lazy)
            return True
        return super().load(name, lazy)
