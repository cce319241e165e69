"""Which decoder layers attend through a sliding window, read from a HF ``config.json``.

The rules are the ones Hugging Face's modelling code applies (transformers 5), so a
checkpoint gets the same mask here as under ``generate``:

- an explicit ``layer_types`` list wins: ``"sliding_attention"`` layers use
  ``sliding_window``, the rest attend to everything;
- Qwen2 / Qwen3 only slide with ``use_sliding_window`` (SmolLM3's ``layer_types`` too),
  and then only layers from ``max_window_layers`` on; Qwen2-MoE then slides its even
  layers below ``max_window_layers``; Qwen3-MoE slides every layer;
- Mistral and Mixtral slide every layer whenever ``sliding_window`` is set (Mistral
  v0.1's 4096; later Mistral releases write ``null``).
"""

from __future__ import annotations

from typing import Any

SLIDING = "sliding_attention"


def sliding_window_layers(cfg: dict[str, Any], model_type: str, num_layers: int
                          ) -> tuple[int | None, tuple[int, ...]]:
    """``(window, layers)``: the window in tokens (a query's own key and the
    ``window - 1`` before it) and the indices of the layers that use it, or
    ``(None, ())`` for full attention everywhere. ``ValueError`` names the field
    when the two disagree or a value is malformed."""
    window = cfg.get("sliding_window")
    if window in (None, 0, False):
        window = None
    elif isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"model config field 'sliding_window' must be a positive int or "
                         f"null, got {window!r}")
    use = bool(cfg.get("use_sliding_window", False))
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers:
            raise ValueError(f"model config field 'layer_types' must list {num_layers} "
                             f"layers, got {types!r}")
        layers = tuple(i for i, t in enumerate(types) if t == SLIDING)
        if (model_type.startswith("qwen") or model_type == "smollm3") and not use:
            layers = ()
        if layers and window is None:
            raise ValueError("model config field 'layer_types' names sliding_attention "
                             "layers but 'sliding_window' is not set")
        return (window, layers) if layers else (None, ())
    if window is None:
        return None, ()
    if model_type.startswith("qwen"):
        if not use:
            return None, ()
        first = int(cfg.get("max_window_layers", 28))
        if model_type == "qwen2_moe":
            layers = tuple(i for i in range(min(first, num_layers)) if i % 2 == 0)
        elif model_type == "qwen3_moe":
            layers = tuple(range(num_layers))
        else:
            layers = tuple(range(first, num_layers))
    else:
        layers = tuple(range(num_layers))
    return (window, layers) if layers else (None, ())
