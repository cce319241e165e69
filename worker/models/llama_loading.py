"""How a Llama-family model loads its checkpoint: each rank copies only its shard of
each tensor, a pipeline stage reads only its own layers' tensors, and anything missing
or unknown fails naming the tensor. A mixin of ``LlamaForCausalLM`` (which holds
``config``, ``stage``, ``layers``, ``embed_tokens``, ``norm`` and ``lm_head``); a
subclass swaps a layer's attention tensors through ``_attention_names`` and
``_load_attention`` (DeepSeek's latent attention)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

from pagedserve.worker.layers.linear import LazyTensor
from pagedserve.worker.layers.moe import SparseMoE
from pagedserve.worker.models.fused_weights import neox_rows, split_rows

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_QKV = {"q_proj": "q", "k_proj": "k", "v_proj": "v"}
# A layer's own norms (OLMo's layers hold two of them; GLM-4's four).
_LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "post_feedforward_layernorm",
                "post_self_attn_layernorm", "post_mlp_layernorm")
# Model types whose files fuse each MLP's gate and up rows (``mlp.gate_up_proj``).
_FUSED_GATE_UP = ("phi3", "glm4")


class LlamaWeightLoading:
    """``load_weights`` and what it needs (see the module docstring)."""

    config: Any
    stage: Any
    layers: Any
    embed_tokens: Any
    norm: Any
    lm_head: Any
    score: Any

    def load_weights(self, weights: Iterable[tuple[str, LazyTensor]],
                     on_layer: Callable[[str, nn.Module], None] | None = None) -> None:
        """Load HF-named tensors, each rank copying only its shard; fail on anything missing.

        ``on_layer`` gets each decoder layer (its name, the module) as soon as its last
        tensor is in (the worker
        quantises it then, so a quantised model never holds all its layers in full
        precision at once)."""
        expected = self._expected_names()
        pending = set(expected)
        per_layer: dict[int, set[str]] = {}
        for n in expected if on_layer is not None else ():
            if (m := _LAYER_RE.match(n)) is not None:
                per_layer.setdefault(int(m.group(1)), set()).add(n)
        for name, lazy in weights:
            if "rotary_emb" in name:
                continue
            if self.config.embedding_only and not name.startswith(("model.", "lm_head.")):
                name = "model." + name  # a base model's checkpoint names its layers bare
            if name == "lm_head.weight" and (self.config.tie_word_embeddings or (
                    self.config.headless and not self._head_from_vocab())):
                continue
            if not self._on_this_stage(name):
                continue  # never read: another stage loads it
            if name.endswith(".bias") and name not in expected and not lazy[:].any():
                continue  # AutoGPTQ saves a zero bias for every projection: adds nothing
            self._load_one(name, lazy)
            pending.discard(name)
            if on_layer is not None:
                self._finish_layer(name, per_layer, on_layer)
        if pending:
            missing = sorted(pending)
            more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
            raise ValueError(f"checkpoint is missing weights: {missing[:5]}{more}")

    def _finish_layer(self, name: str, per_layer: dict[int, set[str]],
                      on_layer: Callable[[str, nn.Module], None]) -> None:
        """Hand a decoder layer to ``on_layer`` once ``name`` was the last of its tensors."""
        m = _LAYER_RE.match(name)
        left = per_layer.get(int(m.group(1))) if m is not None else None
        if m is None or left is None or name not in left:
            return
        left.discard(name)
        if not left:
            i = int(m.group(1))
            del per_layer[i]
            on_layer(f"model.layers.{i}", self.layers[i - self.stage.start])

    def _head_from_vocab(self) -> bool:
        """Whether this stage's classifier head is made of LM-head rows (``classifier``'s
        ``classifier_from_token``): the file's head (or tied embedding) feeds it."""
        c = self.config.classifier
        return self.score is not None and c is not None and bool(c.from_tokens)

    def _tied_head_loads_embedding(self) -> bool:
        """Whether this stage's head takes the embedding's rows itself (tied weights,
        the embedding on another stage)."""
        cfg = self.config
        if not self.stage.is_last or self.embed_tokens is not None:
            return False
        if self.lm_head is None:  # (headless: only a tied file's score rows need them)
            return cfg.tie_word_embeddings and self._head_from_vocab()
        return cfg.tie_word_embeddings

    def owns_tensor(self, name: str) -> bool:
        """Whether this rank loads checkpoint tensor ``name`` (as the file names it):
        a pre-quantised projection's packed parts are read only where it does."""
        if self.config.embedding_only and not name.startswith(("model.", "lm_head.")):
            name = "model." + name
        return self._on_this_stage(name)

    def _on_this_stage(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` belongs to this pipeline stage."""
        if name == "model.embed_tokens.weight":
            return self.embed_tokens is not None or self._tied_head_loads_embedding()
        if name in ("model.norm.weight", "lm_head.weight", "score.weight"):
            return self.stage.is_last
        m = _LAYER_RE.match(name)
        if m is None or int(m.group(1)) >= self.config.num_layers:
            return True  # loading it fails, naming it
        return self.stage.start <= int(m.group(1)) < self.stage.end

    def _expected_names(self) -> set[str]:
        cfg = self.config
        names = set()
        if self.embed_tokens is not None or self._tied_head_loads_embedding():
            names.add("model.embed_tokens.weight")
        if self.stage.is_last:
            names.add("model.norm.weight")
            if not cfg.tie_word_embeddings and (not cfg.headless or self._head_from_vocab()):
                names.add("lm_head.weight")
            if cfg.classifier is not None and not cfg.classifier.from_tokens:
                names.add("score.weight")
        for i, layer in enumerate(self.layers, self.stage.start):
            names |= {f"model.layers.{i}.{n}" for n in self._layer_names(layer)}
        return names

    def _layer_names(self, layer: nn.Module) -> set[str]:
        """A decoder layer's tensors, as named under ``model.layers.{i}.``."""
        names = {"input_layernorm.weight", "post_attention_layernorm.weight"}
        if isinstance(layer.mlp, SparseMoE):
            names |= layer.mlp.layer_names()
        elif self.config.model_type in _FUSED_GATE_UP:  # fused projections (fused_weights)
            names |= {"mlp.gate_up_proj.weight", "mlp.down_proj.weight"}
        else:
            names |= {f"mlp.{m}_proj.weight" for m in ("gate", "up", "down")}
        return names | {"self_attn." + n for n in self._attention_names()}

    def _attention_names(self) -> set[str]:
        """A layer's attention tensors, as named under ``self_attn.``."""
        cfg = self.config
        qkv = ("qkv", "o") if cfg.model_type == "phi3" else ("q", "k", "v", "o")
        names = {f"{m}_proj.weight" for m in qkv}
        if cfg.qkv_bias:
            names |= {f"{m}_proj.bias" for m in ("q", "k", "v")}
        if cfg.o_bias:
            names.add("o_proj.bias")
        if cfg.qk_norm:
            names |= {"q_norm.weight", "k_norm.weight"}
        if cfg.attention_sinks:
            names.add("sinks")
        return names

    def _load_attention(self, attn: nn.Module, module: str, is_bias: bool, name: str,
                        lazy: LazyTensor) -> bool:
        """Load a tensor of ``attn`` (``module``: its name under ``self_attn.``); False
        when it is not one of the layer's."""
        if module in ("q_norm", "k_norm") and self.config.qk_norm and not is_bias:
            _copy_full(name, getattr(attn, module).weight, lazy)
        elif module in _QKV:
            cfg = self.config
            if cfg.rope_interleaved and module != "v_proj":  # (q and k alike)
                lazy = neox_rows(lazy, cfg.head_dim, cfg.rotary_dim or cfg.head_dim)
            attn.qkv_proj.load(_QKV[module], lazy, is_bias)
        elif module == "qkv_proj" and self.config.model_type == "phi3":
            cfg = self.config
            sizes = [cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2
            for part, rows in zip("qkv", split_rows(lazy, sizes, name), strict=True):
                attn.qkv_proj.load(part, rows, is_bias)
        elif module == "o_proj":
            attn.o_proj.load(lazy, is_bias)
        else:
            return False
        return True

    def _layer_tensor(self, name: str) -> tuple[nn.Module, str] | None:
        """The decoder layer (this stage's) that checkpoint tensor ``name`` belongs to and
        its name under it; None for a tensor outside the model's layers."""
        m = _LAYER_RE.match(name)
        if m is None or int(m.group(1)) >= self.config.num_layers:
            return None
        return self.layers[int(m.group(1)) - self.stage.start], m.group(2)

    def _load_one(self, name: str, lazy: LazyTensor) -> None:
        if name == "model.embed_tokens.weight":
            if self.embed_tokens is not None:
                self.embed_tokens.load(lazy)
            elif self.lm_head is not None:
                self.lm_head.load(lazy)
            if self.config.tie_word_embeddings and self._head_from_vocab():
                self.score.load_from_vocab(name, lazy, self.config.classifier)
            return
        if name == "lm_head.weight":
            if self._head_from_vocab():  # its rows only: the head itself never runs
                self.score.load_from_vocab(name, lazy, self.config.classifier)
            else:
                assert self.lm_head is not None
                self.lm_head.load(lazy)
            return
        if name == "score.weight" and self.score is not None:
            self.score.load(name, lazy)
            return
        if name == "model.norm.weight":
            assert self.norm is not None
            _copy_full(name, self.norm.weight, lazy)
            return
        found = self._layer_tensor(name)
        if found is None:
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        layer, rest = found
        module, _, kind = rest.rpartition(".")
        is_bias = kind == "bias"
        moe = layer.mlp if isinstance(layer.mlp, SparseMoE) else None
        if moe is not None and (claimed := moe.claims(rest)) is not None:
            if not moe.load(claimed, lazy):
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
        elif module in _LAYER_NORMS and hasattr(layer, module) and not is_bias:
            _copy_full(name, getattr(layer, module).weight, lazy)
        elif module.startswith("self_attn.") and self._load_attention(
                layer.self_attn, module[10:], is_bias, name, lazy):
            return
        elif rest == "self_attn.sinks" and self.config.attention_sinks:
            _load_sinks(name, layer.self_attn, lazy, self.config.num_heads)
        elif moe is not None:
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        elif (module == "mlp.gate_up_proj" and self.config.model_type in _FUSED_GATE_UP
              and not is_bias):
            half = self.config.intermediate_size
            for i, rows in enumerate(split_rows(lazy, [half, half], name)):
                layer.mlp.gate_up_proj.load(i, rows)
        elif module == "mlp.gate_proj" and not is_bias:
            layer.mlp.gate_up_proj.load(0, lazy)
        elif module == "mlp.up_proj" and not is_bias:
            layer.mlp.gate_up_proj.load(1, lazy)
        elif module == "mlp.down_proj" and not is_bias:
            layer.mlp.down_proj.load(lazy)
        else:
            raise ValueError(f"unexpected weight {name!r} in checkpoint")


def _copy_full(name: str, param: nn.Parameter, lazy: LazyTensor) -> None:
    """Copy a replicated tensor (norm weights), checking the shape first."""
    if tuple(lazy.shape) != tuple(param.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(lazy.shape)} != {tuple(param.shape)}")
    param.data.copy_(lazy[:])


def _load_sinks(name: str, attn: nn.Module, lazy: LazyTensor, num_heads: int) -> None:
    """GPT-OSS's sink logits: this rank's query heads' share (fp32 whatever the file's)."""
    if tuple(lazy.shape) != (num_heads,):
        raise ValueError(f"{name}: checkpoint shape {tuple(lazy.shape)} != ({num_heads},)")
    start = attn.qkv_proj.q_start
    attn.sinks.data.copy_(lazy[start:start + attn.num_heads])
