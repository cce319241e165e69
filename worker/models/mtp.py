"""DeepSeek-V3's multi-token-prediction module as a draft head (vLLM's
``speculative_config={"method": "deepseek_mtp"}``; DeepSeek-V3 report, section 2.2).

A V3 checkpoint carries, after its ``num_hidden_layers`` decoder layers, a module
trained to predict one token further (``num_nextn_predict_layers``, 1 in the
releases): at position ``p`` it reads the token at ``p + 1`` and the target's final
hidden state of ``p`` (after the final norm, as vLLM feeds it),

    x = eh_proj([enorm(embed(t[p+1])), hnorm(h[p])])
    y = x + attention(...) + moe(...)            (one whole DeepSeek decoder layer)
    logits = shared_head.head(shared_head.norm(y))

so it drafts exactly as an EAGLE head does (``eagle_runner.EagleRunner`` runs it):
a catch-up over the step's kept positions shifted by one, then ``k - 1`` steps that
feed ``y`` back as the feature. As in vLLM, the embedding at position 0 is zeroed
and every step reuses the first MTP layer. Its layer has latent attention, so its
KV pool caches one latent a token, like the target's; the embedding is the
target's where this rank holds it whole, its head its own (``shared_head.head``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import replace

import torch
from torch import nn

from pagedserve.kernels import AttentionBackend
from pagedserve.worker.config import ModelConfig
from pagedserve.worker.layers.attention import AttentionMetadata, PagedAttention
from pagedserve.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.worker.layers.linear import LazyTensor
from pagedserve.worker.layers.moe import SparseMoE
from pagedserve.worker.layers.norm import RMSNorm
from pagedserve.worker.layers.rotary import RotaryEmbedding
from pagedserve.worker.models.deepseek import DeepseekDecoderLayer, MLAAttention
from pagedserve.worker.models.llama_loading import _copy_full
from pagedserve.worker.models.qwen3_next_mtp import QWEN3_NEXT_TYPES, qwen3_next_mtp_problem
from pagedserve.worker.parallel import ParallelContext

MTP_METHODS = ("deepseek_mtp", "mtp", "qwen3_next_mtp")
_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
        "shared_head.head.weight")


def mtp_prefix(cfg: ModelConfig) -> str:
    """Checkpoint prefix of the first MTP layer (the one that drafts)."""
    return f"model.layers.{cfg.num_layers}."


def mtp_problem(cfg: ModelConfig, names: set[str]) -> str | None:
    """Why a target cannot draft with its MTP module (None: it can); ``names``: its
    checkpoint's tensor names. Qwen3-Next / Qwen3.5 carry theirs as
    ``models.qwen3_next_mtp`` reads it."""
    if cfg.model_type in QWEN3_NEXT_TYPES:
        return qwen3_next_mtp_problem(cfg, names)
    if cfg.mla is None or cfg.model_type != "deepseek_v3":
        return f"model_type {cfg.model_type!r} has no multi-token-prediction module"
    if cfg.mla.mtp_layers < 1:
        return "its config says num_nextn_predict_layers 0"
    missing = [n for n in _OWN if mtp_prefix(cfg) + n not in names]
    if missing:
        return f"its checkpoint has no MTP layer ({mtp_prefix(cfg)}{missing[0]} is missing)"
    return None


def mtp_layer_config(cfg: ModelConfig) -> ModelConfig:
    """The MTP layer's config: one layer at index ``num_hidden_layers``, routed like the
    decoder's last layer (every release: routed)."""
    moe = cfg.moe
    if moe is not None and cfg.num_layers - 1 in moe.sparse_layers:
        moe = replace(moe, sparse_layers=(*moe.sparse_layers, cfg.num_layers))
    return replace(cfg, moe=moe)


class MTPHead(nn.Module):
    """The first MTP layer of a DeepSeek-V3 checkpoint on one rank (module docstring).

    Quacks as ``EagleHead`` does for ``EagleRunner``: ``forward`` returns ``(rows for
    logits, rows the next guess takes as its feature)``."""

    eagle3 = False

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, dtype: torch.dtype,
                 device: torch.device, embed: VocabParallelEmbedding | None) -> None:
        super().__init__()
        mla = cfg.mla
        assert mla is not None
        ctx, h, eps = ParallelContext(), cfg.hidden_size, cfg.rms_norm_eps
        self.config = cfg
        self.layer = DeepseekDecoderLayer(mtp_layer_config(cfg), ctx, backend, dtype, device,
                                          cfg.num_layers)
        self.enorm = RMSNorm(h, eps, dtype, device)
        self.hnorm = RMSNorm(h, eps, dtype, device)
        self.eh_proj = nn.Linear(2 * h, h, bias=False, dtype=dtype, device=device)
        self.eh_proj.requires_grad_(False)
        self.norm = RMSNorm(h, eps, dtype, device)  # shared_head.norm
        self.lm_head = ParallelLMHead(cfg.vocab_size, h, ctx, dtype, device)
        self.own_embed = embed is None
        self.embed_tokens = embed or VocabParallelEmbedding(cfg.vocab_size, h, ctx, dtype,
                                                            device)
        self.target_ids: torch.Tensor | None = None
        self.rotary = RotaryEmbedding(mla.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling,
                                      device)

    def attach(self, target: nn.Module) -> None:
        """Read the shared embedding from ``target`` (a model built anew)."""
        if not self.own_embed:
            self.embed_tokens = target.embed_tokens

    @property
    def attention_layers(self) -> list[PagedAttention]:
        return [self.layer.self_attn.attn]

    def combine(self, target_features: torch.Tensor) -> torch.Tensor:
        return target_features

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, features: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], md: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.embed_tokens(ids)
        e = e.masked_fill((positions == 0).unsqueeze(-1), 0.0)
        x = self.eh_proj(torch.cat([self.enorm(e)[0], self.hnorm(features.to(e.dtype))[0]],
                                   -1))
        cos, sin = self.rotary.cos_sin(positions, e.dtype)
        x, residual = self.layer(x, None, cos, sin, kv_caches[0], md)
        out = x + residual
        return out, out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.logits(self.norm(hidden)[0])
        assert logits is not None  # (one rank)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, LazyTensor]]) -> None:
        """Load the MTP layer from the target's checkpoint tensors (every other tensor
        is skipped but the decoder's embedding, where this head keeps its own); fail on
        anything of the layer's missing or unknown."""
        prefix = mtp_prefix(self.config)
        layer_re = re.compile("^" + re.escape(prefix) + "(.+)$")
        pending = {prefix + n for n in self._layer_names()} | {prefix + n for n in _OWN}
        if self.own_embed:
            pending.add("model.embed_tokens.weight")
        for name, lazy in weights:
            if name == "model.embed_tokens.weight" and self.own_embed:
                self.embed_tokens.load(lazy)  # (the MTP layer's own copy is the same)
                pending.discard(name)
                continue
            m = layer_re.match(name)
            if m is None or m.group(1) == "embed_tokens.weight":
                continue
            rest = m.group(1)
            if name not in pending:
                raise ValueError(f"unexpected weight {name!r} in the MTP layer")
            pending.discard(name)
            self._load_one(rest, name, lazy)
        if pending:
            raise ValueError(f"the checkpoint's MTP layer is missing {sorted(pending)[:5]}")

    def _layer_names(self) -> set[str]:
        layer = self.layer
        names = {"input_layernorm.weight", "post_attention_layernorm.weight",
                 *(f"self_attn.{n}" for n in layer.self_attn.tensor_names())}
        if isinstance(layer.mlp, SparseMoE):
            return names | {f"mlp.{n}" for n in layer.mlp.expected_names()}
        return names | {f"mlp.{m}_proj.weight" for m in ("gate", "up", "down")}

    def _load_one(self, rest: str, name: str, lazy: LazyTensor) -> None:
        layer = self.layer
        module = rest.removesuffix(".weight")
        if rest in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight",
                    "input_layernorm.weight", "post_attention_layernorm.weight"):
            norm = {"shared_head.norm": self.norm, "enorm": self.enorm, "hnorm": self.hnorm,
                    "input_layernorm": layer.input_layernorm,
                    "post_attention_layernorm": layer.post_attention_layernorm}[module]
            _copy_full(name, norm.weight, lazy)
        elif rest == "eh_proj.weight":
            _copy_full(name, self.eh_proj.weight, lazy)
        elif rest == "shared_head.head.weight":
            self.lm_head.load(lazy)
        elif rest.startswith("self_attn."):
            attn = layer.self_attn
            assert isinstance(attn, MLAAttention)
            attn.load(module[len("self_attn."):], name, lazy)
        elif isinstance(layer.mlp, SparseMoE):
            layer.mlp.load(rest[len("mlp."):], lazy)
        else:
            which = module.split(".")[-1]
            if which == "down_proj":
                layer.mlp.down_proj.load(lazy)
            else:
                layer.mlp.gate_up_proj.load(0 if which == "gate_proj" else 1, lazy)

