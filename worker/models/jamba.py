"""AI21's Jamba (``jamba``; ``worker.mamba1_config``): Mamba-1 layers
(``layers.mamba1``) with one attention layer in every ``attn_layer_period``, each
followed by a SwiGLU MLP or, in one layer of every ``expert_layer_period``, routed
experts (softmax top-k, the weights left as they are). Its attention has no RoPE.

The files name the MLP ``feed_forward`` (its router ``feed_forward.router``), its norm
``pre_ff_layernorm`` and the last norm ``final_layernorm``, as Bamba's do; they load
under Llama's. What hybrids share (KV for the attention layers only, a state slot per
sequence for the Mamba ones, the layer around a mixer) is ``models.hybrid``'s.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.worker.layers.mamba1 import Mamba1Mixer
from pagedserve.worker.layers.moe import SparseMoE
from pagedserve.worker.models.bamba import _renamed as _bamba_renamed
from pagedserve.worker.models.hybrid import RecurrentHybridMixin, RecurrentLayer
from pagedserve.worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP


def _renamed(name: str) -> str:
    """A checkpoint name as ``LlamaWeightLoading`` reads it."""
    return _bamba_renamed(name).replace(".mlp.router.", ".mlp.gate.")


def _layer(cfg: Any, ctx: Any, backend: Any, dtype: torch.dtype, device: torch.device,
           index: int) -> nn.Module:
    """Layer ``index`` of its kind (attention by ``attn_layer_period``, experts by
    ``expert_layer_period``)."""
    if index not in cfg.mamba.layers:
        return LlamaDecoderLayer(cfg, ctx, backend, dtype, device, index)
    mlp: LlamaMLP | SparseMoE
    if cfg.moe is not None and index in cfg.moe.sparse_layers:
        mlp = SparseMoE(cfg.hidden_size, cfg.moe, ctx, dtype, device)
    else:
        mlp = LlamaMLP(cfg, ctx, dtype, device)
    mixer = Mamba1Mixer(cfg.hidden_size, cfg.mamba, ctx, dtype, device, state_index=0)
    return RecurrentLayer(cfg, mixer, mlp, dtype, device)


class JambaForCausalLM(RecurrentHybridMixin, LlamaForCausalLM):
    """Jamba (see the module docstring)."""

    layer_cls = staticmethod(_layer)  # type: ignore[assignment]
    checkpoint_name = staticmethod(_renamed)
