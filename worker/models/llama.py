"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/3, SmolLM2, and the mixture-of-experts
Mixtral, Qwen2-MoE, Qwen3-MoE and GPT-OSS) with tensor parallelism.

The differences between these architectures are config flags (q/k/v bias,
Qwen3's per-head q/k RMSNorm, rope scaling, tied head, GQA ratio, routed
experts in place of some or all MLPs, GPT-OSS's attention sinks and biased,
clamped experts), so one implementation covers them. The
forward runs over a flat, mixed batch of tokens (any mix of prefill chunks and
decodes) and returns hidden states; the runner picks the rows that need
logits, so the LM head is never computed on prompt tokens that are not
sampled. Checkpoint loading: ``llama_loading``.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels import AttentionBackend
from pagedserve.worker.classifier import ScoreHead
from pagedserve.worker.config import ModelConfig
from pagedserve.worker.layers.activation import silu_and_mul
from pagedserve.worker.layers.attention import AttentionMetadata, PagedAttention
from pagedserve.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.worker.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedserve.worker.layers.moe import SparseMoE
from pagedserve.worker.layers.moe_ernie import ErnieMoE
from pagedserve.worker.layers.moe_gpt_oss import GptOssMoE
from pagedserve.worker.layers.moe_granite import GraniteMoE
from pagedserve.worker.layers.norm import GemmaRMSNorm, RMSNorm
from pagedserve.worker.layers.rotary import RotaryEmbedding
from pagedserve.worker.models.llama_loading import LlamaWeightLoading
from pagedserve.worker.parallel import ParallelContext
from pagedserve.worker.pipeline import IntermediateTensors, PipelineStage

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, backend: AttentionBackend,
                 dtype: torch.dtype, device: torch.device, index: int):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads,
                                          cfg.num_kv_heads, cfg.qkv_bias, ctx, dtype, device)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size,
                                        cfg.o_bias, ctx, dtype, device)
        self.num_heads = self.qkv_proj.local_heads
        self.num_kv_heads = self.qkv_proj.local_kv_heads
        self.head_dim = cfg.head_dim
        # Qwen3 and Gemma 3 normalise each head of q and k before RoPE; one weight shared
        # by all heads. Gemma scales by query_pre_attn_scalar ** -0.5 (gemma_config).
        self.q_norm = self.k_norm = None
        norm = GemmaRMSNorm if cfg.gemma else RMSNorm
        if cfg.qk_norm:
            self.q_norm = norm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
            self.k_norm = norm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
        scale = cfg.gemma.query_pre_attn_scalar ** -0.5 if cfg.gemma else None
        if cfg.granite is not None:
            scale = cfg.granite.attention
        # GPT-OSS: a learnt sink logit per query head (this rank's), kept in fp32.
        self.sinks: nn.Parameter | None = None
        if cfg.attention_sinks:
            self.sinks = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32,
                                                  device=device), requires_grad=False)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, cfg.head_dim, backend,
                                   window=cfg.layer_window(index), scale=scale,
                                   softcap=cfg.gemma.attn_logit_softcapping if cfg.gemma
                                   else None, sinks=self.sinks)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], md: AttentionMetadata
                ) -> torch.Tensor:
        return self.o_proj(self.attend(x, cos, sin, kv_cache, md))

    def attend(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               kv_cache: tuple[torch.Tensor, torch.Tensor], md: AttentionMetadata
               ) -> torch.Tensor:
        """The heads' outputs ``[T, heads * head_dim]`` before ``o_proj`` (Qwen3-Next
        gates them there)."""
        t, d = x.shape[0], self.head_dim
        qkv = self.qkv_proj(x)
        hq, hkv = self.num_heads, self.num_kv_heads
        q = qkv[:, : hq * d].view(t, hq, d)
        k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(t * hq, d))[0].view(t, hq, d)
            k = self.k_norm(k.reshape(t * hkv, d))[0].view(t, hkv, d)
        # Rotating q and k separately yields contiguous tensors, which kernels view freely.
        q = RotaryEmbedding.apply(q, cos, sin)
        k = RotaryEmbedding.apply(k, cos, sin)
        v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
        return self.attn(q, k, v, kv_cache, md)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        i = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [i, i], ctx, dtype,
                                                       device)
        self.down_proj = RowParallelLinear(i, cfg.hidden_size, False, ctx, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    attention_cls: type[nn.Module] = LlamaAttention  # (DeepSeek's layer swaps in MLA)

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, backend: AttentionBackend,
                 dtype: torch.dtype, device: torch.device, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = self.attention_cls(cfg, ctx, backend, dtype, device, index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype,
                                                device)
        self.mlp: LlamaMLP | SparseMoE
        if cfg.moe is not None and index in cfg.moe.sparse_layers:
            moe_cls = GptOssMoE if cfg.moe.gpt_oss else GraniteMoE if cfg.moe.granite \
                else ErnieMoE if cfg.moe.ernie else SparseMoE
            self.mlp = moe_cls(cfg.hidden_size, cfg.moe, ctx, dtype, device)
        else:
            self.mlp = LlamaMLP(cfg, ctx, dtype, device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache, md)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(LlamaWeightLoading, nn.Module):
    """The whole decoder plus a vocab-parallel LM head.

    ``forward`` returns final hidden states for every token; ``compute_logits``
    turns the selected rows into full-vocabulary logits on rank 0. Subclasses swap
    the decoder layer (``layer_cls``), the norm (``norm_cls``) and the rotary tables
    a layer gets (``layer_ropes``).
    """

    layer_cls: type[nn.Module] = LlamaDecoderLayer
    norm_cls: type[nn.Module] = RMSNorm
    # Layers whose inputs (the residual stream) each forward keeps in ``aux_hidden``,
    # by layer index, for an EAGLE-3 head (``models.eagle``); none by default.
    aux_layers: tuple[int, ...] = ()
    aux_hidden: dict[int, torch.Tensor] = {}

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, backend: AttentionBackend,
                 dtype: torch.dtype, device: torch.device, stage: PipelineStage | None = None):
        super().__init__()
        self.config, self.ctx = cfg, ctx
        # A pipeline stage builds only its layers; the first embeds, the last holds the
        # final norm and the head (which loads the embedding's rows when they are tied
        # and the embedding lives on another stage).
        self.stage = stage or PipelineStage.of(cfg.num_layers)
        first, last = self.stage.is_first, self.stage.is_last
        self.embed_tokens: VocabParallelEmbedding | None = None
        # A multimodal model's image encoder (the first stage's); None: text only.
        self.vision: nn.Module | None = None
        if first:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx,
                                                       dtype, device)
        self.layers = nn.ModuleList(
            self.layer_cls(cfg, ctx, backend, dtype, device, i)
            for i in range(self.stage.start, self.stage.end)
        )
        self.norm: RMSNorm | GemmaRMSNorm | None = None
        self.lm_head: ParallelLMHead | None = None
        if last:
            self.norm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        # A headless file (an embedder, a classifier) never generates: its single stage
        # ties a head to the embedding (no memory), a later pipeline stage holds none
        # (a vocab x hidden copy of the embedding it would never run).
        if last and (self.embed_tokens is not None or not cfg.headless):
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, ctx, dtype, device)
            if self.embed_tokens is not None and (cfg.tie_word_embeddings or cfg.headless):
                self.lm_head.tie_to(self.embed_tokens)
        # A sequence classifier's label head (``classifier``): pooled states only.
        self.score: ScoreHead | None = None
        if last and cfg.classifier is not None:
            self.score = ScoreHead(cfg.classifier.num_labels, cfg.hidden_size, dtype, device)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, device,
                                      cfg.rotary_dim, cfg.mrope_section)

    @property
    def num_kv_heads_per_rank(self) -> int:
        return self.layers[0].self_attn.num_kv_heads

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.layers]

    @property
    def graph_capturable(self) -> bool:
        """Whether a decode step can be captured as a CUDA graph: not when routed experts
        run the torch loop, which reads per-expert row counts on the host."""
        return all(layer.mlp.fused for layer in self.layers
                   if isinstance(layer.mlp, SparseMoE))

    @property
    def kv_scales_pending(self) -> bool:
        """Whether a layer still waits to calibrate its KV scales (steps run eagerly)."""
        return any(a.calibrating for a in self.attention_layers())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches,
                md: AttentionMetadata, intermediate: IntermediateTensors | None = None,
                image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor | IntermediateTensors:
        """Hidden states ``[T, hidden]`` for the flat batch ``input_ids[T]`` at ``positions[T]``.

        A stage after the first continues from ``intermediate`` (the previous stage's
        output) instead of embedding; a stage before the last returns its layers'
        output as ``IntermediateTensors`` instead of normalising it. ``image_embeds``
        ``(rows, embeddings)`` replace those rows' token embeddings (an image's
        placeholders; the embeddings go in as the encoder gives them, unscaled).
        """
        residual: torch.Tensor | None = None
        if self.embed_tokens is not None:
            x = self.embed(input_ids)
            if image_embeds is not None:
                x = x.index_copy(0, image_embeds[0], image_embeds[1].to(x.dtype))
        elif intermediate is None:
            raise ValueError(f"pipeline stage {self.stage.rank} needs the previous stage's "
                             "hidden states")
        else:
            x, residual = intermediate.hidden, intermediate.residual
        ropes = self.layer_ropes(positions, x.dtype)
        if self.aux_layers:
            self.aux_hidden = {}
        for i, (layer, kv, (cos, sin)) in enumerate(zip(self.layers, kv_caches, ropes,
                                                        strict=True), self.stage.start):
            if i in self.aux_layers:
                self.aux_hidden[i] = x.clone() if residual is None else x + residual
            x, residual = layer(x, residual, cos, sin, kv, md)
        if self.norm is None:
            assert residual is not None  # every stage holds at least one layer
            return IntermediateTensors(x, residual)
        x, _ = self.norm(x, residual)
        return x

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first stage's input: the tokens' embeddings."""
        assert self.embed_tokens is not None
        return self.embed_tokens(input_ids)

    def layer_ropes(self, positions: torch.Tensor, dtype: torch.dtype
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each of this stage's layers' RoPE ``(cos, sin)`` at ``positions``: one table."""
        return [self.rotary.cos_sin(positions, dtype)] * len(self.layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits ``[N, vocab]`` on rank 0 (None elsewhere); every rank must call it."""
        if self.lm_head is None:
            raise RuntimeError(f"pipeline stage {self.stage.rank} holds no LM head")
        return self.lm_head.logits(hidden)
