"""What IBM's Granite decoders need beyond a Llama config, read from ``config.json``.

Granite 3.x (``model_type: granite``: granite-3.0/3.1/3.2/3.3 2B and 8B, dense) and
its mixtures of experts (``granitemoe``, ``granitemoeshared``: 1B-A400M, 3B-A800M)
are Llama-shaped with four scalars, each as transformers' ``GraniteForCausalLM``
applies it:

- ``embedding_multiplier`` scales the token embeddings (12 in the 2B / 8B releases);
- ``attention_multiplier`` replaces ``head_dim ** -0.5`` as the attention scale;
- ``residual_multiplier`` scales each attention and MLP output before its residual
  add (0.22);
- ``logits_scaling`` divides the logits (8 and 16).

The mixtures route Mixtral's way (softmax over the top-k logits) through experts
stacked in one ``input_linear`` (gate rows, then up rows) and ``output_linear`` per
layer; ``granitemoeshared`` adds an always-on SwiGLU expert (``shared_mlp``) beside
them. Parsed once here, so a malformed value names its field at load time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GRANITE_MODEL_TYPES = ("granite", "granitemoe", "granitemoeshared", "granitemoehybrid")


@dataclass(frozen=True)
class GraniteScales:
    """Granite's four scalars (see the module docstring)."""

    embedding: float = 1.0
    attention: float = 1.0
    residual: float = 1.0
    logits: float = 1.0


def granite_from_hf(cfg: dict[str, Any], model_type: str) -> GraniteScales | None:
    """The scalars of a Granite file; None for other models."""
    if model_type not in GRANITE_MODEL_TYPES:
        return None
    fields = {"embedding": "embedding_multiplier", "attention": "attention_multiplier",
              "residual": "residual_multiplier", "logits": "logits_scaling"}
    values = {}
    for attr, key in fields.items():
        v = cfg.get(key, 1.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"model config field {key!r} must be a positive number, "
                             f"got {v!r}")
        values[attr] = float(v)
    return GraniteScales(**values)
