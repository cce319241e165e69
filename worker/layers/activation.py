"""SwiGLU's activation: ``silu(gate) * up`` over fused ``[gate | up]`` rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_fused


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[:, :i]) * gate_up[:, i:]``; one native pass on CPU fp32 (the dense
    MLPs and every expert of a mixture call it)."""
    out = cpu_fused.silu_and_mul(gate_up)
    if out is None:
        i = gate_up.shape[1] // 2
        out = F.silu(gate_up[:, :i])
        out.mul_(gate_up[:, i:])
    return out
