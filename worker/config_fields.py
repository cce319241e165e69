"""Reading a Hugging Face ``config.json``'s fields with errors that name the field:
shared by the model, mixture-of-experts and latent-attention parsers."""

from __future__ import annotations

from typing import Any


def require(cfg: dict[str, Any], name: str) -> Any:
    """``cfg[name]``, which must be there and not null."""
    if name not in cfg or cfg[name] is None:
        raise ValueError(f"model config is missing required field {name!r}")
    return cfg[name]


def positive_int(name: str, value: Any) -> int:
    """``value`` (field ``name``'s), which must be a positive integer."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"model config field {name!r} must be a positive integer, got {value!r}")
    return value


def count(cfg: dict[str, Any], name: str, default: Any = None) -> int:
    """Field ``name`` (``default`` when absent) as a positive integer."""
    return positive_int(name, cfg.get(name, default))


def non_negative_int(cfg: dict[str, Any], name: str) -> int:
    """Field ``name`` as an integer >= 0 (absent or null: 0)."""
    value = cfg.get(name) or 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"model config field {name!r} must be a non-negative integer, "
                         f"got {value!r}")
    return value


def matryoshka(cfg: dict[str, Any]) -> tuple[int, ...] | bool | None:
    """What the file says of cutting its embeddings (``dimensions``), in vLLM's fields:
    ``matryoshka_dimensions`` lists the widths it was trained for (jina-embeddings-v3
    writes it), ``is_matryoshka`` says whether any cut is meant (``hf_overrides`` may
    set either). None: the file says nothing."""
    dims = cfg.get("matryoshka_dimensions")
    if dims is not None:
        if not isinstance(dims, list) or not dims:
            raise ValueError("model config field 'matryoshka_dimensions' must be a "
                             f"non-empty list of positive integers, got {dims!r}")
        return tuple(positive_int("matryoshka_dimensions", d) for d in dims)
    flag = cfg.get("is_matryoshka")
    if flag is not None and not isinstance(flag, bool):
        raise ValueError(f"model config field 'is_matryoshka' must be true or false, "
                         f"got {flag!r}")
    return flag


def nope_layers(cfg: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """SmolLM3's ``no_rope_layers`` (one 0 / 1 a layer, 1 where RoPE applies) as the
    indices of the layers without RoPE; absent: every fourth (transformers' default)."""
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = cfg.get("no_rope_layer_interval", 4)
        flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if (not isinstance(flags, list) or len(flags) != num_layers
            or any(f not in (0, 1) or isinstance(f, bool) for f in flags)):
        raise ValueError(f"model config field 'no_rope_layers' must list 0 or 1 for each of "
                         f"{num_layers} layers, got {flags!r}")
    return tuple(i for i, f in enumerate(flags) if f == 0)
