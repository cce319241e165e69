"""ModernBERT (``model_type: modernbert``): what its ``config.json`` says.

ModernBERT is the encoder behind the recent long-context embedders and rerankers
(modernbert-embed, gte-modernbert, the gte and mxbai ModernBERT rerankers). Unlike
BERT it is pre-norm, has no position or token-type tables (RoPE instead), a
GeGLU MLP, no biases by default, and mixes global layers with local ones that see
``local_attention / 2`` tokens each side (every third layer is global).

Both config layouts are read: transformers 5's ``layer_types`` and
``rope_parameters`` keyed by layer type, and the released files'
``global_attn_every_n_layers`` / ``global_rope_theta`` / ``local_rope_theta``. Only
plain RoPE is served; anything else is a ``ValueError`` naming the field.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedserve.worker.config_fields import positive_int, require
from pagedserve.worker.encoder_config import (
    EncoderConfig,
    encoder_classifier,
    gelu_approximate,
)

if TYPE_CHECKING:
    from pagedserve.worker.config import ModelConfig

FULL, LOCAL = "full_attention", "sliding_attention"


def _flag(cfg: dict[str, Any], name: str, default: bool) -> bool:
    value = cfg.get(name, default)
    if not isinstance(value, bool):
        raise ValueError(f"model config field {name!r} must be true or false, got {value!r}")
    return value


def _theta(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"model config field {field!r} must be a positive number, "
                         f"got {value!r}")
    return float(value)


def layer_types(cfg: dict[str, Any], num_layers: int) -> list[str]:
    """Each layer's attention: ``layer_types`` as written, else every
    ``global_attn_every_n_layers``-th layer (from the first) global."""
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers or \
                any(t not in (FULL, LOCAL) for t in types):
            raise ValueError(f"model config field 'layer_types' must list {FULL!r} or "
                             f"{LOCAL!r} for each of the {num_layers} layers, got {types!r}")
        return types
    every = positive_int("global_attn_every_n_layers", cfg.get("global_attn_every_n_layers", 3))
    return [LOCAL if i % every else FULL for i in range(num_layers)]


def rope_thetas(cfg: dict[str, Any]) -> tuple[float, float]:
    """(global, local) RoPE bases; a local base of null is the global one, as
    transformers reads it."""
    params = cfg.get("rope_parameters") or {}
    legacy = cfg.get("rope_scaling")
    if legacy:
        raise ValueError(f"model config field 'rope_scaling' is not served for ModernBERT "
                         f"(plain RoPE only), got {legacy!r}")
    if FULL in params or LOCAL in params:
        full, local = params.get(FULL) or {}, params.get(LOCAL) or {}
        for name, p in ((FULL, full), (LOCAL, local)):
            if p.get("rope_type", "default") != "default":
                raise ValueError(f"model config field 'rope_parameters.{name}.rope_type' "
                                 f"must be 'default', got {p.get('rope_type')!r}")
        glob = _theta(full.get("rope_theta", 160_000.0), "rope_parameters.full_attention")
        loc = local.get("rope_theta", 10_000.0)
        return glob, _theta(loc, "rope_parameters.sliding_attention")
    glob = _theta(cfg.get("global_rope_theta", 160_000.0), "global_rope_theta")
    loc = cfg.get("local_rope_theta", 10_000.0)
    return glob, glob if loc is None else _theta(loc, "local_rope_theta")


def modernbert_model_config(cls: type[ModelConfig], cfg: dict[str, Any]) -> ModelConfig:
    """``ModelConfig`` of a ModernBERT ``config.json`` (base model or classifier)."""
    classifier = encoder_classifier(cfg)
    hidden = positive_int("hidden_size", require(cfg, "hidden_size"))
    heads = positive_int("num_attention_heads", require(cfg, "num_attention_heads"))
    if hidden % heads or (hidden // heads) % 2:
        raise ValueError(f"model config field 'num_attention_heads' ({heads}) must divide "
                         f"hidden_size ({hidden}) into heads of an even size")
    layers = positive_int("num_hidden_layers", require(cfg, "num_hidden_layers"))
    window = positive_int("local_attention", cfg.get("local_attention", 128))
    if window % 2:
        raise ValueError(f"model config field 'local_attention' must be even (a window "
                         f"split evenly around each token), got {window}")
    types = layer_types(cfg, layers)
    glob, local = rope_thetas(cfg)
    pooling = cfg.get("classifier_pooling", "cls")
    if pooling not in ("cls", "mean"):
        raise ValueError(f"model config field 'classifier_pooling' must be 'cls' or 'mean', "
                         f"got {pooling!r}")
    eps = cfg.get("norm_eps", 1e-5)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps <= 0:
        raise ValueError(f"model config field 'norm_eps' must be a positive number, "
                         f"got {eps!r}")
    positions = positive_int("max_position_embeddings",
                             cfg.get("max_position_embeddings", 8192))
    attention_bias = _flag(cfg, "attention_bias", False)
    encoder = EncoderConfig(
        family="modernbert", type_vocab_size=1, position_table=0, position_offset=0,
        layer_norm_eps=float(eps),
        gelu_approximate=gelu_approximate(cfg, "hidden_activation", "gelu"),
        norm_bias=_flag(cfg, "norm_bias", False), mlp_bias=_flag(cfg, "mlp_bias", False),
        layer_windows=tuple(window // 2 if t == LOCAL else 0 for t in types),
        local_rope_theta=local, head_pooling=pooling,
        head_gelu_approximate=gelu_approximate(cfg, "classifier_activation", "gelu"),
        head_bias=_flag(cfg, "classifier_bias", False))
    eos = cfg.get("eos_token_id")
    return cls(
        model_type="modernbert", num_layers=layers, hidden_size=hidden,
        intermediate_size=positive_int("intermediate_size", require(cfg, "intermediate_size")),
        num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
        vocab_size=positive_int("vocab_size", require(cfg, "vocab_size")),
        rope_theta=glob, rope_scaling=None, rms_norm_eps=float(eps),
        tie_word_embeddings=False, qkv_bias=attention_bias, o_bias=attention_bias,
        qk_norm=False, max_position_embeddings=positions, sliding_window=None,
        eos_token_ids=() if eos is None else (tuple(eos) if isinstance(eos, list)
                                              else (int(eos),)),
        bos_token_id=cfg.get("bos_token_id"),
        dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
        embedding_only=classifier is None, classifier=classifier, encoder=encoder)
