"""IBM Granite 3.x decoders: the Llama decoder with Granite's four scalars
(``granite_config``): embeddings scaled on the first pipeline stage, attention
scaled by ``attention_multiplier`` (``LlamaAttention`` reads it), each layer's
attention and MLP outputs scaled before their residual add, logits divided on
the last stage. The scalings run on the activations, not folded into weights:
the embedding is tied to the LM head in the releases, and a layer may be
quantised (int8 / int4) or adapted (LoRA) as soon as it is loaded."""

from __future__ import annotations

import torch

from pagedserve.worker.layers.attention import AttentionMetadata
from pagedserve.worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class GraniteDecoderLayer(LlamaDecoderLayer):
    """A Llama layer whose two sublayer outputs are scaled by ``residual_multiplier``."""

    def __init__(self, cfg, ctx, backend, dtype, device, index: int) -> None:
        super().__init__(cfg, ctx, backend, dtype, device, index)
        self.residual_scale = cfg.granite.residual

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache, md) * self.residual_scale
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h) * self.residual_scale, residual


class GraniteForCausalLM(LlamaForCausalLM):
    """Granite 3.x: ``LlamaForCausalLM`` with its embedding and logit scalings."""

    layer_cls = GraniteDecoderLayer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.config.granite.embedding

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        return None if logits is None else logits / self.config.granite.logits
