"""EAGLE and EAGLE-3 draft heads (vLLM's ``speculative_config`` methods "eagle" and
"eagle3"; Li et al., *EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty*, and *EAGLE-3: Scaling up Inference Acceleration of Large Language
Models via Training-Time Test*).

A head is one decoder layer that drafts from the target's own hidden states, so it
guesses far better than a small model of the same cost. Its input at position ``p``
is the token at ``p + 1`` with a feature of position ``p``; its output stands for the
feature of ``p + 1``, from which the next token is read. The feature is:

- EAGLE: the target's last hidden state (after its final norm), joined to the token's
  embedding by ``fc`` (``2H -> H``, with the bias the original checkpoints carry);
  the layer skips its input norm, and the target's LM head reads its output as is;
- EAGLE-3: three of the target's layers' inputs (layers 2, L/2 and L-3, or the
  checkpoint's ``eagle_aux_hidden_state_layer_ids``) joined by ``fc``
  (``3H -> H``); the layer's attention reads ``[norm(embedding), norm(feature)]``
  (``2H`` wide), a final norm precedes the head's own LM head over a smaller draft
  vocabulary, whose ids map to the target's through ``d2t``.

Guesses after the first take the head's own output as their feature (EAGLE-3: before
its final norm). The head shares the target's embedding (and EAGLE's its LM head)
where the target holds them whole on the drafting rank; under tensor or pipeline
parallelism it loads its own copies from the target's checkpoint, since the drafting
rank runs alone. Checkpoints as the EAGLE authors publish them: bare names
(``layers.0.*``, ``midlayer.*`` for EAGLE-3, ``fc``, ``d2t``; ``t2d`` is not needed)
or under ``model.``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from pagedserve.kernels import AttentionBackend
from pagedserve.worker.config import ModelConfig
from pagedserve.worker.layers.attention import AttentionMetadata
from pagedserve.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.worker.layers.linear import LazyTensor, QKVParallelLinear
from pagedserve.worker.layers.norm import RMSNorm
from pagedserve.worker.layers.rotary import RotaryEmbedding
from pagedserve.worker.models.llama import LlamaDecoderLayer
from pagedserve.worker.parallel import ParallelContext

EAGLE_METHODS = ("eagle", "eagle3")
_LAYER = "layers.0."
_QKV = ("q_proj", "k_proj", "v_proj")


@dataclass(frozen=True)
class EagleSpec:
    """What a head checkpoint is, checked against its target.

    ``config`` sizes the head's decoder layer; ``draft_vocab`` is its LM head's rows
    (EAGLE-3; EAGLE reads the target's); ``aux_layers`` the target layers whose inputs
    EAGLE-3's ``fc`` joins (empty for EAGLE)."""

    method: str
    config: ModelConfig
    draft_vocab: int
    aux_layers: tuple[int, ...]
    norm_before_residual: bool


def read_eagle_spec(path: str, method: str, target: ModelConfig) -> EagleSpec:
    """Read ``path``'s config.json as a head for ``target``; every reason it cannot
    draft is a ``ValueError`` naming ``speculative_config.model``."""
    field = f"speculative_config.model {path!r}"
    if method not in EAGLE_METHODS:
        raise ValueError(f"speculative_config.method {method!r} is not one of {EAGLE_METHODS}")
    try:
        raw = json.loads((Path(path) / "config.json").read_text())
        mc = ModelConfig.from_hf_dict(dict(raw, num_hidden_layers=1))
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{field}: {e}") from e
    if raw.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"{field}: an {method} head has one decoder layer, its config "
                         f"says {raw['num_hidden_layers']}")
    if mc.vocab_size != target.vocab_size:
        raise ValueError(f"{field}: vocab_size {mc.vocab_size} is not the target's "
                         f"({target.vocab_size}): a head shares the target's tokenizer")
    feature = raw.get("target_hidden_size", mc.hidden_size) if method == "eagle3" \
        else mc.hidden_size
    if feature != target.hidden_size or mc.hidden_size != target.hidden_size:
        raise ValueError(f"{field}: hidden_size {mc.hidden_size} does not match the "
                         f"target's {target.hidden_size}")
    aux: tuple[int, ...] = ()
    draft_vocab = mc.vocab_size
    if method == "eagle3":
        n = target.num_layers
        ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        aux = tuple(ids) if ids else (2, n // 2, n - 3)
        if len(aux) != 3 or any(not isinstance(i, int) or not 0 <= i < n for i in aux):
            raise ValueError(f"{field}: EAGLE-3 reads three of the target's {n} layers, "
                             f"got layers {list(aux)}")
        draft_vocab = int(raw.get("draft_vocab_size") or mc.vocab_size)
        if not 0 < draft_vocab <= mc.vocab_size:
            raise ValueError(f"{field}: draft_vocab_size {draft_vocab} must be in "
                             f"[1, {mc.vocab_size}]")
    # (the head runs at the target's positions, however short its own config's length)
    mc = replace(mc, max_position_embeddings=max(mc.max_position_embeddings,
                                                 target.max_model_len))
    return EagleSpec(method, mc, draft_vocab, aux, bool(raw.get("norm_before_residual")))


class EagleHead(nn.Module):
    """One EAGLE or EAGLE-3 head on one rank (see the module docstring).

    ``forward`` returns ``(rows for logits, rows the next guess takes as its feature)``;
    ``combine`` turns the target's features into the head's input width."""

    def __init__(self, spec: EagleSpec, backend: AttentionBackend, dtype: torch.dtype,
                 device: torch.device, embed: VocabParallelEmbedding | None,
                 head: ParallelLMHead | None, fc_bias: bool,
                 embed_in_checkpoint: bool = False) -> None:
        super().__init__()
        self.spec, self.config = spec, spec.config
        cfg, ctx = spec.config, ParallelContext()
        h = cfg.hidden_size
        self.eagle3 = spec.method == "eagle3"
        self.layer = LlamaDecoderLayer(cfg, ctx, backend, dtype, device, 0)
        if self.eagle3:
            self.layer.self_attn.qkv_proj = QKVParallelLinear(
                2 * h, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.qkv_bias, ctx,
                dtype, device)
            self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps, dtype, device)
            self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype, device)
        width = 3 * h if self.eagle3 else 2 * h
        self.fc = nn.Linear(width, h, bias=fc_bias, dtype=dtype, device=device)
        self.fc.requires_grad_(False)
        self._embed_in_checkpoint = self.eagle3 and embed_in_checkpoint
        if self._embed_in_checkpoint:
            embed = None  # (EAGLE-3 may train its own)
        self.embed_tokens = embed or VocabParallelEmbedding(cfg.vocab_size, h, ctx, dtype,
                                                            device)
        rows = spec.draft_vocab if self.eagle3 else cfg.vocab_size
        if self.eagle3:
            head = None  # (its own, over the draft vocabulary)
        self.lm_head = head or ParallelLMHead(rows, h, ctx, dtype, device)
        self.own_embed, self.own_head = embed is None, head is None
        self.d2t = torch.zeros(rows, dtype=torch.long, device=device)
        # EAGLE-3's draft ids as the target's (None: the same ids), set by ``load_weights``
        self.target_ids: torch.Tensor | None = None
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, device,
                                      cfg.rotary_dim)

    def attach(self, target: nn.Module) -> None:
        """Read the embedding and LM head the head shares from ``target`` (a model built
        anew: woken from sleep, new weights), and have it keep EAGLE-3's layer inputs."""
        if not self.own_embed:
            self.embed_tokens = target.embed_tokens
        if not self.own_head:
            self.lm_head = target.lm_head
        target.aux_layers = self.spec.aux_layers

    @property
    def attention_layers(self) -> list[nn.Module]:
        return [self.layer.self_attn.attn]

    def combine(self, target_features: torch.Tensor) -> torch.Tensor:
        """The target's features (EAGLE-3: three layers' side by side) as the head
        takes them; EAGLE joins them with the embedding inside ``forward``."""
        return self.fc(target_features) if self.eagle3 else target_features

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, features: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], md: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.embed_tokens(ids)
        cos, sin = self.rotary.cos_sin(positions, e.dtype)
        layer = self.layer
        if self.eagle3:
            e = layer.input_layernorm(e)[0]
            if self.spec.norm_before_residual:
                f = residual = self.hidden_norm(features)[0]
            else:
                residual, f = features, self.hidden_norm(features)[0]
            x = torch.cat([e, f], -1)
        else:
            x = residual = self.fc(torch.cat([e, features.to(e.dtype)], -1))
        x = layer.self_attn(x, cos, sin, kv_caches[0], md)
        x, residual = layer.post_attention_layernorm(x, residual)
        x = layer.mlp(x)
        if self.eagle3:
            return self.norm(x, residual)
        out = x + residual
        return out, out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the target's whole vocabulary (EAGLE-3: ids outside the draft
        vocabulary at -inf, so no guess is ever one of them)."""
        logits = self.lm_head.logits(hidden)
        assert logits is not None  # (one rank)
        if self.target_ids is None:
            return logits
        full = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))
        full[:, self.target_ids] = logits
        return full

    def load_weights(self, weights: Iterable[tuple[str, LazyTensor]]) -> None:
        """Load a head checkpoint (bare or ``model.``-prefixed names); fail on anything
        missing or unknown."""
        expected = self._expected_names()
        pending = set(expected)
        for name, lazy in weights:
            name = name.removeprefix("model.").replace("midlayer.", _LAYER)
            name = name.replace(_LAYER + "hidden_norm.", "hidden_norm.")
            if name in ("t2d", _LAYER + "input_layernorm.weight") and name not in expected:
                continue  # (t2d: d2t says the same; EAGLE's layer skips its input norm)
            if name in ("embed_tokens.weight", "lm_head.weight") and name not in expected:
                continue  # (a copy of the target's, which the head reads instead)
            if name == "d2t" and self.eagle3:
                expected.add(name)  # (optional over the whole vocabulary)
            if name not in expected:
                raise ValueError(f"unexpected weight {name!r} in the {self.spec.method} "
                                 "checkpoint")
            pending.discard(name)
            if name.startswith(_LAYER):
                self._load_layer(name[len(_LAYER):], lazy)
            elif name == "d2t":
                _copy(name, self.d2t, lazy)
            elif name in ("embed_tokens.weight", "lm_head.weight"):
                getattr(self, name.split(".")[0]).load(lazy)
            else:
                module, _, attr = name.rpartition(".")
                _copy(name, getattr(getattr(self, module), attr) if module else
                      getattr(self, attr), lazy)
        if pending:
            raise ValueError(f"{self.spec.method} checkpoint is missing weights: "
                             f"{sorted(pending)[:5]}")
        if self.eagle3:
            ids = torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t
            if ids.min() < 0 or ids.max() >= self.config.vocab_size:
                raise ValueError(f"d2t maps draft ids outside the target's vocabulary "
                                 f"of {self.config.vocab_size}")
            if len(ids) != self.config.vocab_size or bool(self.d2t.any()):
                self.target_ids = ids

    @property
    def needs_target_tensors(self) -> bool:
        """Whether the embedding or LM head must come from the target's checkpoint (the
        target holds no whole copy here and the head's checkpoint has none)."""
        return (self.own_embed and not self._embed_in_checkpoint) or \
            (self.own_head and not self.eagle3)

    def load_target_tensors(self, weights: Iterable[tuple[str, LazyTensor]],
                            tied: bool) -> None:
        """The embedding (and EAGLE's LM head) from the target's checkpoint, where the
        target holds no whole copy on this rank."""
        for name, lazy in weights:
            if name == "model.embed_tokens.weight":
                if self.own_embed and not self._embed_in_checkpoint:
                    self.embed_tokens.load(lazy)
                if self.own_head and not self.eagle3 and tied:
                    self.lm_head.load(lazy)
            elif name == "lm_head.weight" and self.own_head and not self.eagle3 and not tied:
                self.lm_head.load(lazy)

    def _load_layer(self, rest: str, lazy: LazyTensor) -> None:
        layer, cfg = self.layer, self.config
        module, _, kind = rest.rpartition(".")
        is_bias = kind == "bias"
        if module.startswith("self_attn.") and module[10:] in _QKV:
            layer.self_attn.qkv_proj.load(module[10], lazy, is_bias)
        elif module == "self_attn.o_proj":
            layer.self_attn.o_proj.load(lazy, is_bias)
        elif module == "mlp.gate_proj":
            layer.mlp.gate_up_proj.load(0, lazy)
        elif module == "mlp.up_proj":
            layer.mlp.gate_up_proj.load(1, lazy)
        elif module == "mlp.down_proj":
            layer.mlp.down_proj.load(lazy)
        elif module in ("self_attn.q_norm", "self_attn.k_norm") and cfg.qk_norm:
            _copy(rest, getattr(layer.self_attn, module[10:]).weight, lazy)
        else:
            _copy(rest, getattr(layer, module).weight, lazy)

    def _expected_names(self) -> set[str]:
        cfg = self.config
        layer = {"post_attention_layernorm.weight", "self_attn.o_proj.weight",
                 *(f"self_attn.{m}_proj.weight" for m in "qkv"),
                 *(f"mlp.{m}_proj.weight" for m in ("gate", "up", "down"))}
        if cfg.qkv_bias:
            layer |= {f"self_attn.{m}_proj.bias" for m in "qkv"}
        if cfg.o_bias:
            layer.add("self_attn.o_proj.bias")
        if cfg.qk_norm:
            layer |= {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}
        names = {"fc.weight", *(_LAYER + n for n in layer)}
        if self.fc.bias is not None:
            names.add("fc.bias")
        if self.eagle3:
            names |= {_LAYER + "input_layernorm.weight", "hidden_norm.weight",
                      "norm.weight", "lm_head.weight"}
            if self.spec.draft_vocab != cfg.vocab_size:
                names.add("d2t")
            if self._embed_in_checkpoint:
                names.add("embed_tokens.weight")
        return names


def _copy(name: str, target: torch.Tensor, lazy: LazyTensor) -> None:
    if tuple(lazy.shape) != tuple(target.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(lazy.shape)} != "
                         f"{tuple(target.shape)}")
    target.data.copy_(lazy[:])


