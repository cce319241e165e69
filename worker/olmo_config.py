"""What AI2's OLMo 2 and OLMo 3 decoders need beyond a Llama config.

Both (``model_type: olmo2`` / ``olmo3``, transformers' ``Olmo2ForCausalLM`` /
``Olmo3ForCausalLM``) are Llama-shaped but normalise after, not before: each layer
adds ``post_attention_layernorm(attention(x))`` and then
``post_feedforward_layernorm(mlp(x))`` to the residual stream, with no input norms,
and q and k are RMS-normalised over their whole projections (every head at once,
``q_norm`` of ``num_heads * head_dim`` weights) before RoPE. OLMo 3 adds sliding
windows (``layer_types``: three sliding layers, then a full one) whose RoPE is its
own: ``rope_parameters`` keyed by layer type in transformers 5, or, in the released
files, ``rope_scaling`` (YaRN for long context) applying to the full layers only.
``olmo_rope`` flattens either layout: the full layers' RoPE into the Llama fields,
the sliding layers' base aside when it differs (their RoPE is unscaled).
"""

from __future__ import annotations

from typing import Any

OLMO_MODEL_TYPES = ("olmo2", "olmo3")
_LAYER_TYPES = ("full_attention", "sliding_attention")


def olmo_rope(cfg: dict[str, Any], model_type: str) -> tuple[dict[str, Any], float | None]:
    """``(cfg, local_theta)``: the config with the full layers' RoPE as its own, and the
    sliding layers' base when they rotate differently (None: one table for all)."""
    if model_type != "olmo3":
        return cfg, None
    cfg = dict(cfg)
    rope = cfg.get("rope_parameters")
    default_theta = float(cfg.get("rope_theta", 500000.0))
    if isinstance(rope, dict) and set(rope) & set(_LAYER_TYPES):
        full = dict(rope.get("full_attention") or {"rope_type": "default"})
        local = dict(rope.get("sliding_attention") or {"rope_type": "default"})
        full.setdefault("rope_theta", default_theta)
        local.setdefault("rope_theta", default_theta)
    else:  # the released layout: rope_theta for both, rope_scaling for the full layers
        scaling = cfg.pop("rope_scaling", None) or {}
        full = {"rope_theta": default_theta, **(rope or {}), **scaling}
        local = {"rope_type": "default", "rope_theta": full["rope_theta"]}
    if local.get("rope_type", "default") != "default":
        raise ValueError("model config field 'rope_parameters.sliding_attention' must be "
                         f"default RoPE (the full layers take the scaling), got {local!r}")
    cfg["rope_parameters"] = full
    cfg.pop("rope_theta", None)
    same = full.get("rope_type", "default") == "default" and \
        float(full["rope_theta"]) == float(local["rope_theta"])
    return cfg, None if same else float(local["rope_theta"])
