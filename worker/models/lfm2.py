"""Liquid AI's LFM2 (``lfm2``): gated short-convolution layers (``layers.short_conv``)
with a few attention layers between them (``lfm2_config``), each layer a pre-norm
mixer and a pre-norm SwiGLU MLP; LFM2-MoE (``lfm2_moe``) routes the MLPs after its
first ``num_dense_layers`` to experts (sigmoid scores, a choosing bias).

Its attention is Qwen3's (per-head q / k RMSNorms, GQA, RoPE), its layers Llama's
shape, so the files' names (``operator_norm``, ``ffn_norm``, ``feed_forward.w1 / w3 /
w2``, ``self_attn.out_proj``, ``q_layernorm``, the final ``embedding_norm``) load
under Llama's; a conv layer holds a ``ShortConv`` where the attention would be. What
hybrids share (KV for the attention layers only, a state slot per sequence for the
others) is ``models.hybrid``'s.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from pagedserve.worker.layers.attention import AttentionMetadata
from pagedserve.worker.layers.linear import LazyTensor
from pagedserve.worker.layers.moe import SparseMoE
from pagedserve.worker.layers.norm import RMSNorm
from pagedserve.worker.layers.short_conv import ShortConv
from pagedserve.worker.models.hybrid import RecurrentHybridMixin
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


class Lfm2ConvLayer(nn.Module):
    """A conv layer: norm, ``ShortConv``, norm, MLP (the attention layers are Llama's)."""

    def __init__(self, cfg: Any, ctx: Any, backend: Any, dtype: torch.dtype,
                 device: torch.device, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.conv = ShortConv(cfg.mamba, ctx, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype,
                                                device)
        self.mlp: LlamaMLP | SparseMoE
        if cfg.moe is not None and index in cfg.moe.sparse_layers:  # (LFM2-MoE)
            self.mlp = SparseMoE(cfg.hidden_size, cfg.moe, ctx, dtype, device)
        else:
            self.mlp = LlamaMLP(cfg, ctx, dtype, device)

    @property
    def mamba(self) -> ShortConv:
        """Its recurrent mixer, as ``models.hybrid`` finds one."""
        return self.conv

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, kv_cache: None, md: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.conv(h, md.mamba), residual)
        return self.mlp(h), residual


def _layer(cfg: Any, ctx: Any, backend: Any, dtype: torch.dtype, device: torch.device,
           index: int) -> nn.Module:
    """Layer ``index`` of its kind (``layer_types``)."""
    cls = Lfm2ConvLayer if index in cfg.mamba.layers else LlamaDecoderLayer
    return cls(cfg, ctx, backend, dtype, device, index)


class Lfm2ForCausalLM(RecurrentHybridMixin, LlamaForCausalLM):
    """LFM2 (see the module docstring)."""

    layer_cls = staticmethod(_layer)  # type: ignore[assignment]
    checkpoint_name = staticmethod(_renamed)

    def _layer_names(self, layer: nn.Module) -> set[str]:
        names = super()._layer_names(layer)
        if isinstance(layer, Lfm2ConvLayer):
            names = {n for n in names if not n.startswith("self_attn.")}
            names |= {"conv." + n for n in layer.conv.checkpoint_names()}
        return names

    def _load_one(self, name: str, lazy: LazyTensor) -> None:
        found = self._layer_tensor(name)
        if found is not None and found[1].startswith("conv."):
            layer, rest = found
            if not isinstance(layer, Lfm2ConvLayer) or not layer.conv.load(rest[5:], lazy):
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            return
        super()._load_one(name, lazy)
