"""Liquid AI's LFM2 (``lfm2``): gated short-convolution layers (``layers.short_conv``)
with a few attention layers between them (``lfm2_config``), each layer a pre-norm
mixer and a pre-norm SwiGLU MLP; LFM2-MoE (``lfm2_moe``) routes the MLPs after its
first ``num_dense_layers`` to experts (sigmoid scores, a choosing bias).

Its attention is Qwen3's (per-head q / k RMSNorms, GQA, RoPE), its layers Llama's
shape, so the files' names (``operator_norm``, ``ffn_norm``, ``feed_forward.w1 / w3 /
w2``, ``self_attn.out_proj``, ``q_layernorm``, the final ``embedding_norm``) load
under Llama's; a conv layer (``RecurrentLayer``) holds a ``ShortConv`` where the
attention would be. What
hybrids share (KV for the attention layers only, a state slot per sequence for the
others) is ``models.hybrid``'s.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from pagedserve.worker.layers.moe import SparseMoE
from pagedserve.worker.layers.short_conv import ShortConv
from pagedserve.worker.models.hybrid import RecurrentHybridMixin, RecurrentLayer
from pagedserve.worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP

_LAYER = re.compile(r"^(model\.layers\.\d+\.)(.+)$")
_IN_LAYER = {"operator_norm.": "input_layernorm.", "ffn_norm.": "post_attention_layernorm.",
             "feed_forward.expert_bias": "mlp.gate.e_score_correction_bias",
             "feed_forward.": "mlp.", "self_attn.out_proj.": "self_attn.o_proj.",
             "self_attn.q_layernorm.": "self_attn.q_norm.",
             "self_attn.k_layernorm.": "self_attn.k_norm."}
# An MLP's (or an expert's) projections: w1 gates, w3 goes up, w2 comes down.
_PROJ = re.compile(r"(^mlp\.(?:experts\.\d+\.)?)w([123])\.")
_PROJ_NAMES = {"1": "gate_proj.", "3": "up_proj.", "2": "down_proj."}


def _renamed(name: str) -> str:
    """A checkpoint name as ``LlamaWeightLoading`` reads it."""
    if name == "model.embedding_norm.weight":
        return "model.norm.weight"
    m = _LAYER.match(name)
    if m is None:
        return name
    prefix, rest = m.groups()
    for theirs, ours in _IN_LAYER.items():
        if rest.startswith(theirs):
            rest = ours + rest[len(theirs):]
            break
    return prefix + _PROJ.sub(lambda p: p.group(1) + _PROJ_NAMES[p.group(2)], rest)


def _layer(cfg: Any, ctx: Any, backend: Any, dtype: torch.dtype, device: torch.device,
           index: int) -> nn.Module:
    """Layer ``index`` of its kind (``layer_types``)."""
    if index not in cfg.mamba.layers:
        return LlamaDecoderLayer(cfg, ctx, backend, dtype, device, index)
    mlp: LlamaMLP | SparseMoE
    if cfg.moe is not None and index in cfg.moe.sparse_layers:  # (LFM2-MoE)
        mlp = SparseMoE(cfg.hidden_size, cfg.moe, ctx, dtype, device)
    else:
        mlp = LlamaMLP(cfg, ctx, dtype, device)
    return RecurrentLayer(cfg, ShortConv(cfg.mamba, ctx, dtype, device), mlp, dtype, device)


class Lfm2ForCausalLM(RecurrentHybridMixin, LlamaForCausalLM):
    """LFM2 (see the module docstring)."""

    layer_cls = staticmethod(_layer)  # type: ignore[assignment]
    checkpoint_name = staticmethod(_renamed)
    mixer_prefix = "conv."
