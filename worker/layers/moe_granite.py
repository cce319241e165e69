"""Granite's mixtures of experts (``granitemoe``, ``granitemoeshared``): Mixtral's
routing (softmax over the top-k logits) over experts stacked in two tensors per
layer, ``block_sparse_moe.input_linear.weight [E, 2I, H]`` (each expert's gate rows,
then its up rows) and ``output_linear.weight [E, H, I]``, with the router at
``router.layer.weight``; ``granitemoeshared`` adds an always-on SwiGLU expert,
``shared_mlp.input_linear`` (gate rows, then up) and ``output_linear``, filed beside
the experts under the decoder layer, not under ``block_sparse_moe``. Everything
else (tensor and expert parallelism, the native and Triton kernels, int8) is
``SparseMoE``'s; this class only maps the names and cuts the stacks."""

from __future__ import annotations

import torch

from pagedserve.worker.layers.linear import LazyTensor
from pagedserve.worker.layers.moe import SparseMoE, _check
from pagedserve.worker.models.fused_weights import split_rows

SHARED = "shared_mlp."


class GraniteMoE(SparseMoE):
    """A Granite layer's router, stacked experts and (``granitemoeshared``) shared MLP."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.checkpoint_prefix = "block_sparse_moe"

    def _shared_names(self) -> set[str]:
        if self.shared_gate_up is None:
            return set()
        return {SHARED + "input_linear.weight", SHARED + "output_linear.weight"}

    def expected_names(self) -> set[str]:
        return {"router.layer.weight", "input_linear.weight", "output_linear.weight"}

    def layer_names(self) -> set[str]:
        return super().layer_names() | self._shared_names()

    def claims(self, rest: str) -> str | None:
        return rest if rest in self._shared_names() else super().claims(rest)

    def load(self, name: str, lazy: LazyTensor) -> bool:
        e_all, h, full, li = self.num_experts, self.hidden, self.full_i, self.local_i
        if name == "router.layer.weight":
            _check(name, lazy, (e_all, h))
            self.router.data.copy_(lazy[:])
            return True
        if name == SHARED + "input_linear.weight" and self.shared_gate_up is not None:
            s = self.moe.shared_intermediate_size
            for i, rows in enumerate(split_rows(lazy, [s, s], name)):
                self.shared_gate_up.load(i, rows)
            return True
        if name == SHARED + "output_linear.weight" and self.shared_down is not None:
            self.shared_down.load(lazy)
            return True
        if name not in ("input_linear.weight", "output_linear.weight"):
            return False
        gate_up = name == "input_linear.weight"
        _check(name, lazy, (e_all, 2 * full, h) if gate_up else (e_all, h, full))
        rank = 0 if self.expert_parallel else self.ctx.rank
        lo, hi = rank * li, (rank + 1) * li
        for e, g in enumerate(self.held):  # another rank's experts are never read
            t: torch.Tensor = lazy[g:g + 1][0]
            if gate_up:
                self.w13.data[e, :li].copy_(t[lo:hi])
                self.w13.data[e, li:].copy_(t[full + lo:full + hi])
            else:
                self.w2.data[e].copy_(t[:, lo:hi])
        return True
