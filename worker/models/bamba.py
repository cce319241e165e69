"""IBM's Bamba (``bamba``: Bamba-9B v1 / v2): Mamba-2 layers with attention layers at
``attn_layer_indices``, each followed by a SwiGLU MLP: Granite 4.0-H's Mamba-2 mixer
(``layers.mamba2``) in a Llama-shaped layer, without Granite's scalars and with RoPE
on half of each attention head (transformers fixes ``partial_rotary_factor`` at 0.5
for these files). The files name the MLP ``feed_forward``, its norm
``pre_ff_layernorm`` and the last norm ``final_layernorm``; they load under Llama's. What hybrids share (KV for the
attention layers only, a state slot per sequence for the Mamba ones) is
``models.hybrid``'s.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from pagedserve.worker.layers.attention import AttentionMetadata
from pagedserve.worker.layers.linear import LazyTensor
from pagedserve.worker.layers.mamba2 import Mamba2Mixer
from pagedserve.worker.layers.norm import RMSNorm
from pagedserve.worker.models.hybrid import RecurrentHybridMixin
from pagedserve.worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP

_RENAMED = re.compile(r"^(model\.layers\.\d+\.)(pre_ff_layernorm|feed_forward)\.")
_OURS = {"pre_ff_layernorm": "post_attention_layernorm", "feed_forward": "mlp"}


def _renamed(name: str) -> str:
    """A checkpoint name as ``LlamaWeightLoading`` reads it."""
    if name == "model.final_layernorm.weight":
        return "model.norm.weight"
    return _RENAMED.sub(lambda m: f"{m.group(1)}{_OURS[m.group(2)]}.", name)


class BambaMambaLayer(nn.Module):
    """A Mamba layer: norm, Mamba-2 mixer, norm, MLP."""

    def __init__(self, cfg: Any, ctx: Any, backend: Any, dtype: torch.dtype,
                 device: torch.device, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mamba = Mamba2Mixer(cfg.hidden_size, cfg.mamba, cfg.rms_norm_eps, ctx, dtype,
                                 device, state_index=0)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype,
                                                device)
        self.mlp = LlamaMLP(cfg, ctx, dtype, device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, kv_cache: None, md: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.mamba(h, md.mamba), residual)
        return self.mlp(h), residual


def _layer(cfg: Any, ctx: Any, backend: Any, dtype: torch.dtype, device: torch.device,
           index: int) -> nn.Module:
    """Layer ``index`` of its kind (``attn_layer_indices``)."""
    cls = BambaMambaLayer if index in cfg.mamba.layers else LlamaDecoderLayer
    return cls(cfg, ctx, backend, dtype, device, index)


class BambaForCausalLM(RecurrentHybridMixin, LlamaForCausalLM):
    """Bamba (see the module docstring)."""

    layer_cls = staticmethod(_layer)  # type: ignore[assignment]
    checkpoint_name = staticmethod(_renamed)

    def _layer_names(self, layer: nn.Module) -> set[str]:
        names = super()._layer_names(layer)
        if isinstance(layer, BambaMambaLayer):
            names = {n for n in names if not n.startswith("self_attn.")}
            names |= {"mamba." + n for n in layer.mamba.checkpoint_names()}
        return names

    def _load_one(self, name: str, lazy: LazyTensor) -> None:
        found = self._layer_tensor(name)
        if found is not None and found[1].startswith("mamba."):
            layer, rest = found
            if not isinstance(layer, BambaMambaLayer) or not layer.mamba.load(rest[6:], lazy):
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            return
        super()._load_one(name, lazy)
