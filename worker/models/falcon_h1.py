"""TII's Falcon-H1 (``falcon_h1``; ``worker.falcon_h1_config``): in every layer a
Mamba-2 mixer (``layers.mamba2``) and a Llama attention read the same normalised
input and their outputs are summed into the residual, then a SwiGLU MLP. So every
layer pages KV and keeps a state slot per sequence (``models.hybrid``).

The files name the MLP ``feed_forward``, its norm ``pre_ff_layernorm`` and the last
norm ``final_layernorm``, as Bamba's do; they load under Llama's. The muP
multipliers of the projections are folded into their weights (and biases, where the
multiplier follows the bias) as the tensors load; the embedding's and the logits'
are applied as they run (a small model ties the two).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.worker.falcon_h1_config import FalconH1Multipliers
from pagedserve.worker.layers.attention import AttentionMetadata
from pagedserve.worker.layers.linear import LazyTensor
from pagedserve.worker.layers.mamba2 import Mamba2Mixer
from pagedserve.worker.layers.norm import RMSNorm
from pagedserve.worker.models.bamba import _renamed
from pagedserve.worker.models.hybrid import RecurrentHybridMixin
from pagedserve.worker.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


class FalconH1Layer(nn.Module):
    """Norm, the mixer and the attention side by side, norm, MLP."""

    def __init__(self, cfg: Any, ctx: Any, backend: Any, dtype: torch.dtype,
                 device: torch.device, index: int) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, device)
        self.self_attn = LlamaAttention(cfg, ctx, backend, dtype, device, index)
        self.mamba = Mamba2Mixer(cfg.hidden_size, cfg.mamba, eps, ctx, dtype, device,
                                 state_index=0)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, device)
        self.mlp = LlamaMLP(cfg, ctx, dtype, device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        h = self.mamba(h, md.mamba) + self.self_attn(h, cos, sin, kv_cache, md)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class FalconH1ForCausalLM(RecurrentHybridMixin, LlamaForCausalLM):
    """Falcon-H1 (see the module docstring)."""

    layer_cls = FalconH1Layer
    checkpoint_name = staticmethod(_renamed)
    mixer_replaces_attention = False

    @property
    def multipliers(self) -> FalconH1Multipliers:
        return self.config.falcon_h1 or FalconH1Multipliers()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.multipliers.embedding

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        return None if logits is None else logits * self.multipliers.lm_head

    def lora_multiplier(self, module: str) -> float:
        """The multiplier folded into projection ``module``'s weights (``self_attn.q_proj``,
        ``mlp.gate_proj``...): an adapter's delta on it scales alike, as transformers
        applies it around the whole projection."""
        scale = self.multipliers.projection_scale(module + ".weight")
        return 1.0 if scale is None else scale

    def _load_one(self, name: str, lazy: LazyTensor) -> None:
        found = self._layer_tensor(name)
        if found is not None:
            lazy = self._scaled(found[1], lazy)
        super()._load_one(name, lazy)

    def _scaled(self, rest: str, lazy: LazyTensor) -> LazyTensor:
        """A layer's tensor ``rest`` with its multipliers folded in (fp32)."""
        m = self.multipliers
        if rest in ("mamba.in_proj.weight", "mamba.in_proj.bias"):
            mc = self.config.mamba
            groups = mc.num_groups * mc.d_state
            parts = (mc.intermediate, mc.intermediate, groups, groups, mc.num_heads)
            rows = torch.cat([torch.full((n,), s) for n, s in zip(parts, m.ssm, strict=True)])
            if rest.endswith("weight"):
                return lazy[:].float() * (rows * m.ssm_in)[:, None]
            return lazy[:].float() * rows
        scale = m.projection_scale(rest)
        return lazy if scale in (None, 1.0) else lazy[:].float() * scale
