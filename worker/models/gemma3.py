"""Gemma 3 and Gemma 2 text decoders (``gemma3_text``, ``gemma3``'s text half,
``gemma2``) on the Llama model's machinery.

Everything paged, sharded, staged, quantised or adapted works as for Llama: this only
swaps what Gemma does differently (``worker.gemma_config`` lists it): four
``1 + weight`` RMSNorms a layer with the attention's and the MLP's outputs normalised
before their residual add, a scaled embedding, GELU-tanh gating, a second RoPE table
for the sliding-window layers, and an optional final logit softcap. A multimodal
file's decoder (and image encoder) is read through ``models.multimodal``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels import AttentionBackend
from pagedserve.worker.config import ModelConfig
from pagedserve.worker.layers.attention import AttentionMetadata
from pagedserve.worker.layers.linear import LazyTensor
from pagedserve.worker.layers.norm import GemmaRMSNorm
from pagedserve.worker.layers.rotary import RotaryEmbedding
from pagedserve.worker.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from pagedserve.worker.models.llama_loading import _LAYER_RE, _copy_full
from pagedserve.worker.parallel import ParallelContext
from pagedserve.worker.pipeline import PipelineStage

_FF_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")


class GemmaMLP(LlamaMLP):
    """``down(gelu_tanh(gate(x)) * up(x))`` over the fused gate/up projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        i = gate_up.shape[1] // 2
        return self.down_proj(F.gelu(gate_up[:, :i], approximate="tanh") * gate_up[:, i:])


class Gemma3DecoderLayer(nn.Module):
    """``x + post_attn_norm(attn(in_norm(x)))``, then the same around the MLP with the
    pre / post feed-forward norms. The residual add is deferred into the next norm, as
    the Llama layer does: ``(x, residual)`` in and out, the hidden state their sum."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, backend: AttentionBackend,
                 dtype: torch.dtype, device: torch.device, index: int):
        super().__init__()
        for name in ("input_layernorm", "post_attention_layernorm", *_FF_NORMS):
            setattr(self, name, GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device))
        self.self_attn = LlamaAttention(cfg, ctx, backend, dtype, device, index)
        self.mlp = GemmaMLP(cfg, ctx, dtype, device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        h, _ = self.post_attention_layernorm(self.self_attn(h, cos, sin, kv_cache, md))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        h, _ = self.post_feedforward_layernorm(self.mlp(h))
        return h, residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's (and Gemma 2's) text decoder: a scaled embedding, Gemma layers, two
    RoPE tables (one base for Gemma 2), softcapped logits where the config says."""

    layer_cls = Gemma3DecoderLayer
    norm_cls = GemmaRMSNorm

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, backend: AttentionBackend,
                 dtype: torch.dtype, device: torch.device, stage: PipelineStage | None = None):
        if cfg.gemma is None:
            raise ValueError(f"model_type {cfg.model_type!r} is not a Gemma model")
        super().__init__(cfg, ctx, backend, dtype, device, stage)
        self.gemma = cfg.gemma
        # Sliding-window layers rotate with their own base (rope_local_base_freq, unscaled).
        self.rotary_local = RotaryEmbedding(cfg.head_dim, cfg.gemma.local_rope_theta, None,
                                            device, cfg.rotary_dim)
        self._local = [layer.self_attn.attn.window is not None for layer in self.layers]
        # transformers multiplies by sqrt(hidden) held in fp32, cast to the weights' dtype.
        self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5, dtype=torch.float32)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().embed(input_ids)
        return x * self.embed_scale.to(x.device, x.dtype)

    def layer_ropes(self, positions: torch.Tensor, dtype: torch.dtype
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        full = self.rotary.cos_sin(positions, dtype)
        local = self.rotary_local.cos_sin(positions, dtype) if any(self._local) else full
        return [local if is_local else full for is_local in self._local]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        cap = self.gemma.final_logit_softcapping
        if logits is not None and cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _expected_names(self) -> set[str]:
        names = super()._expected_names()
        for i in range(self.stage.start, self.stage.end):
            names |= {f"model.layers.{i}.{n}.weight" for n in _FF_NORMS}
        return names

    def _load_one(self, name: str, lazy: LazyTensor) -> None:
        m = _LAYER_RE.match(name)
        if m is not None and m.group(2).rpartition(".")[0] in _FF_NORMS \
                and name.endswith(".weight") and int(m.group(1)) < self.config.num_layers:
            layer = self.layers[int(m.group(1)) - self.stage.start]
            _copy_full(name, getattr(layer, m.group(2).rpartition(".")[0]).weight, lazy)
            return
        super()._load_one(name, lazy)
