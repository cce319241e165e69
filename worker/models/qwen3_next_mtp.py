"""Qwen3-Next's and Qwen3.5's multi-token-prediction module as a draft head (vLLM's
``speculative_config={"method": "qwen3_next_mtp"}``, also ``"mtp"``).

The releases carry, beside the decoder, one more layer trained to predict a token
further (``mtp.*``): at position ``p`` it reads the token at ``p + 1`` and the
target's final hidden state of ``p`` (after its final norm),

    x = fc([pre_fc_norm_embedding(embed(t[p+1])), pre_fc_norm_hidden(h[p])])
    y = norm(x + attention(...) + moe(...))     (one gated-attention decoder layer)
    logits = lm_head(y)

with the decoder's embedding and LM head and every norm in Gemma's ``1 + w`` form. It
drafts as DeepSeek-V3's MTP layer does (``models.mtp``, run by
``eagle_runner.EagleRunner``): a catch-up over the step's kept positions shifted by
one, then ``k - 1`` steps that feed ``y`` back as the hidden state, the one layer
reused at every step; its attention keeps a KV pool of its own. Unlike DeepSeek's,
position 0's embedding is not zeroed and ``y`` is fed back after the final norm
(vLLM's Qwen3-Next MTP). The layer is gated attention with the routed experts (or a
dense MLP where the file has one), laid out as a decoder layer's tensors under
``mtp.layers.0.``.
"""

from __future__ import annotations

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
from pagedserve.worker.layers.norm import GemmaRMSNorm
from pagedserve.worker.layers.rotary import RotaryEmbedding
from pagedserve.worker.models.llama_loading import _copy_full
from pagedserve.worker.models.qwen3_next import GatedAttention, Qwen3NextLayer, _renamed
from pagedserve.worker.parallel import ParallelContext

QWEN3_NEXT_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text",
                    "qwen3_5_moe_text")
PREFIX = "mtp."
LAYER = PREFIX + "layers.0."
_OWN = ("fc.weight", "norm.weight", "pre_fc_norm_embedding.weight",
        "pre_fc_norm_hidden.weight")
_NORMS = ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm",
          "self_attn.k_norm")


def qwen3_next_mtp_problem(cfg: ModelConfig, names: set[str]) -> str | None:
    """Why a Qwen3-Next / Qwen3.5 target cannot draft with its MTP module (None: it
    can); ``names``: its checkpoint's tensor names."""
    missing = [PREFIX + n for n in _OWN if PREFIX + n not in names]
    if missing:
        return f"its checkpoint has no MTP module ({missing[0]} is missing)"
    return None


def _layer_config(cfg: ModelConfig, routed: bool) -> ModelConfig:
    """The config the MTP layer is built from: a decoder layer at index
    ``num_hidden_layers``, attention (never DeltaNet), routed where its file is."""
    moe = cfg.moe
    if moe is not None:
        sparse = tuple(i for i in moe.sparse_layers if i != cfg.num_layers)
        moe = replace(moe, sparse_layers=(*sparse, cfg.num_layers) if routed else sparse)
    return replace(cfg, moe=moe)


class Qwen3NextMTPHead(nn.Module):
    """The MTP module of a Qwen3-Next / Qwen3.5 checkpoint on one rank (module
    docstring). Quacks as ``EagleHead`` does for ``EagleRunner``."""

    eagle3 = False

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, dtype: torch.dtype,
                 device: torch.device, embed: VocabParallelEmbedding | None,
                 lm_head: ParallelLMHead | None, routed: bool) -> None:
        super().__init__()
        ctx, h, eps = ParallelContext(), cfg.hidden_size, cfg.rms_norm_eps
        self.config = cfg
        self.layer = Qwen3NextLayer(_layer_config(cfg, routed), ctx, backend, dtype, device,
                                    cfg.num_layers)
        self.pre_fc_norm_embedding = GemmaRMSNorm(h, eps, dtype, device)
        self.pre_fc_norm_hidden = GemmaRMSNorm(h, eps, dtype, device)
        self.fc = nn.Linear(2 * h, h, bias=False, dtype=dtype, device=device)
        self.fc.requires_grad_(False)
        self.norm = GemmaRMSNorm(h, eps, dtype, device)
        # The decoder's own embedding and head where this rank holds them whole; else
        # copies read from the file (the rank that samples holds the whole vocabulary).
        self.own_embed, self.own_head = embed is None, lm_head is None
        self.embed_tokens = embed or VocabParallelEmbedding(cfg.vocab_size, h, ctx, dtype,
                                                            device)
        self.lm_head = lm_head or ParallelLMHead(cfg.vocab_size, h, ctx, dtype, device)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, device,
                                      cfg.rotary_dim)

    def attach(self, target: nn.Module) -> None:
        """Read the shared embedding and head from ``target`` (a model built anew)."""
        if not self.own_embed:
            self.embed_tokens = target.embed_tokens
        if not self.own_head:
            self.lm_head = target.lm_head

    @property
    def attention_layers(self) -> list[PagedAttention]:
        attn = self.layer.self_attn
        assert isinstance(attn, GatedAttention)
        return [attn.attn]

    def combine(self, target_features: torch.Tensor) -> torch.Tensor:
        return target_features

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, features: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], md: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.pre_fc_norm_embedding(self.embed_tokens(ids))[0]
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(features.to(e.dtype))[0]], -1))
        cos, sin = self.rotary.cos_sin(positions, e.dtype)
        x, residual = self.layer(x, None, cos, sin, kv_caches[0], md)
        out = self.norm(x, residual)[0]
        return out, out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.logits(hidden)
        assert logits is not None  # (one rank)
        return logits

    # ---- loading -------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, LazyTensor]]) -> None:
        """Load the MTP module from the target's checkpoint tensors (the decoder's
        embedding and head too, where this head keeps copies); every other tensor is
        skipped. Anything of the module's missing or unknown fails, naming it."""
        embed = "model.embed_tokens.weight"
        head = embed if self.config.tie_word_embeddings else "lm_head.weight"
        copies = {n for n, own in ((embed, self.own_embed), (head, self.own_head)) if own}
        pending = {PREFIX + n for n in _OWN} | {LAYER + n for n in self._layer_names()}
        pending |= copies
        for name, lazy in weights:
            name = _renamed(name)
            if name in copies:
                if name == embed and self.own_embed:
                    self.embed_tokens.load(lazy)
                if name == head and self.own_head:
                    self.lm_head.load(lazy)
                pending.discard(name)
                continue
            if not name.startswith(PREFIX):
                continue
            if name not in pending:
                raise ValueError(f"unexpected weight {name!r} in the MTP module")
            pending.discard(name)
            self._load_one(name, lazy)
        if pending:
            raise ValueError(f"the checkpoint's MTP module is missing {sorted(pending)[:5]}")

    def _layer_names(self) -> set[str]:
        names = {f"{n}.weight" for n in _NORMS}
        names |= {f"self_attn.{p}_proj.weight" for p in "qkvo"}
        mlp = self.layer.mlp
        if isinstance(mlp, SparseMoE):
            return names | mlp.layer_names()
        return names | {f"mlp.{m}_proj.weight" for m in ("gate", "up", "down")}

    def _load_one(self, name: str, lazy: LazyTensor) -> None:
        own = name[len(PREFIX):]
        if own in _OWN:  # (fc and the three norms)
            _copy_full(name, getattr(self, own.removesuffix(".weight")).weight, lazy)
            return
        rest = name[len(LAYER):]
        layer, module = self.layer, rest.removesuffix(".weight")
        attn = layer.self_attn
        assert isinstance(attn, GatedAttention)
        if module in _NORMS:
            target = layer if not module.startswith("self_attn.") else attn
            _copy_full(name, getattr(target, module.split(".")[-1]).weight, lazy)
        elif module == "self_attn.q_proj":
            attn.load_q_and_gate(name, lazy)
        elif module in ("self_attn.k_proj", "self_attn.v_proj"):
            attn.qkv_proj.load(module.removeprefix("self_attn.")[0], lazy, False)
        elif module == "self_attn.o_proj":
            attn.o_proj.load(lazy, False)
        elif isinstance(layer.mlp, SparseMoE):
            claimed = layer.mlp.claims(rest)
            if claimed is None or not layer.mlp.load(claimed, lazy):
                raise ValueError(f"unexpected weight {name!r} in the MTP module")
        elif module == "mlp.down_proj":
            layer.mlp.down_proj.load(lazy)
        else:
            layer.mlp.gate_up_proj.load(0 if module == "mlp.gate_proj" else 1, lazy)


def routed_mtp(names: set[str]) -> bool:
    """Whether the file's MTP layer has routed experts (its router's weight)."""
    return LAYER + "mlp.gate.weight" in names
