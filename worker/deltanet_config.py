"""What Qwen3-Next needs beyond a Llama config: its gated DeltaNet layers' shapes.

Qwen3-Next (``model_type: qwen3_next``: Qwen3-Next-80B-A3B Instruct / Thinking)
puts three gated DeltaNet layers (``layer_types``: ``linear_attention``) before
every attention layer (``full_attention``; ``full_attention_interval`` in older
files). A DeltaNet layer keeps no KV: each sequence carries the last
``linear_conv_kernel_dim - 1`` inputs of a causal convolution over q, k and v, and
one ``[key dim, value dim]`` matrix per value head that the gated delta rule
rewrites each token (``layers.gated_deltanet``). Key heads are fewer than value
heads (16 and 32 in the release): each key head serves a run of consecutive value
heads, and the projections are laid out per key head, which is what tensor
parallelism splits (``linear_num_key_heads`` divisible by its size).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.worker.config_fields import count

DELTANET_MODEL_TYPES = ("qwen3_next",)
_KINDS = {"linear_attention": "linear", "full_attention": "attention"}


@dataclass(frozen=True)
class DeltaNetConfig:
    """A gated DeltaNet mixer's shapes (every such layer's alike) and which layers have
    one; the same fields the engine reads of a ``MambaConfig`` (``layers``,
    ``attention``, ``state_bytes``)."""

    layers: tuple[int, ...]
    attention: tuple[int, ...]
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    d_conv: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels the convolution runs over: q, k (``key_dim`` each) and v."""
        return 2 * self.key_dim + self.value_dim

    @property
    def v_per_k(self) -> int:
        return self.num_v_heads // self.num_k_heads

    def state_bytes(self, conv_elem: int, tp: int = 1) -> int:
        """Bytes of one sequence's state on one of ``tp`` ranks, every DeltaNet layer:
        the convolution's last inputs (``conv_elem`` bytes a number) and the fp32
        matrices."""
        conv = self.conv_dim * (self.d_conv - 1) * conv_elem
        matrices = self.num_v_heads * self.head_k_dim * self.head_v_dim * 4
        return len(self.layers) * (conv + matrices) // tp


def deltanet_config_from_hf(cfg: dict[str, Any], num_layers: int) -> DeltaNetConfig:
    """The DeltaNet part of a Qwen3-Next ``config.json`` (transformers' defaults for
    absent fields); a ``ValueError`` names a malformed one."""
    kinds = cfg.get("layer_types")
    if kinds is None:
        every = count(cfg, "full_attention_interval", 4)
        kinds = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                 for i in range(num_layers)]
    if (not isinstance(kinds, list) or len(kinds) != num_layers
            or any(k not in _KINDS for k in kinds)):
        raise ValueError(f"model config field 'layer_types' must name each of {num_layers} "
                         f"layers 'linear_attention' or 'full_attention', got {kinds!r}")
    k_heads = count(cfg, "linear_num_key_heads", 16)
    v_heads = count(cfg, "linear_num_value_heads", 32)
    if v_heads % k_heads:
        raise ValueError(f"model config field 'linear_num_key_heads' ({k_heads}) must divide "
                         f"'linear_num_value_heads' ({v_heads})")
    d_conv = count(cfg, "linear_conv_kernel_dim", 4)
    if d_conv < 2:
        raise ValueError(f"model config field 'linear_conv_kernel_dim' must be >= 2, got "
                         f"{d_conv}")
    return DeltaNetConfig(
        layers=tuple(i for i, k in enumerate(kinds) if _KINDS[k] == "linear"),
        attention=tuple(i for i, k in enumerate(kinds) if _KINDS[k] == "attention"),
        num_k_heads=k_heads, num_v_heads=v_heads,
        head_k_dim=count(cfg, "linear_key_head_dim", 128),
        head_v_dim=count(cfg, "linear_value_head_dim", 128), d_conv=d_conv)
