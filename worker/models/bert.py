"""BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa) with tensor parallelism.

Each step's rows are whole prompts (the engine turns chunked prefill and prefix
caching off for encoders, ``cluster.encoder_engine``), so attention runs over
the step's own rows, both ways, and stores nothing: the model keeps no KV
cache. The projections run over the real rows only; attention pads the prompts
in groups of similar length (``prompt_batch``). ``EncoderModel`` is what every
encoder (this one and ``modernbert``) shows the worker.

The layers are post-norm (``LayerNorm(x + sublayer(x))``), GELU MLPs, biases
everywhere; q/k/v, the MLP input and the word embedding are split across ranks
as the decoders' are. The classification heads (``EncoderClassifierHead``)
apply to the first token's final state (``[CLS]`` / ``<s>``), as transformers'
do; a token classifier's (``TokenClassifierHead``) to every token's.
Checkpoint loading: ``bert_loading``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels import AttentionBackend
from pagedserve.worker.config import ModelConfig
from pagedserve.worker.layers.attention import AttentionMetadata
from pagedserve.worker.layers.embedding import VocabParallelEmbedding
from pagedserve.worker.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedserve.worker.models.bert_loading import BertWeightLoading
from pagedserve.worker.models.multi_vector import task_heads
from pagedserve.worker.models.prompt_batch import PromptBatch
from pagedserve.worker.models.splade import SpladeHead
from pagedserve.worker.parallel import ParallelContext
from pagedserve.worker.pipeline import IntermediateTensors, PipelineStage


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.zeros(shape, dtype=dtype, device=device), requires_grad=False)


class LayerNorm(nn.Module):
    """LayerNorm (with a bias unless ``bias`` is off, as in ModernBERT), in the model's
    dtype (as transformers runs it)."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, device: torch.device,
                 bias: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = _param((hidden,), dtype, device)
        self.bias = _param((hidden,), dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


class EncoderAttention(nn.Module):
    """Self-attention over each prompt's own tokens, both ways, then the output
    projection, the residual and the post-norm."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        assert cfg.encoder is not None
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads,
                                          cfg.num_heads, True, ctx, dtype, device)
        self.o_proj = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, True, ctx, dtype,
                                        device)
        self.norm = LayerNorm(cfg.hidden_size, cfg.encoder.layer_norm_eps, dtype, device)
        self.num_heads, self.head_dim = self.qkv_proj.local_heads, cfg.head_dim

    def forward(self, x: torch.Tensor, batch: PromptBatch) -> torch.Tensor:
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        q, k, v = self.qkv_proj(x).view(t, 3, h, d).unbind(1)
        out = batch.attend(q, k, v).reshape(t, h * d)
        return self.norm(self.o_proj(out) + x)


class EncoderLayer(nn.Module):
    """Attention block, then ``LayerNorm(x + down(gelu(up(x))))``."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        assert cfg.encoder is not None
        self.attention = EncoderAttention(cfg, ctx, dtype, device)
        self.up_proj = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, True, ctx,
                                            dtype, device)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, True, ctx,
                                           dtype, device)
        self.norm = LayerNorm(cfg.hidden_size, cfg.encoder.layer_norm_eps, dtype, device)
        self.approximate = cfg.encoder.gelu_approximate

    def forward(self, x: torch.Tensor, batch: PromptBatch) -> torch.Tensor:
        h = self.attention(x, batch)
        return self.norm(self.down_proj(F.gelu(self.up_proj(h),
                                               approximate=self.approximate)) + h)


class EncoderClassifierHead(nn.Module):
    """``out(tanh(dense(first token)))``: BERT's pooler + classifier, RoBERTa's
    ``classifier.dense`` + ``classifier.out_proj``; whole on every rank, in fp32. Not
    linear: it reads one first-token state, never a sum."""

    linear = False

    def __init__(self, num_labels: int, hidden: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.dense_weight = _param((hidden, hidden), dtype, device)
        self.dense_bias = _param((hidden,), dtype, device)
        self.out_weight = _param((num_labels, hidden), dtype, device)
        self.out_bias = _param((num_labels,), dtype, device)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        """Label logits of first-token states (``[..., hidden]`` -> ``[..., labels]``)."""
        h = torch.tanh(F.linear(pooled.float(), self.dense_weight.float(),
                                self.dense_bias.float()))
        return F.linear(h, self.out_weight.float(), self.out_bias.float())


class TokenClassifierHead(nn.Module):
    """``classifier(state)`` on every token (a ``...ForTokenClassification`` file's head:
    NER and other taggers), whole on every rank, in fp32."""

    linear = True

    def __init__(self, num_labels: int, hidden: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.out_weight = _param((num_labels, hidden), dtype, device)
        self.out_bias = _param((num_labels,), dtype, device)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        """Label logits of token states (``[..., hidden]`` -> ``[..., labels]``)."""
        return F.linear(states.float(), self.out_weight.float(), self.out_bias.float())


class EncoderModel(nn.Module):
    """What every encoder model shows the worker: no LM head, no paged attention
    layers, no CUDA graphs, a single pipeline stage."""

    config: ModelConfig
    lm_head = None  # (an encoder generates nothing)
    vision = None
    aux_layers: tuple[int, ...] = ()
    graph_capturable = False  # each step's padding and masks differ
    kv_scales_pending = False

    @staticmethod
    def single_stage(cfg: ModelConfig, stage: PipelineStage | None) -> PipelineStage:
        """The one stage an encoder runs as (pipeline parallelism is refused by name)."""
        if stage is not None and stage.size > 1:
            raise ValueError("pipeline parallelism is not supported for encoder models "
                             f"({cfg.model_type}); use tensor parallelism")
        return PipelineStage.of(cfg.num_layers)

    def attention_layers(self) -> list:
        """No paged attention layers: an encoder caches nothing."""
        return []

    def owns_tensor(self, name: str) -> bool:
        """Every rank reads every tensor (its shard of the split ones)."""
        return True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        raise RuntimeError(f"a {self.config.model_type} encoder has no LM head: it embeds "
                           "and classifies, it does not generate")


class BertModel(BertWeightLoading, EncoderModel):
    """The encoder: embeddings, post-norm layers, and a classifier's head if the file
    has one. ``forward`` returns every row's final state; nothing samples from it."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, backend: AttentionBackend,
                 dtype: torch.dtype, device: torch.device, stage: PipelineStage | None = None):
        super().__init__()
        enc = cfg.encoder
        assert enc is not None, "BertModel needs an encoder config"
        self.config, self.ctx = cfg, ctx
        self.stage = self.single_stage(cfg, stage)
        h = cfg.hidden_size
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, h, ctx, dtype, device)
        self.position_embeddings = _param((enc.position_table, h), dtype, device)
        self.token_type_embeddings = _param((enc.type_vocab_size, h), dtype, device)
        self.embed_norm = LayerNorm(h, enc.layer_norm_eps, dtype, device)
        self.layers = nn.ModuleList(EncoderLayer(cfg, ctx, dtype, device)
                                    for _ in range(cfg.num_layers))
        self.score: EncoderClassifierHead | TokenClassifierHead | SpladeHead | None = None
        if enc.sparse:  # (a SPLADE encoder: its masked-LM head, pooled)
            self.score = SpladeHead(cfg.vocab_size, h, enc.layer_norm_eps,
                                    enc.gelu_approximate, enc.sparse, dtype, device)
        if cfg.classifier is not None:
            head = TokenClassifierHead if cfg.classifier.per_token else EncoderClassifierHead
            self.score = head(cfg.classifier.num_labels, h, dtype, device)
        # A multi-vector file's heads, by the task they answer (ColBERT, BGE-M3).
        self.task_heads = nn.ModuleDict(
            task_heads(enc.multi_vector, h, dtype, device) if enc.multi_vector else {})

    @property
    def num_kv_heads_per_rank(self) -> int:
        return self.layers[0].attention.num_heads

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                md: AttentionMetadata, intermediate: IntermediateTensors | None = None,
                image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` of the step's whole prompts."""
        if image_embeds is not None:
            raise ValueError(f"a {self.config.model_type} encoder takes text only")
        batch = PromptBatch.of(md, input_ids.shape[0], input_ids.device)
        enc = self.config.encoder
        assert enc is not None
        x = self.embed_tokens(input_ids) + self.position_embeddings[
            positions + enc.position_offset] + self.token_type_embeddings[
            self.token_types(input_ids, batch)]
        x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x, batch)
        return x

    def token_types(self, input_ids: torch.Tensor, batch: PromptBatch) -> torch.Tensor:
        """Each row's segment: 1 after its prompt's first separator when the model has a
        second segment (BERT's pair encoding, ``[CLS] a [SEP] b [SEP]``), else 0."""
        enc = self.config.encoder
        assert enc is not None
        if enc.type_vocab_size < 2 or enc.sep_token_id is None:
            return torch.zeros_like(input_ids)
        sep = (input_ids == enc.sep_token_id).long()
        before = torch.cumsum(sep, 0) - sep  # separators before each row, whole step
        first = before.index_select(0, batch.starts)  # ... before each prompt
        return (before - first.index_select(0, batch.seq_of_row) > 0).long()
