"""IBM Granite 4.0-H (``granitemoehybrid``): Mamba-2 layers with a few attention
layers between them, each followed by Granite's MLP (routed experts beside a
shared SwiGLU, or the shared one alone in the dense micro release), with Granite's
four scalars (``granite_config``) and, in the releases, no positional rotation
(``position_embedding_type: nope``).

An attention layer is Granite 3's (``GraniteDecoderLayer``) and pages its KV as
any; a Mamba layer swaps the attention for ``layers.mamba2.Mamba2Mixer``, which
reads and updates each sequence's slot of recurrent state (``worker.mamba_state``,
handed down in ``AttentionMetadata.mamba``). The KV pool holds the attention
layers only (``worker.kv_layers``): the forward gets their caches and gives each
to its layer."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.worker.layers.attention import AttentionMetadata
from pagedserve.worker.layers.linear import LazyTensor
from pagedserve.worker.layers.mamba2 import Mamba2Mixer
from pagedserve.worker.layers.moe import SparseMoE
from pagedserve.worker.layers.moe_granite import GraniteMoE
from pagedserve.worker.layers.norm import RMSNorm
from pagedserve.worker.models.fused_weights import split_rows
from pagedserve.worker.models.granite import GraniteDecoderLayer, GraniteForCausalLM
from pagedserve.worker.models.hybrid import RecurrentHybridMixin
from pagedserve.worker.models.llama import LlamaMLP

_SHARED = ("shared_mlp.input_linear.weight", "shared_mlp.output_linear.weight")


class GraniteMambaLayer(nn.Module):
    """A Granite 4.0-H layer whose mixer is Mamba-2: norm, mixer, norm, MLP, each
    sublayer's output scaled by ``residual_multiplier`` before its residual add."""

    def __init__(self, cfg: Any, ctx: Any, backend: Any, dtype: torch.dtype,
                 device: torch.device, index: int) -> None:
        super().__init__()
        self.residual_scale = cfg.granite.residual
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mamba = Mamba2Mixer(cfg.hidden_size, cfg.mamba, cfg.rms_norm_eps, ctx, dtype,
                                 device, state_index=0)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype,
                                                device)
        self.mlp: LlamaMLP | SparseMoE
        if cfg.moe is not None:
            self.mlp = GraniteMoE(cfg.hidden_size, cfg.moe, ctx, dtype, device)
        else:
            self.mlp = LlamaMLP(cfg, ctx, dtype, device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, kv_cache: None, md: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        h = self.mamba(h, md.mamba) * self.residual_scale
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h) * self.residual_scale, residual


def _hybrid_layer(cfg: Any, ctx: Any, backend: Any, dtype: torch.dtype,
                  device: torch.device, index: int) -> nn.Module:
    """Layer ``index`` of its kind (``layer_types``)."""
    cls = GraniteMambaLayer if index in cfg.mamba.layers else GraniteDecoderLayer
    return cls(cfg, ctx, backend, dtype, device, index)


class GraniteHybridForCausalLM(RecurrentHybridMixin, GraniteForCausalLM):
    """Granite 4.0-H: ``GraniteForCausalLM`` with Mamba-2 layers among its attention
    layers (see the module docstring; what hybrids share, ``models.hybrid``)."""

    layer_cls = staticmethod(_hybrid_layer)  # type: ignore[assignment]

    # ---- loading ---------------------------------------------------------------------------

    def _layer_names(self, layer: nn.Module) -> set[str]:
        names = super()._layer_names(layer)  # (a Mamba layer's: ``models.hybrid``)
        if self.config.moe is None:  # dense: the shared MLP in the llama MLP's place
            names = {n for n in names if not n.startswith("mlp.")} | set(_SHARED)
        return names

    def _load_one(self, name: str, lazy: LazyTensor) -> None:
        found = self._layer_tensor(name)
        if found is None:
            return super()._load_one(name, lazy)
        layer, rest = found
        if rest in _SHARED and self.config.moe is None:
            if rest == _SHARED[0]:
                i = self.config.intermediate_size
                for part, rows in enumerate(split_rows(lazy, [i, i], name)):
                    layer.mlp.gate_up_proj.load(part, rows)
            else:
                layer.mlp.down_proj.load(lazy)
        else:
            super()._load_one(name, lazy)
