"""DeepSeek-V2 / V3 (and V2-Lite, V2.5, R1: the same two model types): multi-head
latent attention over a latent paged cache, and DeepSeekMoE experts.

MLA caches one vector a token and layer, ``[c_kv | k_pe]`` (``mla_config``): the
normalised compressed KV and the key part RoPE turns, shared by every head. The
layer attends over it in the "absorbed" form (DeepSeek-V2's paper, section
2.1.3; vLLM's MLA decode path): each head's query is carried into the latent
space through its slice of ``kv_b_proj`` (``W_UK``), so a score is
``q_nope W_UK . c_kv + q_pe . k_pe``, one dot product of 576 numbers with the cached
vector. The same vector is the value: the heads' outputs stay in the latent space
until ``W_UV`` takes each back to ``v_head_dim``. So attention is plain
multi-query attention (every query head on the one cached "head"), run by the
same paged kernels as every other model, with the value cache the key cache
itself (``KVCache(shared_kv=True)``); its last ``qk_rope_head_dim`` output numbers
are the rotary keys' weighted sum and are dropped. Decode rows never build a
per-head key or value; prompt chunks long enough to pay for it attend over keys
and values rebuilt from the latent instead (``mla_prefill``).

Tensor parallelism splits the heads (``q_b_proj`` / ``q_proj``, ``kv_b_proj``,
``o_proj``); the latent projection is replicated and each rank caches the whole
latent, as vLLM does. The MoE layers are ``layers.moe.SparseMoE`` with DeepSeek's
routing (``layers.moe_routing``) and plain shared experts.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from pagedserve.kernels import AttentionBackend
from pagedserve.kernels.kv_quant import dequantize, storage_view
from pagedserve.worker.config import ModelConfig
from pagedserve.worker.layers.attention import AttentionMetadata, PagedAttention
from pagedserve.worker.layers.linear import (
    LazyTensor,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from pagedserve.worker.layers.norm import RMSNorm
from pagedserve.worker.layers.rotary import RotaryEmbedding
from pagedserve.worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from pagedserve.worker.models.llama_loading import _copy_full
from pagedserve.worker.models.mla_prefill import (
    StepSplit,
    decompress_above,
    dense_chunks,
    step_split,
)
from pagedserve.worker.parallel import ParallelContext
from pagedserve.worker.pipeline import PipelineStage

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
# The latent norms' epsilon: DeepSeek's reference code (and Hugging Face's) builds them
# with the RMSNorm default, not ``rms_norm_eps`` (the releases set both to 1e-6).
LATENT_NORM_EPS = 1e-6
_REPLICATED = ParallelContext()  # (a one-rank context: every rank holds the whole matrix)


def _deinterleave(rows: torch.Tensor, rope: int) -> torch.Tensor:
    """``rows`` with its last ``rope`` rows in each group of ``rows.shape[0] / groups``
    reordered from pairs ``(x0, x1), (x2, x3)...`` to halves ``(x0, x2, ..), (x1, x3, ..)``:
    RoPE's rotate-half form then turns what DeepSeek's interleaved form turned."""
    idx = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    out = rows.clone()
    out[..., -rope:, :] = rows[..., -rope:, :][..., idx, :]
    return out


class MLAAttention(nn.Module):
    """Multi-head latent attention of one layer over its latent paged cache."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, backend: AttentionBackend,
                 dtype: torch.dtype, device: torch.device, index: int):
        super().__init__()
        mla = cfg.mla
        assert mla is not None
        self.mla = mla
        if cfg.num_heads % ctx.world_size:
            raise ValueError(f"num_attention_heads ({cfg.num_heads}) is not divisible by TP "
                             f"size {ctx.world_size}")
        self.rank, self.total_heads = ctx.rank, cfg.num_heads
        self.num_heads = cfg.num_heads // ctx.world_size
        self.num_kv_heads = 1
        h, hidden, qk = cfg.num_heads, cfg.hidden_size, mla.qk_head_dim
        self.q_proj = self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        if mla.q_lora_rank is None:
            self.q_proj = MergedColumnParallelLinear(hidden, [h * qk], ctx, dtype, device)
        else:
            self.q_a_proj = MergedColumnParallelLinear(hidden, [mla.q_lora_rank], _REPLICATED,
                                                       dtype, device)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS, dtype, device)
            self.q_b_proj = MergedColumnParallelLinear(mla.q_lora_rank, [h * qk], ctx, dtype,
                                                       device)
        self.kv_a_proj_with_mqa = MergedColumnParallelLinear(hidden, [mla.cache_dim],
                                                             _REPLICATED, dtype, device)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS, dtype, device)
        # kv_b_proj's two halves per local head: W_UK [H, nope, R] and W_UV [H, v, R].
        n, r = self.num_heads, mla.kv_lora_rank
        self.w_uk = nn.Parameter(torch.zeros(n, mla.qk_nope_head_dim, r, dtype=dtype,
                                             device=device), requires_grad=False)
        self.w_uv = nn.Parameter(torch.zeros(n, mla.v_head_dim, r, dtype=dtype,
                                             device=device), requires_grad=False)
        self.o_proj = RowParallelLinear(h * mla.v_head_dim, hidden, False, ctx, dtype, device)
        self.attn = PagedAttention(self.num_heads, 1, mla.cache_dim, backend,
                                   scale=mla.softmax_scale)
        # Chunks of more queries than this attend over rebuilt keys (``mla_prefill``).
        self.decompress_above = decompress_above(mla)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], md: AttentionMetadata
                ) -> torch.Tensor:
        mla, t, h = self.mla, x.shape[0], self.num_heads
        nope, rope, rank = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.kv_lora_rank
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))[0])
        q = q.view(t, h, nope + rope)
        latent = self.kv_a_proj_with_mqa(x)
        c_kv = self.kv_a_layernorm(latent[:, :rank].contiguous())[0]
        k_pe = RotaryEmbedding.apply(latent[:, rank:].reshape(t, 1, rope).contiguous(), cos, sin)
        q_pe = RotaryEmbedding.apply(q[..., nope:].contiguous(), cos, sin)
        key = torch.cat((c_kv.unsqueeze(1), k_pe), dim=-1)
        split = None
        if not md.is_decode and md.varlen is not None and md.image_spans is None:
            split = step_split(md, kv_cache[0].shape[1], self.decompress_above)
        if split is None:
            out = self.attn(self._latent_query(q[..., :nope], q_pe), key, key, kv_cache, md)
            o = self._leave_latent(out.view(t, h, mla.cache_dim))
        else:
            o = self._split_step(q[..., :nope], q_pe, key, kv_cache[0], md, split)
        return self.o_proj(o.reshape(t, h * mla.v_head_dim))

    def _latent_query(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """Each head's ``q_nope`` carried into the latent space ([H, T, nope] @
        [H, nope, R]), the turned part beside it."""
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
        return torch.cat((q_lat, q_pe), dim=-1)

    def _leave_latent(self, out: torch.Tensor) -> torch.Tensor:
        """Heads' latent outputs ``[T, H, R + rope]`` back to ``[T, H, v]`` per head
        ([H, T, R] @ [H, R, v]); the rotary keys' weighted sum is dropped."""
        rank = self.mla.kv_lora_rank
        return torch.bmm(out[..., :rank].transpose(0, 1),
                         self.w_uv.transpose(1, 2)).transpose(0, 1)

    def _split_step(self, q_nope: torch.Tensor, q_pe: torch.Tensor, key: torch.Tensor,
                    cache: torch.Tensor, md: AttentionMetadata, split: StepSplit
                    ) -> torch.Tensor:
        """A step with long prompt chunks (``mla_prefill``): every token's latent stored,
        the chunks attend densely over rebuilt keys, the other rows in the latent."""
        mla, backend = self.mla, self.attn.backend
        backend.store_kv(key, key, cache, cache, md.slot_mapping)
        o = q_nope.new_empty(q_nope.shape[0], self.num_heads, mla.v_head_dim)
        rows = split.latent_rows
        if split.latent_md is not None:
            query = self._latent_query(q_nope[rows], q_pe[rows])
            out = backend.varlen_attention(query, cache, cache, split.latent_table,
                                           split.latent_md, mla.softmax_scale)
            o[rows] = self._leave_latent(out.view(len(rows), self.num_heads, mla.cache_dim))
        flat = storage_view(cache).view(-1, mla.cache_dim)
        latents = dequantize(flat[split.key_slots].view(cache.dtype), q_nope.dtype)
        rows = split.dense_rows
        o[rows] = dense_chunks(q_nope[rows], q_pe[rows], latents, self.w_uk, self.w_uv, split,
                               mla.kv_lora_rank, mla.softmax_scale)
        return o

    def load(self, module: str, name: str, lazy: LazyTensor) -> bool:
        """Load checkpoint tensor ``name`` (``module``: its name under ``self_attn.``, no
        ``.weight``); False when it is not one of this layer's."""
        mla = self.mla
        if f"{module}.weight" not in self.tensor_names() or not name.endswith(".weight"):
            return False
        if module == "kv_b_proj":
            self.load_kv_b(name, lazy)
        elif module in ("q_a_layernorm", "kv_a_layernorm"):
            _copy_full(name, getattr(self, module).weight, lazy)
        elif module == "o_proj":
            self.o_proj.load(lazy)
        elif module == "q_a_proj":
            self.q_a_proj.load(0, lazy)
        else:  # q_proj, q_b_proj, kv_a_proj_with_mqa: rows RoPE turns come reordered
            rows = lazy[:]
            if mla.rope_interleave:  # per head (q) or once (the latent's key part)
                groups = 1 if module == "kv_a_proj_with_mqa" else self.total_heads
                if rows.dim() == 2 and rows.shape[0] % groups == 0:
                    rows = _deinterleave(rows.view(groups, -1, rows.shape[1]),
                                         mla.qk_rope_head_dim).view(rows.shape)
            getattr(self, module).load(0, rows)
        return True

    def tensor_names(self) -> set[str]:
        """The layer's checkpoint tensors, as named under ``self_attn.``."""
        names = {"kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight",
                 "o_proj.weight"}
        if self.mla.q_lora_rank is None:
            return names | {"q_proj.weight"}
        return names | {"q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight"}

    def load_kv_b(self, name: str, lazy: LazyTensor) -> None:
        """This rank's heads of ``kv_b_proj`` ``[H * (nope + v), R]``, split into W_UK
        and W_UV."""
        mla, n = self.mla, self.num_heads
        per = mla.qk_nope_head_dim + mla.v_head_dim
        want = (self.total_heads * per, mla.kv_lora_rank)
        if tuple(lazy.shape) != want:
            raise ValueError(f"{name}: checkpoint shape {tuple(lazy.shape)} != {want}")
        w = lazy[self.rank * n * per:(self.rank + 1) * n * per].view(n, per, mla.kv_lora_rank)
        self.w_uk.data.copy_(w[:, :mla.qk_nope_head_dim])
        self.w_uv.data.copy_(w[:, mla.qk_nope_head_dim:])


class DeepseekDecoderLayer(LlamaDecoderLayer):
    """Llama's layer (norms, residuals, dense or routed MLP) around an MLA block."""

    attention_cls = MLAAttention


class DeepseekForCausalLM(LlamaForCausalLM):
    """DeepSeek-V2 / V3 decoder. A V3 checkpoint's multi-token-prediction layers
    (``model.layers.{num_hidden_layers}...``, ``num_nextn_predict_layers`` of them) are
    not part of the decoder and are skipped."""

    layer_cls = DeepseekDecoderLayer

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, backend: AttentionBackend,
                 dtype: torch.dtype, device: torch.device, stage: PipelineStage | None = None):
        if cfg.mla is None:
            raise ValueError(f"model_type {cfg.model_type!r} has no MLA settings")
        super().__init__(cfg, ctx, backend, dtype, device, stage)
        mla = cfg.mla
        self.rotary = RotaryEmbedding(mla.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling,
                                      device)

    def _on_this_stage(self, name: str) -> bool:
        """Never the MTP layers (so never read, not even a pre-quantised file's parts)."""
        m = _LAYER_RE.match(name)
        if m is not None and int(m.group(1)) >= self.config.num_layers:
            return False
        return super()._on_this_stage(name)

    def _attention_names(self) -> set[str]:
        return self.layers[0].self_attn.tensor_names()

    def _load_attention(self, attn: nn.Module, module: str, is_bias: bool, name: str,
                        lazy: LazyTensor) -> bool:
        assert isinstance(attn, MLAAttention)
        return not is_bias and attn.load(module, name, lazy)
