"""Hugging Face's SmolLM3 (``model_type: smollm3``; SmolLM3-3B): the Llama decoder
with no positional rotation on some layers (``no_rope_layers``: 0 marks a NoPE layer,
every fourth in the release), which transformers' ``SmolLM3Attention`` skips RoPE
for. Those layers get an identity table (cos 1, sin 0), so the rest of the stack
(fused rotation, CUDA graphs, pipeline stages) is the Llama one. Sliding windows
apply only with ``use_sliding_window`` (``window_config``)."""

from __future__ import annotations

import torch

from pagedserve.worker.models.llama import LlamaForCausalLM


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` whose NoPE layers rotate by nothing."""

    def __init__(self, cfg, ctx, backend, dtype, device, stage=None) -> None:
        super().__init__(cfg, ctx, backend, dtype, device, stage)
        self._nope = [i in cfg.nope_layers for i in range(self.stage.start, self.stage.end)]

    def layer_ropes(self, positions: torch.Tensor, dtype: torch.dtype
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cos, sin = self.rotary.cos_sin(positions, dtype)
        if not any(self._nope):
            return [(cos, sin)] * len(self.layers)
        still = (torch.ones_like(cos), torch.zeros_like(sin))
        return [still if nope else (cos, sin) for nope in self._nope]
