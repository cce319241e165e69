"""Zhipu's GLM-4 dense decoders (``model_type: glm4``: GLM-4-9B-0414, GLM-Z1): the
Llama decoder with a norm after each sublayer as well as before (``post_self_attn_
layernorm`` on the attention's output, ``post_mlp_layernorm`` on the MLP's, both
before their residual add: four norms a layer), its gate and up rows fused in one
``gate_up_proj`` (loaded as Phi-3's), biased q/k/v with an unbiased ``o_proj``,
and RoPE on the first half of each head in interleaved pairs (the loader reorders
q and k rows to our half-split rotation, ``fused_weights.neox_rows``)."""

from __future__ import annotations

import torch

from pagedserve.worker.layers.attention import AttentionMetadata
from pagedserve.worker.layers.norm import RMSNorm
from pagedserve.worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class Glm4DecoderLayer(LlamaDecoderLayer):
    """A Llama layer with ``post_self_attn_layernorm`` and ``post_mlp_layernorm``."""

    def __init__(self, cfg, ctx, backend, dtype, device, index: int) -> None:
        super().__init__(cfg, ctx, backend, dtype, device, index)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.post_self_attn_layernorm = RMSNorm(h, eps, dtype, device)
        self.post_mlp_layernorm = RMSNorm(h, eps, dtype, device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        a, _ = self.post_self_attn_layernorm(self.self_attn(h, cos, sin, kv_cache, md))
        h, residual = self.post_attention_layernorm(a, residual)
        m, _ = self.post_mlp_layernorm(self.mlp(h))
        return m, residual


class Glm4ForCausalLM(LlamaForCausalLM):
    """GLM-4: ``LlamaForCausalLM`` with ``Glm4DecoderLayer``."""

    layer_cls = Glm4DecoderLayer

    def _expected_names(self) -> set[str]:
        return super()._expected_names() | {
            f"model.layers.{i}.{n}.weight" for i in range(self.stage.start, self.stage.end)
            for n in ("post_self_attn_layernorm", "post_mlp_layernorm")}
