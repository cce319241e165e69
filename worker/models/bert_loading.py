"""How a BERT-family encoder loads its checkpoint: transformers' names mapped onto
``BertModel``'s modules, each rank copying its shard, anything missing failing by name.

A ``...ForSequenceClassification`` file nests the encoder under ``bert.`` or
``roberta.``; a base model's file has it bare (or nested, when it was saved from a
pre-training class, whose masked-LM and next-sentence heads are skipped). Old
checkpoints name LayerNorm parameters ``gamma`` / ``beta``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from pagedserve.worker.encoder_config import CHECKPOINT_PREFIX
from pagedserve.worker.layers.linear import LazyTensor
from pagedserve.worker.models.multi_vector import COLBERT_ALIASES, head_tensor_names

_LAYER_RE = re.compile(r"^encoder\.layer\.(\d+)\.(.+)\.(weight|bias)$")
_QKV = {"attention.self.query": "q", "attention.self.key": "k", "attention.self.value": "v"}
# Heads of pre-training classes and buffers saved with some files: never used here.
_SKIPPED = ("cls.", "lm_head.", "embeddings.position_ids", "embeddings.token_type_ids")


def copy_checked(name: str, target: torch.Tensor, lazy: LazyTensor) -> None:
    if tuple(lazy.shape) != tuple(target.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(lazy.shape)} != "
                         f"{tuple(target.shape)}")
    target.data.copy_(lazy[:])


def finish_loading(pending: set[str], layers: Iterable[nn.Module],
                   on_layer: Callable[[str, nn.Module], None] | None, prefix: str) -> None:
    """Fail naming the weights the checkpoint lacked (``pending``, five at most); else
    hand each layer, named ``{prefix}.{i}``, to ``on_layer``."""
    if pending:
        missing = sorted(pending)
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint is missing weights: {missing[:5]}{more}")
    for i, layer in enumerate(layers if on_layer is not None else ()):
        on_layer(f"{prefix}.{i}", layer)


class BertWeightLoading:
    """``load_weights`` of ``BertModel`` (see the module docstring)."""

    config: Any
    layers: Any
    embed_tokens: Any
    position_embeddings: Any
    token_type_embeddings: Any
    embed_norm: Any
    score: Any
    task_heads: Any

    def load_weights(self, weights: Iterable[tuple[str, LazyTensor]],
                     on_layer: Callable[[str, nn.Module], None] | None = None) -> None:
        """Load transformers-named tensors; fail naming any missing or unknown one.
        ``on_layer`` gets each layer once everything is in."""
        head = self._head_names()
        pending = self._expected_names() | set(head)
        splade = self._splade_names()
        pending |= {n for n in splade if ".decoder." not in n}  # (tied, or one bias)
        mv = self.config.encoder.multi_vector
        projections = head_tensor_names(mv, self.task_heads) if mv is not None else {}
        pending |= set(projections)
        aliases = COLBERT_ALIASES if mv is not None and mv.kind == "colbert" else {}
        prefix = CHECKPOINT_PREFIX[self.config.model_type]
        own_decoder = False  # (the file's decoder rows win, whichever tensor comes first)
        for raw, lazy in weights:
            name = raw.removeprefix(prefix)
            name = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", name)
            name = re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", name)
            name = aliases.get(name, name)
            if name in projections:
                copy_checked(name, projections[name], lazy)
                pending.discard(name)
                continue
            if name in splade:
                copy_checked(name, splade[name], lazy)
                pending.discard(name.replace("decoder.bias", "bias"))
                own_decoder |= name == "cls.predictions.decoder.weight"
                continue
            if splade and name == "embeddings.word_embeddings.weight" and not own_decoder:
                # (SPLADE's decoder tied to the word embedding: its rows, whole)
                copy_checked(name, splade["cls.predictions.decoder.weight"], lazy)
            if name.startswith(_SKIPPED) or (name.startswith("pooler.") and name not in head):
                continue  # (an embedder's pooler: sentence-transformers never uses it)
            self._load_one(name, lazy, head)
            pending.discard(name)
        finish_loading(pending, self.layers, on_layer, "encoder.layer")

    def _splade_names(self) -> dict[str, torch.Tensor]:
        """A SPLADE file's masked-LM head tensors -> ``SpladeHead``'s (empty for any
        other file); ``decoder.bias`` is the head's ``bias`` again."""
        if not self.config.encoder.sparse:
            return {}
        out = {f"cls.predictions.{k}": v for k, v in self.score.tensors().items()}
        out["cls.predictions.decoder.bias"] = out["cls.predictions.bias"]
        return out

    def _head_names(self) -> dict[str, tuple[str, bool]]:
        """A classifier file's head tensors -> (``EncoderClassifierHead`` part, is bias)."""
        if self.score is None or self.config.encoder.sparse:
            return {}
        if self.config.classifier.per_token:  # (one Linear over every token)
            return {"classifier.weight": ("out_weight", False),
                    "classifier.bias": ("out_bias", True)}
        if self.config.encoder.family == "bert":
            dense, out = "pooler.dense", "classifier"
        else:
            dense, out = "classifier.dense", "classifier.out_proj"
        return {f"{dense}.weight": ("dense_weight", False), f"{dense}.bias": ("dense_bias", True),
                f"{out}.weight": ("out_weight", False), f"{out}.bias": ("out_bias", True)}

    def _expected_names(self) -> set[str]:
        names = {"embeddings.word_embeddings.weight", "embeddings.position_embeddings.weight",
                 "embeddings.token_type_embeddings.weight", "embeddings.LayerNorm.weight",
                 "embeddings.LayerNorm.bias"}
        parts = [*_QKV, "attention.output.dense", "attention.output.LayerNorm",
                 "intermediate.dense", "output.dense", "output.LayerNorm"]
        for i in range(self.config.num_layers):
            names |= {f"encoder.layer.{i}.{p}.{w}" for p in parts for w in ("weight", "bias")}
        return names

    def _load_one(self, name: str, lazy: LazyTensor,
                  head: dict[str, tuple[str, bool]]) -> None:
        if name in head:
            part, _ = head[name]
            copy_checked(name, getattr(self.score, part), lazy)
            return
        simple = {"embeddings.position_embeddings.weight": self.position_embeddings,
                  "embeddings.token_type_embeddings.weight": self.token_type_embeddings,
                  "embeddings.LayerNorm.weight": self.embed_norm.weight,
                  "embeddings.LayerNorm.bias": self.embed_norm.bias}
        if name == "embeddings.word_embeddings.weight":
            self.embed_tokens.load(lazy)
            return
        if name in simple:
            copy_checked(name, simple[name], lazy)
            return
        m = _LAYER_RE.match(name)
        if m is None or int(m.group(1)) >= len(self.layers):
            raise ValueError(f"unexpected weight in checkpoint: {name}")
        layer, part, is_bias = self.layers[int(m.group(1))], m.group(2), m.group(3) == "bias"
        if part in _QKV:
            layer.attention.qkv_proj.load(_QKV[part], lazy, is_bias)
        elif part == "attention.output.dense":
            layer.attention.o_proj.load(lazy, is_bias)
        elif part == "intermediate.dense":
            layer.up_proj.load(lazy, is_bias)
        elif part == "output.dense":
            layer.down_proj.load(lazy, is_bias)
        elif part in ("attention.output.LayerNorm", "output.LayerNorm"):
            norm = layer.attention.norm if part.startswith("attention") else layer.norm
            copy_checked(name, norm.bias if is_bias else norm.weight, lazy)
        else:
            raise ValueError(f"unexpected weight in checkpoint: {name}")
