"""AI2's OLMo 2 and OLMo 3 decoders (``olmo_config``): norms after each sublayer
instead of before, q and k normalised over their whole projections, and (OLMo 3)
sliding layers with their own RoPE table.

The layer keeps the Llama stack's residual convention (it returns ``(out,
residual)`` whose sum is the stream, so pipeline stages and the final norm's fused
add work unchanged): with ``s`` the stream it gets, it returns
``post_ff_norm(mlp(s'))`` and ``s' = s + post_attn_norm(attention(s))``.

Under tensor parallelism a rank holds a slice of q and k, while their norms span
every head: each rank sums its slice's squares and one all-reduce adds them up
(a replicated KV head, when there are fewer than ranks, is counted once per rank
that holds it, and so is every element, so the mean stays exact).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.worker.layers.attention import AttentionMetadata
from pagedserve.worker.layers.linear import LazyTensor
from pagedserve.worker.layers.norm import RMSNorm
from pagedserve.worker.layers.rotary import RotaryEmbedding
from pagedserve.worker.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from pagedserve.worker.parallel import ParallelContext


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a width split across tensor-parallel ranks (this rank's slice of
    ``weight``), statistics in fp32 as transformers' Olmo2RMSNorm computes them."""

    def __init__(self, width: int, start: int, eps: float, ctx: ParallelContext,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.width, self.start, self.eps, self.ctx = width, start, eps, ctx
        self.weight = nn.Parameter(torch.ones(width, dtype=dtype, device=device),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        sq = h.pow(2).sum(-1, keepdim=True)
        if self.ctx.world_size > 1:
            sq = self.ctx.all_reduce(sq)
        h = h * torch.rsqrt(sq / (self.width * self.ctx.world_size) + self.eps)
        return (self.weight * h.to(x.dtype)) if x.dtype != torch.float32 else self.weight * h

    def load(self, name: str, lazy: LazyTensor, full: int) -> None:
        if tuple(lazy.shape) != (full,):
            raise ValueError(f"{name}: checkpoint shape {tuple(lazy.shape)} != ({full},)")
        self.weight.data.copy_(lazy[self.start:self.start + self.width])


class OlmoAttention(LlamaAttention):
    """Llama attention whose q and k are normalised over every head before RoPE."""

    def __init__(self, cfg, ctx, backend, dtype, device, index: int) -> None:
        super().__init__(cfg, ctx, backend, dtype, device, index)
        d, proj = cfg.head_dim, self.qkv_proj
        self.q_norm = ShardedRMSNorm(self.num_heads * d, proj.q_start * d, cfg.rms_norm_eps,
                                     ctx, dtype, device)
        self.k_norm = ShardedRMSNorm(self.num_kv_heads * d, proj.kv_start * d,
                                     cfg.rms_norm_eps, ctx, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], md: AttentionMetadata
                ) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        hq, hkv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x)
        q = self.q_norm(qkv[:, :hq * d]).view(t, hq, d)
        k = self.k_norm(qkv[:, hq * d:(hq + hkv) * d]).view(t, hkv, d)
        v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
        q = RotaryEmbedding.apply(q, cos, sin)
        k = RotaryEmbedding.apply(k, cos, sin)
        return self.o_proj(self.attn(q, k, v, kv_cache, md))


class OlmoDecoderLayer(LlamaDecoderLayer):
    """Norms after the attention and the MLP (``post_attention_layernorm``,
    ``post_feedforward_layernorm``); ``input_layernorm`` is built but never loaded."""

    attention_cls = OlmoAttention

    def __init__(self, cfg, ctx, backend, dtype, device, index: int) -> None:
        super().__init__(cfg, ctx, backend, dtype, device, index)
        del self.input_layernorm
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype,
                                                  device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        s = x if residual is None else x + residual
        a, _ = self.post_attention_layernorm(self.self_attn(s, cos, sin, kv_cache, md))
        s = s + a
        m, _ = self.post_feedforward_layernorm(self.mlp(s))
        return m, s


class OlmoForCausalLM(LlamaForCausalLM):
    """OLMo 2 / 3: the Llama stack with ``OlmoDecoderLayer`` and, for OLMo 3 files whose
    sliding layers rotate differently, a second RoPE table for them."""

    layer_cls = OlmoDecoderLayer

    def __init__(self, cfg, ctx, backend, dtype, device, stage=None) -> None:
        super().__init__(cfg, ctx, backend, dtype, device, stage)
        self.rotary_local = None
        self._local = [layer.self_attn.attn.window is not None for layer in self.layers]
        if cfg.local_rope_theta is not None and any(self._local):
            self.rotary_local = RotaryEmbedding(cfg.head_dim, cfg.local_rope_theta, None,
                                                device, cfg.rotary_dim)

    def layer_ropes(self, positions: torch.Tensor, dtype: torch.dtype
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        full = self.rotary.cos_sin(positions, dtype)
        if self.rotary_local is None:
            return [full] * len(self.layers)
        local = self.rotary_local.cos_sin(positions, dtype)
        return [local if is_local else full for is_local in self._local]

    def _expected_names(self) -> set[str]:
        return {n for n in super()._expected_names() if not n.endswith("input_layernorm.weight")
                } | {f"model.layers.{i}.post_feedforward_layernorm.weight"
                     for i in range(self.stage.start, self.stage.end)}

    def _load_attention(self, attn: nn.Module, module: str, is_bias: bool, name: str,
                        lazy: LazyTensor) -> bool:
        if module in ("q_norm", "k_norm") and not is_bias:
            heads = self.config.num_heads if module == "q_norm" else self.config.num_kv_heads
            getattr(attn, module).load(name, lazy, heads * self.config.head_dim)
            return True
        return super()._load_attention(attn, module, is_bias, name, lazy)
