"""ModernBERT with tensor parallelism: the encoder of ``modernbert_config``.

A step's rows are whole prompts, as for BERT (``worker.models.bert``): attention
runs over each prompt's own rows, both ways, through ``PromptBatch``, and nothing
is cached. The layers are pre-norm (the first has no attention norm, as the
embedding norm just ran), rotate q and k with RoPE (a larger base in the global
layers), and attend over the whole prompt (global layers) or 64 positions each
side (local layers); the MLP is GeGLU (``Wo(gelu(input) * gate)``). A final norm
ends the encoder. A classifier's head (``ModernBertHead``) reads the first
token's state or the mean of all of them (``classifier_pooling``); a token
classifier's, the same layers, every token's.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels import AttentionBackend
from pagedserve.worker.config import ModelConfig
from pagedserve.worker.layers.attention import AttentionMetadata
from pagedserve.worker.layers.embedding import VocabParallelEmbedding
from pagedserve.worker.layers.linear import (
    LazyTensor,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedserve.worker.layers.rotary import RotaryEmbedding
from pagedserve.worker.models.bert import EncoderModel, LayerNorm
from pagedserve.worker.models.bert_loading import copy_checked, finish_loading
from pagedserve.worker.models.fused_weights import split_rows
from pagedserve.worker.models.prompt_batch import PromptBatch
from pagedserve.worker.parallel import ParallelContext
from pagedserve.worker.pipeline import IntermediateTensors, PipelineStage

_LAYER_RE = re.compile(r"^layers\.(\d+)\.(attn_norm|attn\.Wqkv|attn\.Wo|mlp_norm|mlp\.Wi|"
                       r"mlp\.Wo)\.(weight|bias)$")
# A masked-LM file's head and decoder (an embedder saved from one): never used here.
_SKIPPED = ("decoder.", "head.")


class ModernBertLayer(nn.Module):
    """``x + attn(norm(x))``, then ``x + mlp(norm(x))``; ``window`` 0 for a global
    layer, else how far each token sees either way."""

    def __init__(self, cfg: ModelConfig, index: int, ctx: ParallelContext,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        enc = cfg.encoder
        assert enc is not None
        h, eps = cfg.hidden_size, enc.layer_norm_eps
        self.attn_norm = None if index == 0 else LayerNorm(h, eps, dtype, device,
                                                           enc.norm_bias)
        self.qkv_proj = QKVParallelLinear(h, cfg.head_dim, cfg.num_heads, cfg.num_heads,
                                          cfg.qkv_bias, ctx, dtype, device)
        self.o_proj = RowParallelLinear(h, h, cfg.o_bias, ctx, dtype, device)
        self.mlp_norm = LayerNorm(h, eps, dtype, device, enc.norm_bias)
        i = cfg.intermediate_size
        self.input_gate = MergedColumnParallelLinear(h, [i, i], ctx, dtype, device,
                                                     bias=enc.mlp_bias)
        self.down_proj = RowParallelLinear(i, h, enc.mlp_bias, ctx, dtype, device)
        self.window = enc.layer_windows[index]
        self.approximate = enc.gelu_approximate
        self.num_heads, self.head_dim = self.qkv_proj.local_heads, cfg.head_dim

    def forward(self, x: torch.Tensor, batch: PromptBatch,
                cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        qkv = self.qkv_proj(x if self.attn_norm is None else self.attn_norm(x))
        q, k = qkv[:, :h * d].view(t, h, d), qkv[:, h * d:2 * h * d].view(t, h, d)
        v = qkv[:, 2 * h * d:].view(t, h, d)
        q, k = (RotaryEmbedding.apply(y, *cos_sin) for y in (q, k))
        x = x + self.o_proj(batch.attend(q, k, v, self.window).reshape(t, h * d))
        a, gate = self.input_gate(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down_proj(F.gelu(a, approximate=self.approximate) * gate)


class ModernBertHead(nn.Module):
    """``classifier(norm(gelu(dense(pooled))))``, whole on every rank, in fp32. Not
    linear: the runner hands it a prompt's mean, never a sum."""

    linear = False

    def __init__(self, cfg: ModelConfig, num_labels: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        enc = cfg.encoder
        assert enc is not None
        h = cfg.hidden_size

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.zeros(shape, dtype=dtype, device=device),
                                requires_grad=False)

        self.dense_weight = param(h, h)
        self.dense_bias = param(h) if enc.head_bias else None
        self.norm = LayerNorm(h, enc.layer_norm_eps, dtype, device, enc.norm_bias)
        self.out_weight, self.out_bias = param(num_labels, h), param(num_labels)
        self.approximate = enc.head_gelu_approximate

    def tensors(self) -> dict[str, torch.Tensor]:
        """The file's names (``head.`` / ``classifier.``) of this head's tensors."""
        out = {"head.dense.weight": self.dense_weight, "head.norm.weight": self.norm.weight,
               "classifier.weight": self.out_weight, "classifier.bias": self.out_bias}
        if self.dense_bias is not None:
            out["head.dense.bias"] = self.dense_bias
        if self.norm.bias is not None:
            out["head.norm.bias"] = self.norm.bias
        return out

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        """Label logits of pooled states (``[..., hidden]`` -> ``[..., labels]``)."""
        bias = None if self.dense_bias is None else self.dense_bias.float()
        h = F.gelu(F.linear(pooled.float(), self.dense_weight.float(), bias),
                   approximate=self.approximate)
        nb = None if self.norm.bias is None else self.norm.bias.float()
        h = F.layer_norm(h, h.shape[-1:], self.norm.weight.float(), nb, self.norm.eps)
        return F.linear(h, self.out_weight.float(), self.out_bias.float())


class ModernBertModel(EncoderModel):
    """Embeddings (token table + norm), the layers, the final norm, and a classifier's
    head if the file has one. ``forward`` returns every row's final state."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, backend: AttentionBackend,
                 dtype: torch.dtype, device: torch.device, stage: PipelineStage | None = None):
        super().__init__()
        enc = cfg.encoder
        assert enc is not None and enc.family == "modernbert", "needs a ModernBERT config"
        self.config, self.ctx = cfg, ctx
        self.stage = self.single_stage(cfg, stage)
        h = cfg.hidden_size
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, h, ctx, dtype, device)
        self.embed_norm = LayerNorm(h, enc.layer_norm_eps, dtype, device, enc.norm_bias)
        self.layers = nn.ModuleList(ModernBertLayer(cfg, i, ctx, dtype, device)
                                    for i in range(cfg.num_layers))
        self.final_norm = LayerNorm(h, enc.layer_norm_eps, dtype, device, enc.norm_bias)
        self.rotary = {0: RotaryEmbedding(cfg.head_dim, cfg.rope_theta, None, device)}
        if any(enc.layer_windows):
            self.rotary[1] = RotaryEmbedding(cfg.head_dim, enc.local_rope_theta, None, device)
        self.score: ModernBertHead | None = None
        if cfg.classifier is not None:
            self.score = ModernBertHead(cfg, cfg.classifier.num_labels, dtype, device)

    @property
    def num_kv_heads_per_rank(self) -> int:
        return self.layers[0].num_heads

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                md: AttentionMetadata, intermediate: IntermediateTensors | None = None,
                image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` of the step's whole prompts."""
        if image_embeds is not None:
            raise ValueError("a modernbert encoder takes text only")
        batch = PromptBatch.of(md, input_ids.shape[0], input_ids.device)
        x = self.embed_norm(self.embed_tokens(input_ids))
        cos_sin = {k: r.cos_sin(positions, x.dtype) for k, r in self.rotary.items()}
        for layer in self.layers:
            x = layer(x, batch, cos_sin[int(layer.window > 0)])
        return self.final_norm(x)

    def load_weights(self, weights: Iterable[tuple[str, LazyTensor]],
                     on_layer: Callable[[str, nn.Module], None] | None = None) -> None:
        """Load transformers-named tensors (bare, or under ``model.`` in a classifier's
        file); fail naming any missing or unknown one."""
        head = self.score.tensors() if self.score is not None else {}
        simple = {"embeddings.norm.weight": self.embed_norm.weight,
                  "final_norm.weight": self.final_norm.weight, **head}
        if self.embed_norm.bias is not None:
            simple |= {"embeddings.norm.bias": self.embed_norm.bias,
                       "final_norm.bias": self.final_norm.bias}
        pending = {"embeddings.tok_embeddings.weight", *simple, *self._layer_names()}
        for raw, lazy in weights:
            name = raw.removeprefix("model.")
            if name not in head and name.startswith(_SKIPPED):
                continue
            if name == "embeddings.tok_embeddings.weight":
                self.embed_tokens.load(lazy)
            elif name in simple:
                copy_checked(name, simple[name], lazy)
            else:
                self._load_layer(name, lazy)
            pending.discard(name)
        finish_loading(pending, self.layers, on_layer, "layers")

    def _layer_names(self) -> set[str]:
        names = set()
        for i, layer in enumerate(self.layers):
            parts = [("attn.Wqkv", layer.qkv_proj), ("attn.Wo", layer.o_proj),
                     ("mlp.Wi", layer.input_gate), ("mlp.Wo", layer.down_proj),
                     ("mlp_norm", layer.mlp_norm)]
            if layer.attn_norm is not None:
                parts.append(("attn_norm", layer.attn_norm))
            for part, module in parts:
                names.add(f"layers.{i}.{part}.weight")
                if module.bias is not None:
                    names.add(f"layers.{i}.{part}.bias")
        return names

    def _load_layer(self, name: str, lazy: LazyTensor) -> None:
        m = _LAYER_RE.match(name)
        if m is None or int(m.group(1)) >= len(self.layers):
            raise ValueError(f"unexpected weight in checkpoint: {name}")
        layer, part, is_bias = self.layers[int(m.group(1))], m.group(2), m.group(3) == "bias"
        if part == "attn.Wqkv":
            hd = self.config.num_heads * self.config.head_dim
            for shard, piece in zip("qkv", split_rows(lazy, [hd] * 3, name)):
                layer.qkv_proj.load(shard, piece, is_bias)
        elif part == "mlp.Wi":
            i = self.config.intermediate_size
            for index, piece in enumerate(split_rows(lazy, [i, i], name)):
                layer.input_gate.load(index, piece, is_bias)
        elif part in ("attn.Wo", "mlp.Wo"):
            (layer.o_proj if part == "attn.Wo" else layer.down_proj).load(lazy, is_bias)
        else:
            norm = layer.mlp_norm if part == "mlp_norm" else layer.attn_norm
            target = None if norm is None else (norm.bias if is_bias else norm.weight)
            if target is None:
                raise ValueError(f"unexpected weight in checkpoint: {name}")
            copy_checked(name, target, lazy)
