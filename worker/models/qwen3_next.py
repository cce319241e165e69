"""Qwen3-Next (``qwen3_next``: Qwen3-Next-80B-A3B Instruct / Thinking) and Qwen3.5
(``qwen3_5``: 0.8B to 27B dense; ``qwen3_5_moe``: 35B-A3B to 397B-A17B): gated
DeltaNet layers (``layers.gated_deltanet``) with a gated attention layer after every
three, each followed by Qwen2-MoE's routed experts beside a sigmoid-gated shared
expert (or a dense MLP: Qwen3.5's dense models, Qwen3-Next's ``mlp_only_layers``).
Qwen3.5 stores the DeltaNet projections unfused and its files hold a vision
encoder (``model.visual.``) beside the decoder (``model.language_model.``): the
decoder is served, text in and out.

Its attention is Qwen3's (per-head q/k norms, GQA) with three changes: RoPE turns
only the first quarter of each head (``partial_rotary_factor``), ``q_proj`` yields a
gate beside each query head, and the heads' outputs are multiplied by
``sigmoid(gate)`` before ``o_proj``. Every RMSNorm of the decoder scales by ``1 +
weight`` (Gemma's form; the file stores the offset), the DeltaNet's own gated norm
excepted. KV is paged for the attention layers only and the DeltaNet layers keep a
state slot per sequence: what hybrids share (``models.hybrid``). The file's
multi-token-prediction module (``mtp.*``) is not part of the decoder: it is read
only to draft (``models.qwen3_next_mtp``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.worker.layers.attention import AttentionMetadata
from pagedserve.worker.layers.gated_deltanet import GatedDeltaNet
from pagedserve.worker.layers.linear import ColumnParallelLinear, LazyTensor
from pagedserve.worker.layers.moe import SparseMoE
from pagedserve.worker.layers.norm import GemmaRMSNorm
from pagedserve.worker.models.hybrid import RecurrentHybridMixin
from pagedserve.worker.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP

# The file's parts outside the decoder: the MTP module, Qwen3.5's vision encoder.
_NOT_READ = ("mtp.", "model.visual.")


def _renamed(name: str) -> str:
    """A checkpoint name as ``LlamaWeightLoading`` reads it (Qwen3.5's multimodal files
    hold the decoder under ``model.language_model.``)."""
    if name.startswith("model.language_model."):
        return "model." + name[21:]
    return name


class GatedAttention(LlamaAttention):
    """Qwen3-Next's attention: ``o_proj(attention * sigmoid(gate))``, the gate a second
    projection of the input per query head (the file's ``q_proj`` holds both, head by
    head: ``[query, gate]``)."""

    def __init__(self, cfg: Any, ctx: Any, backend: Any, dtype: torch.dtype,
                 device: torch.device, index: int) -> None:
        super().__init__(cfg, ctx, backend, dtype, device, index)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
        self.gate_proj = ColumnParallelLinear(cfg.hidden_size, cfg.num_heads * cfg.head_dim,
                                              False, ctx, dtype, device)
        self.total_heads = cfg.num_heads

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], md: AttentionMetadata
                ) -> torch.Tensor:
        out = self.attend(x, cos, sin, kv_cache, md)
        return self.o_proj(out * torch.sigmoid(self.gate_proj(x)))

    def load_q_and_gate(self, name: str, lazy: LazyTensor) -> None:
        """The file's ``q_proj.weight`` ``[heads * 2 * head_dim, hidden]``: each head's
        query rows then its gate rows."""
        heads, d = self.total_heads, self.head_dim
        full = lazy[:]
        if full.dim() != 2 or full.shape[0] != heads * 2 * d:
            raise ValueError(f"{name}: checkpoint shape {tuple(full.shape)} does not hold "
                             f"{heads} heads of query and gate rows ({heads * 2 * d})")
        per_head = full.view(heads, 2, d, -1)
        self.qkv_proj.load("q", per_head[:, 0].reshape(heads * d, -1), False)
        self.gate_proj.load(per_head[:, 1].reshape(heads * d, -1))


class Qwen3NextLayer(nn.Module):
    """One decoder layer: (1 + w) norm, gated DeltaNet or gated attention, (1 + w)
    norm, experts or MLP."""

    def __init__(self, cfg: Any, ctx: Any, backend: Any, dtype: torch.dtype,
                 device: torch.device, index: int) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps, dtype, device)
        self.linear_attn: GatedDeltaNet | None = None
        self.self_attn: GatedAttention | None = None
        if index in cfg.mamba.layers:
            self.linear_attn = GatedDeltaNet(cfg.hidden_size, cfg.mamba, eps, ctx, dtype,
                                             device)
        else:
            self.self_attn = GatedAttention(cfg, ctx, backend, dtype, device, index)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps, dtype, device)
        self.mlp: LlamaMLP | SparseMoE
        if cfg.moe is not None and index in cfg.moe.sparse_layers:
            self.mlp = SparseMoE(cfg.hidden_size, cfg.moe, ctx, dtype, device)
        else:
            self.mlp = LlamaMLP(cfg, ctx, dtype, device)

    @property
    def mamba(self) -> GatedDeltaNet | None:
        """Its recurrent mixer, as ``models.hybrid`` finds one."""
        return self.linear_attn

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor] | None,
                md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        if self.linear_attn is not None:
            h = self.linear_attn(h, md.mamba)
        else:
            h = self.self_attn(h, cos, sin, kv_cache, md)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class Qwen3NextForCausalLM(RecurrentHybridMixin, LlamaForCausalLM):
    """Qwen3-Next (see the module docstring)."""

    layer_cls = Qwen3NextLayer
    norm_cls = GemmaRMSNorm
    checkpoint_name = staticmethod(_renamed)
    mixer_prefix = "linear_attn."

    def _on_this_stage(self, name: str) -> bool:
        return not name.startswith(_NOT_READ) and super()._on_this_stage(name)

    def split_lora(self, weights: dict[tuple[int, str], Any]) -> dict[tuple[int, str], Any]:
        """An adapter's ``q_proj`` deltas on the gated attention layers, whose B rows go
        head by head ``[query, gate]`` as the file's weight does: the query rows stay on
        ``q_proj``, the gate rows go to ``attn_gate_proj`` (the layer's ``gate_proj``)."""
        out = dict(weights)
        for (layer, name), (a, b, scale) in weights.items():
            attn = getattr(self.layers[layer], "self_attn", None)
            heads, d = self.config.num_heads, self.config.head_dim
            if name != "q_proj" or attn is None or b.shape[0] != heads * 2 * d:
                continue
            per_head = b.reshape(heads, 2, d, -1)
            out[(layer, name)] = (a, per_head[:, 0].reshape(heads * d, -1), scale)
            out[(layer, "attn_gate_proj")] = (a, per_head[:, 1].reshape(heads * d, -1), scale)
        return out

    def _load_one(self, name: str, lazy: LazyTensor) -> None:
        found = self._layer_tensor(name)
        if found is not None and found[1] == "self_attn.q_proj.weight" \
                and found[0].self_attn is not None:
            found[0].self_attn.load_q_and_gate(name, lazy)
        else:
            super()._load_one(name, lazy)
