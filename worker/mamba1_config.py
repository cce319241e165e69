"""What a hybrid decoder with Mamba-1 mixers needs beyond a Llama config: AI21's Jamba
(``model_type: jamba``: Jamba-v0.1, Jamba-1.5 / 1.6 / 1.7 Mini and Large, Jamba
Reasoning 3B).

Jamba puts one attention layer in every ``attn_layer_period`` (at
``attn_layer_offset``) among Mamba-1 layers, and routes the MLP of one layer in every
``expert_layer_period`` (at ``expert_layer_offset``) to ``num_experts`` experts. Its
attention rotates by nothing: the Mamba layers carry the order. A Mamba-1 mixer
differs from Mamba-2's (``mamba_config``) in its state: one decay per channel and
state dimension, not per head, so each sequence keeps an ``[intermediate, d_state]``
fp32 state and the convolution's last ``d_conv - 1`` inputs over the ``intermediate``
channels; B, C and the step size come from a projection of the convolved input
(``x_proj``, the step through a rank-``dt_rank`` bottleneck, ``dt_proj``), and Jamba
RMS-normalises the three (``dt_layernorm``, ``b_layernorm``, ``c_layernorm``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pagedserve.worker.config_fields import count, non_negative_int, positive_int

MAMBA1_MODEL_TYPES = ("jamba",)


@dataclass(frozen=True)
class Mamba1Config:
    """A Mamba-1 mixer's shapes (every mixer's alike) and which layers have one; the
    fields the engine reads of a ``MambaConfig`` (``layers``, ``attention``,
    ``state_bytes``)."""

    layers: tuple[int, ...]
    attention: tuple[int, ...]
    intermediate: int
    d_state: int
    d_conv: int
    dt_rank: int
    conv_bias: bool
    proj_bias: bool
    # The RMSNorms on the step size, B and C: "weighted" (Jamba's ``dt_layernorm``...),
    # "plain" (Falcon-Mamba's, without weights) or "none" (Mamba's); ``norm_eps`` theirs.
    inner_norms: str = "weighted"
    norm_eps: float = 1e-6

    def state_bytes(self, conv_elem: int, tp: int = 1) -> int:
        """Bytes of one sequence's state on one of ``tp`` ranks, every mixer: the
        convolution's last inputs (``conv_elem`` bytes a number) and the fp32 SSM state."""
        per_channel = (self.d_conv - 1) * conv_elem + self.d_state * 4
        return len(self.layers) * self.intermediate * per_channel // tp


def period_layers(cfg: dict[str, Any], period_field: str, offset_field: str,
                  default_period: int, default_offset: int, num_layers: int
                  ) -> tuple[int, ...]:
    """The layers ``i`` with ``i % period == offset`` (Jamba's rhythm for attention and
    for experts); a ``ValueError`` names a field out of range."""
    period = count(cfg, period_field, default_period)
    offset = cfg.get(offset_field, default_offset)
    offset = non_negative_int({offset_field: offset}, offset_field)
    if offset >= period:
        raise ValueError(f"model config field {offset_field!r} ({offset}) must be smaller "
                         f"than {period_field!r} ({period})")
    return tuple(i for i in range(num_layers) if i % period == offset)


def jamba_mamba_config(cfg: dict[str, Any], num_layers: int) -> Mamba1Config:
    """A Jamba file's Mamba layers and attention layers (``attn_layer_period`` /
    ``attn_layer_offset``) and its mixers' shapes."""
    attention = period_layers(cfg, "attn_layer_period", "attn_layer_offset", 8, 4,
                              num_layers)
    hidden = positive_int("hidden_size", cfg.get("hidden_size"))
    dt_rank = cfg.get("mamba_dt_rank", "auto")
    dt_rank = positive_int("mamba_dt_rank",
                           math.ceil(hidden / 16) if dt_rank == "auto" else dt_rank)
    d_conv = count(cfg, "mamba_d_conv", 4)
    if d_conv < 2:
        raise ValueError(f"model config field 'mamba_d_conv' must be >= 2, got {d_conv}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"model config field 'hidden_act' must be 'silu', got "
                         f"{cfg.get('hidden_act')!r}")
    return Mamba1Config(
        layers=tuple(i for i in range(num_layers) if i not in attention), attention=attention,
        intermediate=count(cfg, "mamba_expand", 2) * hidden,
        d_state=count(cfg, "mamba_d_state", 16), d_conv=d_conv, dt_rank=dt_rank,
        conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)))
