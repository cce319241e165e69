"""What NVIDIA's Nemotron-H needs beyond a Llama config, read from ``config.json``.

Nemotron-H (``model_type: nemotron_h``: Nemotron-H 8B / 47B / 56B, Nemotron Nano 2
9B / 12B) stacks single-mixer blocks: each layer is a norm and one of a Mamba-2
mixer (``M`` in ``hybrid_override_pattern``), attention without positional
rotation (``*``) or a squared-ReLU MLP (``-``); transformers 5 writes the same as
``layer_types`` (``linear_attention``, ``full_attention``, ``mlp``). The mixer's
fields have their own names here (``mamba_num_heads``, ``ssm_state_size``,
``n_groups``...), and its width is ``mamba_num_heads * mamba_head_dim`` (Nano 2's
10,240 is not ``expand * hidden``). Routed-expert blocks (``E``, ``moe``: Nemotron 3)
route to squared-ReLU experts beside a shared one (``moe_config``,
``layers.moe_nemotron``); experts behind a latent projection (``moe_latent_size``)
are refused by name. ``nemotron_h_config`` turns the file into the Llama fields
``ModelConfig`` reads and the ``MambaConfig`` of its mixers.
"""

from __future__ import annotations

from typing import Any

from pagedserve.worker.config_fields import count, positive_int
from pagedserve.worker.mamba_config import MambaConfig, time_step_limit

_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
_KINDS = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention",
          "attention": "attention", "mlp": "mlp", "moe": "moe"}


def block_kinds(cfg: dict[str, Any]) -> list[str]:
    """Each layer's kind, from ``hybrid_override_pattern`` or ``layer_types``."""
    pattern = cfg.get("hybrid_override_pattern")
    if pattern is not None:
        if not isinstance(pattern, str) or not pattern or set(pattern) - set(_PATTERN):
            raise ValueError(f"model config field 'hybrid_override_pattern' must be a string "
                             f"of M, *, - and E, got {pattern!r}")
        kinds = [_PATTERN[ch] for ch in pattern]
    else:
        types = cfg.get("layer_types") or cfg.get("layers_block_type")
        if not isinstance(types, list) or not types or any(t not in _KINDS for t in types):
            raise ValueError(f"model config field 'layer_types' must list each layer's kind "
                             f"({sorted(_KINDS)}), got {types!r}")
        kinds = [_KINDS[t] for t in types]
    if "moe" in kinds and cfg.get("moe_latent_size") is not None:
        raise ValueError("model config field 'moe_latent_size': experts behind a latent "
                         "projection are not supported")
    return kinds


def nemotron_h_config(cfg: dict[str, Any]) -> tuple[dict[str, Any], MambaConfig]:
    """The Llama fields of a Nemotron-H file (its layer count from the pattern, its norm
    epsilon, unbiased attention as transformers builds it) and its mixers' config."""
    kinds = block_kinds(cfg)
    if cfg.get("mlp_hidden_act", "relu2") != "relu2":
        raise ValueError(f"model config field 'mlp_hidden_act' must be 'relu2', got "
                         f"{cfg.get('mlp_hidden_act')!r}")
    if cfg.get("mamba_hidden_act", "silu") != "silu":
        raise ValueError(f"model config field 'mamba_hidden_act' must be 'silu', got "
                         f"{cfg.get('mamba_hidden_act')!r}")
    heads = count(cfg, "mamba_num_heads", 128)
    groups = count(cfg, "n_groups", cfg.get("mamba_n_groups", 8))
    if heads % groups:
        raise ValueError(f"model config field 'n_groups' ({groups}) must divide "
                         f"'mamba_num_heads' ({heads})")
    limit = time_step_limit(cfg.get("time_step_limit", cfg.get("mamba_dt_limit")),
                            "time_step_limit")
    mamba = MambaConfig(
        layers=tuple(i for i, k in enumerate(kinds) if k == "mamba"),
        attention=tuple(i for i, k in enumerate(kinds) if k == "attention"),
        num_heads=heads, head_dim=positive_int("mamba_head_dim", cfg.get("mamba_head_dim", 64)),
        d_state=count(cfg, "ssm_state_size", 128), num_groups=groups,
        d_conv=count(cfg, "conv_kernel", cfg.get("mamba_d_conv", 4)),
        chunk_size=count(cfg, "chunk_size", cfg.get("mamba_chunk_size", 128)),
        conv_bias=bool(cfg.get("use_conv_bias", cfg.get("mamba_conv_bias", True))),
        proj_bias=bool(cfg.get("use_bias", False)), dt_min=limit[0], dt_max=limit[1])
    llama = {**cfg, "num_hidden_layers": len(kinds),
             "rms_norm_eps": cfg.get("layer_norm_epsilon", 1e-5),
             "attention_bias": False, "hidden_act": "silu"}  # (the MLP's: checked above)
    return llama, mamba

