"""BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa) with tensor parallelism.

Each step's rows are whole prompts (the engine turns chunked prefill and prefix
caching off for encoders, ``cluster.encoder_engine``), so attention runs over
the step's own rows, both ways, and stores nothing: the model keeps no KV
cache. The projections run over the real rows only; for attention the prompts
are padded, in groups of similar length, into ``[S, L]`` batches, one SDPA call
each with a key mask.

The layers are post-norm (``LayerNorm(x + sublayer(x))``), GELU MLPs, biases
everywhere; q/k/v, the MLP input and the word embedding are split across ranks
as the decoders' are. The classification heads (``EncoderClassifierHead``)
apply to the first token's final state (``[CLS]`` / ``<s>``), as transformers'
do. Checkpoint loading: ``bert_loading``.
"""

from __future__ import annotations

from dataclasses import dataclass

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
from pagedserve.worker.parallel import ParallelContext
from pagedserve.worker.pipeline import IntermediateTensors, PipelineStage


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.zeros(shape, dtype=dtype, device=device), requires_grad=False)


class LayerNorm(nn.Module):
    """LayerNorm with a bias, in the model's dtype (as transformers runs it)."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.eps = eps
        self.weight = _param((hidden,), dtype, device)
        self.bias = _param((hidden,), dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


# A step's prompts are padded in groups of similar length: a group holds prompts of
# at least 1 / GROUP_RATIO of its longest one's length, so attention pads little.
GROUP_RATIO = 1.3


@dataclass
class _Group:
    """Prompts padded together: ``index[s, i]`` is the flat row of prompt ``s``'s token
    ``i`` (past its end, its first row again: a padded key is masked out and a padded
    query's output dropped, so no zero row is copied in), ``mask`` the keys' validity
    (None: no padding), ``valid`` the real positions of the padded ``[S * L]`` batch
    and ``rows`` their flat rows, in the same order."""

    index: torch.Tensor
    mask: torch.Tensor | None
    valid: torch.Tensor
    rows: torch.Tensor


@dataclass
class PromptBatch:
    """A step's whole prompts as padded groups (``_Group``) for SDPA, and each flat row's
    prompt (``seq_of_row``, with the prompts' first rows in ``starts``)."""

    groups: list[_Group]
    seq_of_row: torch.Tensor
    starts: torch.Tensor

    @classmethod
    def of(cls, md: AttentionMetadata, num_rows: int, device: torch.device) -> PromptBatch:
        """The step's prompts from its metadata; a row with cached context is an error
        (an encoder's prompt must run whole, in one step)."""
        if md.varlen is None:  # every prompt is one token (a "decode"-shaped step)
            q_lens, k_lens = [1] * num_rows, md.seq_lens.cpu().tolist()
        else:
            q_lens, k_lens = md.varlen.host_query_lens(), md.varlen.host_key_lens()
        if q_lens != k_lens:
            raise RuntimeError("an encoder step holds a prompt that does not start at "
                               "position 0 (chunked prefill or a prefix-cache hit); "
                               "encoders need each prompt whole in one step")
        lens = torch.tensor(q_lens, dtype=torch.long)
        starts = torch.cumsum(lens, 0) - lens
        order = sorted(range(len(q_lens)), key=lambda s: -q_lens[s])
        groups, first = [], 0
        for n in range(1, len(order) + 1):
            if n == len(order) or q_lens[order[n]] * GROUP_RATIO < q_lens[order[first]]:
                groups.append(_group(lens, starts, order[first:n], device))
                first = n
        seq_of_row = torch.repeat_interleave(torch.arange(len(q_lens)), lens)
        return cls(groups, seq_of_row.to(device), starts.to(device))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Each prompt's rows attending to all of its own rows: ``[T, H, D]`` in and out."""
        if len(self.groups) == 1 and self.groups[0].mask is None and \
                self.groups[0].index.shape[0] == 1:  # one prompt: no padding, no gather
            out = F.scaled_dot_product_attention(*(x.transpose(0, 1)[None] for x in (q, k, v)))
            return out[0].transpose(0, 1)
        out = torch.empty_like(q)
        for g in self.groups:
            # [S, L, H, D] -> [S, H, L, D]; the key mask keeps padding out of every row.
            qp, kp, vp = (x[g.index].transpose(1, 2) for x in (q, k, v))
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=g.mask)
            o = o.transpose(1, 2).reshape(-1, *q.shape[1:]).index_select(0, g.valid)
            out.index_copy_(0, g.rows, o)
        return out


def _group(lens: torch.Tensor, starts: torch.Tensor, seqs: list[int],
           device: torch.device) -> _Group:
    """Prompts ``seqs`` (longest first) padded to the longest."""
    sel = torch.tensor(seqs, dtype=torch.long)
    g_lens, g_starts = lens[sel], starts[sel]
    longest = int(g_lens[0])
    pos = torch.arange(longest)
    ok = pos[None, :] < g_lens[:, None]
    index = torch.where(ok, g_starts[:, None] + pos[None, :], g_starts[:, None])
    valid = torch.nonzero(ok.reshape(-1)).squeeze(1)
    mask = None if bool(ok.all()) else ok.view(len(seqs), 1, 1, longest).to(device)
    return _Group(index.to(device), mask, valid.to(device),
                  index.reshape(-1).index_select(0, valid).to(device))


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
    ``classifier.dense`` + ``classifier.out_proj``; whole on every rank, in fp32."""

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


class BertModel(BertWeightLoading, nn.Module):
    """The encoder: embeddings, post-norm layers, and a classifier's head if the file
    has one. ``forward`` returns every row's final state; nothing samples from it."""

    lm_head = None  # (an encoder generates nothing)
    vision = None
    aux_layers: tuple[int, ...] = ()
    graph_capturable = False  # each step's padding and masks differ
    kv_scales_pending = False

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, backend: AttentionBackend,
                 dtype: torch.dtype, device: torch.device, stage: PipelineStage | None = None):
        super().__init__()
        enc = cfg.encoder
        assert enc is not None, "BertModel needs an encoder config"
        if stage is not None and stage.size > 1:
            raise ValueError("pipeline parallelism is not supported for encoder models "
                             f"({cfg.model_type}); use tensor parallelism")
        self.config, self.ctx = cfg, ctx
        self.stage = PipelineStage.of(cfg.num_layers)
        h = cfg.hidden_size
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, h, ctx, dtype, device)
        self.position_embeddings = _param((enc.position_table, h), dtype, device)
        self.token_type_embeddings = _param((enc.type_vocab_size, h), dtype, device)
        self.embed_norm = LayerNorm(h, enc.layer_norm_eps, dtype, device)
        self.layers = nn.ModuleList(EncoderLayer(cfg, ctx, dtype, device)
                                    for _ in range(cfg.num_layers))
        self.score: EncoderClassifierHead | None = None
        if cfg.classifier is not None:
            self.score = EncoderClassifierHead(cfg.classifier.num_labels, h, dtype, device)

    @property
    def num_kv_heads_per_rank(self) -> int:
        return self.layers[0].attention.num_heads

    def attention_layers(self) -> list:
        """No paged attention layers: an encoder caches nothing."""
        return []

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

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        raise RuntimeError(f"a {self.config.model_type} encoder has no LM head: it embeds "
                           "and classifies, it does not generate")
