"""RoPE settings from a HF ``config.json``: base, scaling, and the share of each head
that rotates.

Both layouts are read: transformers 5's ``rope_parameters`` (theta and scaling in one
dict) and older files' ``rope_theta`` plus ``rope_scaling``. Scalings: ``linear``,
``llama3``, ``yarn``, ``longrope`` (Phi-3-128k, Phi-3.5, Phi-4-mini: short and long
per-frequency factors, ``rotary.RotaryEmbedding`` picks per token) and
``freq_factors`` (llama.cpp's divisors, from GGUF files). Anything else is a
``ValueError`` naming the field.
"""

from __future__ import annotations

import math
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "yarn", "longrope", "freq_factors")


def parse_rope(cfg: dict[str, Any], head_dim: int, model_type: str
               ) -> tuple[float, dict[str, Any] | None, int]:
    """``(theta, scaling or None, rotary_dim)`` for a model of head size ``head_dim``."""
    rope = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling")
    if legacy:
        rope = {**legacy, **rope}
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if (isinstance(partial, bool) or not isinstance(partial, (int, float))
            or not 0 < partial <= 1 or int(head_dim * partial) % 2):
        raise ValueError(f"model config field 'partial_rotary_factor' must be in (0, 1] and "
                         f"rotate an even share of head_dim {head_dim}, got {partial!r}")
    rotary_dim = int(head_dim * partial)
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    if model_type == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # transformers' Phi3Config reads both names so
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"model config field 'rope_scaling.rope_type' must be one of "
                         f"{SUPPORTED_ROPE_TYPES}, got {rope_type!r}")
    if rope_type == "default":
        return theta, None, rotary_dim
    drop = ("rope_theta", "type", "partial_rotary_factor")
    scaling = {k: v for k, v in rope.items() if k not in drop}
    scaling["rope_type"] = rope_type
    max_pos = cfg.get("max_position_embeddings") or 2048
    orig = scaling.get("original_max_position_embeddings") or cfg.get(
        "original_max_position_embeddings")
    if rope_type == "longrope":
        _check_longrope(scaling, rotary_dim, orig, max_pos)
        return theta, scaling, rotary_dim
    factor = scaling.get("factor")
    if rope_type == "yarn" and factor is None and orig:
        # DeepSeek-V3 style: the stretch is the served over the pre-trained length
        # (transformers' rule).
        factor = scaling["factor"] = max_pos / orig
    if rope_type == "freq_factors":
        _check_factors(scaling.get("freq_factors"), rotary_dim, "freq_factors")
    elif not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
        raise ValueError(f"model config field 'rope_scaling.factor' must be a positive "
                         f"number, got {factor!r}")
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor"):
            if key not in scaling:
                raise ValueError(f"model config field 'rope_scaling.{key}' is required")
    if rope_type in ("llama3", "yarn") and not scaling.get("original_max_position_embeddings"):
        scaling["original_max_position_embeddings"] = max_pos
    return theta, scaling, rotary_dim


def _check_longrope(scaling: dict[str, Any], rotary_dim: int, orig: Any, max_pos: int) -> None:
    """Fill in what transformers derives (the pre-trained length, the factor, the
    attention factor) and check the per-frequency factors."""
    if not isinstance(orig, int) or orig <= 0:
        raise ValueError("model config field 'original_max_position_embeddings' is required "
                         f"for longrope, got {orig!r}")
    scaling["original_max_position_embeddings"] = orig
    for key in ("short_factor", "long_factor"):
        _check_factors(scaling.get(key), rotary_dim, key)
    factor = scaling.get("factor") or max_pos / orig
    if scaling.get("attention_factor") is None:
        scaling["attention_factor"] = (
            1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig)))


def _check_factors(factors: Any, rotary_dim: int, key: str) -> None:
    ok = isinstance(factors, list) and len(factors) == rotary_dim // 2 and all(
        isinstance(f, (int, float)) and not isinstance(f, bool) and f > 0 for f in factors)
    if not ok:
        raise ValueError(f"model config field 'rope_scaling.{key}' must be "
                         f"{rotary_dim // 2} positive numbers (one per rotary frequency)")
