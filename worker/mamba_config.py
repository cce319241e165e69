"""What a hybrid Mamba-2 / attention decoder needs beyond a Llama config (Granite
4.0-H's fields here, which IBM's Bamba shares; Nemotron-H's, spelt otherwise, in
``nemotron_h_config``).

IBM's Granite 4.0-H (``model_type: granitemoehybrid``: granite-4.0-h-micro, -tiny,
-small) interleaves Mamba-2 mixers with a few attention layers: ``layer_types``
names each layer ``mamba`` (transformers 5: ``linear_attention``) or ``attention``
(``full_attention``). A Mamba-2 layer keeps no KV cache: each sequence carries a
fixed-size state instead, the last ``d_conv - 1`` inputs of its causal convolution
and an ``[heads, head_dim, d_state]`` SSM state (``worker.mamba_state``). The mixer's
shapes are read here once, so a malformed field names itself at load time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pagedserve.worker.config_fields import count, positive_int

# Hybrids whose recurrent layers keep a state per sequence: Mamba-2 (the first four;
# Falcon-H1's beside each attention: ``falcon_h1_config``) or gated DeltaNet (Qwen3-Next,
# Qwen3.5 and its decoder alone: ``deltanet_config``) or gated short convolutions (LFM2:
# ``lfm2_config``) or Mamba-1 (Jamba: ``mamba1_config``); and the attention-free Mamba
# models (``mamba_lm_config``).
HYBRID_MODEL_TYPES = ("granitemoehybrid", "bamba", "falcon_h1", "nemotron_h", "qwen3_next",
                      "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text", "lfm2",
                      "lfm2_moe", "jamba", "mamba", "falcon_mamba", "mamba2")
_MAMBA_KINDS = ("mamba", "linear_attention")
_ATTENTION_KINDS = ("attention", "full_attention")


@dataclass(frozen=True)
class MambaConfig:
    """A Mamba-2 mixer's shapes (every Mamba layer's alike) and which layers have one.

    ``intermediate`` is ``num_heads * head_dim`` (Granite's ``mamba_expand * hidden``; a
    Nemotron-H may differ); B and C
    have ``num_groups * d_state`` channels each, the convolution runs over x, B and C
    (``conv_dim``), and the input projection yields z (the gate), x, B, C and dt
    (one per head): ``proj_dim`` rows.
    """

    layers: tuple[int, ...]
    # The layers that attend (and hold KV); the rest of a Nemotron-H are MLP-only.
    attention: tuple[int, ...]
    num_heads: int
    head_dim: int
    d_state: int
    num_groups: int
    d_conv: int
    chunk_size: int
    conv_bias: bool
    proj_bias: bool
    dt_min: float = 0.0
    dt_max: float = math.inf
    # The output's norm: "gate_then_norm" (Granite's: RMS-normalise ``y * silu(z)`` per
    # group), "norm_then_gate" (normalise ``y``, then gate) or "gate_only" (no norm).
    gate_norm: str = "gate_then_norm"

    @property
    def intermediate(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate + 2 * self.num_groups * self.d_state

    @property
    def proj_dim(self) -> int:
        return self.intermediate + self.conv_dim + self.num_heads

    def state_bytes(self, conv_elem: int, tp: int = 1) -> int:
        """Bytes of one sequence's state on one of ``tp`` ranks, every Mamba layer:
        the convolution's last inputs (``conv_elem`` bytes a number, the model dtype's)
        and the fp32 SSM state."""
        conv = self.conv_dim * (self.d_conv - 1) * conv_elem
        ssm = self.num_heads * self.head_dim * self.d_state * 4
        return len(self.layers) * (conv + ssm) // tp


def mamba_config_from_hf(cfg: dict[str, Any], model_type: str, num_layers: int
                         ) -> MambaConfig | None:
    """The Mamba part of a parsed ``config.json``; None for a model without one."""
    if model_type not in ("granitemoehybrid", "bamba"):
        return None  # (Nemotron-H's fields: ``nemotron_h_config``)
    kinds = cfg.get("layer_types") or cfg.get("layers_block_type")
    if model_type == "bamba" and kinds is None:  # (its attention layers by index)
        attn = cfg.get("attn_layer_indices") or []
        if not isinstance(attn, list) or not all(isinstance(i, int) for i in attn):
            raise ValueError(f"model config field 'attn_layer_indices' must be a list of "
                             f"layer indices, got {attn!r}")
        kinds = ["attention" if i in attn else "mamba" for i in range(num_layers)]
    if kinds is None:
        kinds = ["mamba"] * num_layers  # (transformers' default: every layer a mixer)
    if (not isinstance(kinds, list) or len(kinds) != num_layers
            or any(k not in (*_MAMBA_KINDS, *_ATTENTION_KINDS) for k in kinds)):
        raise ValueError(f"model config field 'layer_types' must name each of {num_layers} "
                         f"layers 'mamba' or 'attention', got {kinds!r}")
    hidden = positive_int("hidden_size", cfg.get("hidden_size"))
    expand = count(cfg, "mamba_expand", 2)
    heads = count(cfg, "mamba_n_heads", 128)
    head_dim = cfg.get("mamba_d_head", "auto")
    if head_dim == "auto":
        head_dim = expand * hidden // heads
    head_dim = positive_int("mamba_d_head", head_dim)
    if heads * head_dim != expand * hidden:
        raise ValueError(f"model config fields 'mamba_n_heads' ({heads}) x 'mamba_d_head' "
                         f"({head_dim}) must equal 'mamba_expand' x 'hidden_size' "
                         f"({expand * hidden})")
    groups = count(cfg, "mamba_n_groups", 1)
    if heads % groups:
        raise ValueError(f"model config field 'mamba_n_groups' ({groups}) must divide "
                         f"'mamba_n_heads' ({heads})")
    limit = time_step_limit(cfg.get("time_step_limit"), "time_step_limit")
    return MambaConfig(
        layers=tuple(i for i, k in enumerate(kinds) if k in _MAMBA_KINDS),
        attention=tuple(i for i, k in enumerate(kinds) if k in _ATTENTION_KINDS),
        num_heads=heads, head_dim=head_dim,
        d_state=count(cfg, "mamba_d_state", 256), num_groups=groups,
        d_conv=count(cfg, "mamba_d_conv", 4), chunk_size=count(cfg, "mamba_chunk_size", 256),
        conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        dt_min=float(limit[0]), dt_max=float(limit[1]))


def time_step_limit(raw: Any, field: str) -> tuple[float, float]:
    """``[min, max]`` of dt (absent: no limit)."""
    raw = raw or (0.0, math.inf)
    limit = [_number(v) for v in raw] if isinstance(raw, (list, tuple)) else []
    if len(limit) != 2 or None in limit or limit[0] > limit[1]:
        raise ValueError(f"model config field {field!r} must be [min, max], got {raw!r}")
    return limit[0], limit[1]


def _number(v: Any) -> float | None:
    """A JSON number, or transformers' spelling of a non-finite one
    (``{"__float__": "Infinity"}``); None for anything else."""
    if isinstance(v, dict) and set(v) == {"__float__"}:
        v = v["__float__"]
        try:
            return float(v)
        except (TypeError, ValueError):
            return None
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def uses_rope(cfg: dict[str, Any]) -> bool:
    """Whether a hybrid file's attention layers rotate: Granite 4.0-H's do not
    (``position_embedding_type`` "nope" or absent; "rope" turns them on), Bamba's do."""
    if cfg.get("model_type") in ("bamba", "falcon_h1"):
        return True
    kind = cfg.get("position_embedding_type")
    if kind not in (None, "nope", "rope"):
        raise ValueError(f"model config field 'position_embedding_type' must be 'rope' or "
                         f"'nope', got {kind!r}")
    return kind == "rope"
