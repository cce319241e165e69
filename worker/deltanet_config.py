"""What Qwen3-Next and Qwen3.5 need beyond a Llama config: their gated DeltaNet
layers' shapes.

Qwen3-Next (``model_type: qwen3_next``: Qwen3-Next-80B-A3B Instruct / Thinking) and
Qwen3.5 (``qwen3_5`` dense, ``qwen3_5_moe``; their files hold a vision encoder
beside the decoder, ``text_config`` its fields; ``qwen3_5_text`` /
``qwen3_5_moe_text`` for the decoder alone) put three gated DeltaNet layers
(``layer_types``: ``linear_attention``) before every attention layer
(``full_attention``; ``full_attention_interval`` in older files). A DeltaNet layer
keeps no KV: each sequence carries the last ``linear_conv_kernel_dim - 1`` inputs of
a causal convolution over q, k and v, and one ``[key dim, value dim]`` matrix per
value head that the gated delta rule rewrites each token
(``layers.gated_deltanet``). Key heads are fewer than value heads (16 and 32 in the
release): each key head serves a run of consecutive value heads, and the projections
are laid out per key head, which is what tensor parallelism splits
(``linear_num_key_heads`` divisible by its size). Qwen3.5's files store the same
projections unfused, q / k / v in one matrix and z, b, a in three (``split_proj``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.worker.config_fields import count

# The decoders' model types (Qwen3.5's multimodal files name theirs in ``text_config``).
DELTANET_MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
QWEN3_5_MULTIMODAL = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
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
    # Qwen3.5: ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``, not
    # Qwen3-Next's per-key-head ``in_proj_qkvz`` / ``in_proj_ba``.
    split_proj: bool = False

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


def qwen3_5_text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A multimodal Qwen3.5 config as its decoder's (``text_config``, the file's own
    token ids, dtype and quantization laid over it); any other config unchanged. The
    vision encoder is not served: such a model answers text (its images are refused
    as a text model's are)."""
    text_type = QWEN3_5_MULTIMODAL.get(cfg.get("model_type"))
    if text_type is None:
        return cfg
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"model config field 'text_config' is required for model_type "
                         f"{cfg['model_type']}")
    out = dict(text)
    for key in ("eos_token_id", "bos_token_id", "quantization_config", "dtype", "torch_dtype",
                "tie_word_embeddings"):
        if cfg.get(key) is not None and out.get(key) is None:
            out[key] = cfg[key]
    return {**out, "model_type": text_type, "architectures": cfg.get("architectures")}


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
        head_v_dim=count(cfg, "linear_value_head_dim", 128), d_conv=d_conv,
        split_proj=cfg.get("model_type") != "qwen3_next")
