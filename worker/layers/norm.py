"""RMSNorm computed in float32, as Hugging Face Llama does, with an optional fused residual add.

On CPU in fp32 the native kernel does the add and the norm in one pass per row
(``kernels.cpu_fused.rms_norm``); elsewhere, and without a C compiler, torch ops.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels import cpu_fused


class RMSNorm(nn.Module):
    """``weight * x / rms(x)`` with the statistics in fp32 (matches transformers' LlamaRMSNorm)."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device),
                                   requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(norm(x + residual), x + residual)``; the sum feeds the next residual."""
        fused = cpu_fused.rms_norm(x, residual, self.weight, self.eps)
        if fused is not None:
            return fused
        if residual is not None:
            x = x + residual
        residual = x
        h = x.float() if x.dtype != torch.float32 else x
        var = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(var + self.eps)
        return self.weight * h.to(x.dtype), residual


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: ``x / rms(x) * (1 + weight)``, all in fp32, cast once at the end
    (transformers' Gemma3RMSNorm, whose checkpoints store the weight's offset from 1).
    Same call as :class:`RMSNorm`: with ``residual`` the sum is normalised and returned.
    In fp32 on CPU the native kernel runs it with ``1 + weight`` as its weight (the
    same product: Llama's form casts before the multiply, which fp32 does not change;
    the sum is made each call, a vector of ``hidden``, so a weight loaded anew is
    always the one read)."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden, dtype=dtype, device=device),
                                   requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dtype == torch.float32 and x.dim() == 2 and x.device.type == "cpu":
            fused = cpu_fused.rms_norm(x, residual, 1.0 + self.weight.float(), self.eps)
            if fused is not None:
                return fused
        if residual is not None:
            x = x + residual
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype), x
