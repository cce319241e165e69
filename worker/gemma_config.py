"""What a Gemma 3 text model needs beyond a Llama config, read from its ``config.json``.

Gemma 3 (``model_type: gemma3_text``, Hugging Face's ``Gemma3ForCausalLM``: the 270M
and 1B releases, and the text half of the larger ones) and Gemma 2 (``gemma2``) are
Llama-shaped decoders with these differences, each as transformers implements it:

- RMSNorm scales by ``1 + weight`` in fp32; four norms a layer (the attention's and the
  MLP's outputs are normalised before their residual add), q/k norms per head;
- the embedding is multiplied by ``sqrt(hidden_size)`` in the weights' dtype;
- attention scales by ``query_pre_attn_scalar ** -0.5``, not ``head_dim ** -0.5``;
- Gemma 3: five layers of six attend through a sliding window with their own RoPE
  base (``rope_local_base_freq``, 10,000), the sixth globally with ``rope_theta`` (and
  ``rope_scaling``, linear x8 on the 4B+ models); Gemma 2: every other layer slides,
  one RoPE base, no q/k norms, and attention scores capped to
  ``attn_logit_softcapping * tanh(s / attn_logit_softcapping)``;
- the MLP gates with tanh-approximated GELU;
- ``final_logit_softcapping`` (null in every Gemma 3 release, 30 in Gemma 2's) caps
  the logits ``cap * tanh(logits / cap)``.

Both config layouts are read: transformers 5's ``rope_parameters`` keyed by layer type,
and the released files' ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling``.
The multimodal releases (``model_type: gemma3``, 4B-27B) are served as their text
decoder: ``text_config`` completed with transformers' ``Gemma3TextConfig`` defaults
(the released files list only the fields that differ), the vision tower's weights
skipped at load (``models.gemma3``), so text prompts get the answers Hugging Face's
``Gemma3ForConditionalGeneration`` gives them; images are not taken.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GEMMA_MODEL_TYPES = ("gemma3_text", "gemma3", "gemma2")
_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")


@dataclass(frozen=True)
class GemmaConfig:
    """Gemma's departures from the Llama decoder (see the module docstring)."""

    query_pre_attn_scalar: float
    local_rope_theta: float
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None


def gemma_from_hf(cfg: dict[str, Any], model_type: str
                  ) -> tuple[dict[str, Any], GemmaConfig | None]:
    """``(cfg, None)`` for other models; for Gemma 3 the config with its global layers'
    RoPE in the Llama fields and its layer types spelt out, plus what else it needs.
    ``ValueError`` names a field we cannot serve."""
    if model_type not in GEMMA_MODEL_TYPES:
        return cfg, None
    if model_type == "gemma3":
        cfg = _text_decoder(cfg)
    cfg = dict(cfg)
    cfg.setdefault("tie_word_embeddings", True)  # Gemma3TextConfig's default
    act = cfg.pop("hidden_activation", None) or cfg.pop("hidden_act", None) or _ACTIVATIONS[0]
    cfg.pop("hidden_act", None)
    if act not in _ACTIVATIONS:
        raise ValueError(f"model config field 'hidden_activation' must be one of "
                         f"{_ACTIVATIONS}, got {act!r}")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("model config field 'use_bidirectional_attention' = true is not "
                         "supported (EmbeddingGemma's bidirectional mask)")
    gemma2 = model_type == "gemma2"
    theta = 10_000.0 if gemma2 else 1_000_000.0  # the config classes' defaults
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:  # one RoPE for every layer (Gemma 2), or the released Gemma 3 files' layout
        full = dict(params) or {**(cfg.get("rope_scaling") or {}),
                                "rope_theta": cfg.get("rope_theta", theta)}
        full.setdefault("rope_theta", theta)
        local = dict(full) if gemma2 else {
            "rope_theta": cfg.get("rope_local_base_freq", 10_000.0)}
    full.setdefault("rope_theta", theta)
    local_type = local.get("rope_type", local.get("type", "default"))
    if local_type != "default":
        raise ValueError("model config field 'rope_parameters.sliding_attention.rope_type' "
                         f"must be 'default', got {local_type!r}")
    cfg["rope_parameters"] = full
    cfg.pop("rope_scaling", None)
    if cfg.get("layer_types") is None:
        pattern = int(cfg.get("sliding_window_pattern", 2 if gemma2 else 6))
        cfg["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                              for i in range(int(cfg.get("num_hidden_layers", 0)))]
    cap, attn_cap = cfg.get("final_logit_softcapping"), cfg.get("attn_logit_softcapping")
    return cfg, GemmaConfig(
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
        local_rope_theta=float(local.get("rope_theta", 10_000.0)),
        final_logit_softcapping=float(cap) if cap else None,
        attn_logit_softcapping=float(attn_cap) if attn_cap else None,
    )


def _text_decoder(cfg: dict[str, Any]) -> dict[str, Any]:
    """A multimodal Gemma 3 config as its text decoder's ``gemma3_text`` config."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ValueError("model config field 'text_config' is required for model_type gemma3")
    from transformers import Gemma3TextConfig

    full = Gemma3TextConfig(**{k: v for k, v in text.items() if k != "model_type"}).to_dict()
    for key in ("eos_token_id", "bos_token_id", "quantization_config", "dtype", "torch_dtype"):
        if cfg.get(key) is not None:
            full[key] = cfg[key]
    return {**full, "model_type": "gemma3_text", "architectures": cfg.get("architectures")}
