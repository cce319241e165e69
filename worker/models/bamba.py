"""IBM's Bamba (``bamba``: Bamba-9B v1 / v2): Mamba-2 layers with attention layers at
``attn_layer_indices``, each followed by a SwiGLU MLP: Granite 4.0-H's Mamba-2 mixer
(``layers.mamba2``) in a Llama-shaped layer, without Granite's scalars and with RoPE
on half of each attention head (transformers fixes ``partial_rotary_factor`` at 0.5
for these files). The files name the MLP ``feed_forward``, its norm
``pre_ff_layernorm`` and the last norm ``final_layernorm``; they load under
Llama's. What hybrids share (KV for the attention layers only, a state slot per
sequence for the Mamba ones, the layer around a mixer) is ``models.hybrid``'s.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from pagedserve.worker.layers.mamba2 import Mamba2Mixer
from pagedserve.worker.models.hybrid import RecurrentHybridMixin, RecurrentLayer
from pagedserve.worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP

_RENAMED = re.compile(r"^(model\.layers\.\d+\.)(pre_ff_layernorm|feed_forward)\.")
_OURS = {"pre_ff_layernorm": "post_attention_layernorm", "feed_forward": "mlp"}


def _renamed(name: str) -> str:
    """A checkpoint name as ``LlamaWeightLoading`` reads it."""
    if name == "model.final_layernorm.weight":
        return "model.norm.weight"
    return _RENAMED.sub(lambda m: f"{m.group(1)}{_OURS[m.group(2)]}.", name)


def _layer(cfg: Any, ctx: Any, backend: Any, dtype: torch.dtype, device: torch.device,
           index: int) -> nn.Module:
    """Layer ``index`` of its kind (``attn_layer_indices``)."""
    if index not in cfg.mamba.layers:
        return LlamaDecoderLayer(cfg, ctx, backend, dtype, device, index)
    mixer = Mamba2Mixer(cfg.hidden_size, cfg.mamba, cfg.rms_norm_eps, ctx, dtype, device,
                        state_index=0)
    return RecurrentLayer(cfg, mixer, LlamaMLP(cfg, ctx, dtype, device), dtype, device)


class BambaForCausalLM(RecurrentHybridMixin, LlamaForCausalLM):
    """Bamba (see the module docstring)."""

    layer_cls = staticmethod(_layer)  # type: ignore[assignment]
    checkpoint_name = staticmethod(_renamed)
