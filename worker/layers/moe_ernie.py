"""Ernie 4.5's mixture of experts (``ernie4_5_moe``): ``SparseMoE`` with Qwen's expert
names and shared experts, whose routing bias (on the softmax scores that choose,
``moe_config._ernie``) the checkpoint files as ``moe_statics.e_score_correction_bias``
of shape ``[1, E]`` rather than DeepSeek-V3's ``gate.e_score_correction_bias``."""

from __future__ import annotations

from pagedserve.worker.layers.linear import LazyTensor
from pagedserve.worker.layers.moe import SparseMoE, _check

STATICS = "moe_statics.e_score_correction_bias"
_V3_NAME = "gate.e_score_correction_bias"


class ErnieMoE(SparseMoE):
    """A layer of Ernie 4.5's routed and shared experts."""

    def expected_names(self) -> set[str]:
        return (super().expected_names() - {_V3_NAME}) | {STATICS}

    def load(self, name: str, lazy: LazyTensor) -> bool:
        if name == STATICS:
            assert self.score_bias is not None
            _check(name, lazy, (1, self.num_experts))
            self.score_bias.data.copy_(lazy[:].reshape(-1))
            return True
        return name != _V3_NAME and super().load(name, lazy)
