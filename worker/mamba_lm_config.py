"""Attention-free Mamba language models, read from ``config.json``: Mamba-1
(``mamba``: state-spaces' mamba-130m to 2.8b ``-hf``; ``falcon_mamba``: TII's
Falcon-Mamba 7B, which RMS-normalises the step size, B and C without weights) and
Mamba-2 (``mamba2``: Mistral's Mamba-Codestral 7B, state-spaces' mamba2-130m to 2.7b).

Every layer is a norm and a mixer added to the residual stream (Nemotron-H's block
with only ``M`` blocks: ``models.mamba_lm``). No layer attends, so the KV pool holds
nothing: its blocks only number each sequence's tokens for the scheduler, which
places prefix-cache snapshots at block boundaries (``scheduler.kv_groups``). The
files carry no attention or MLP fields; ``mamba_lm_config`` gives ``ModelConfig``
placeholders for them (one head, an MLP as wide as the mixer: neither is built) and
the mixers' config.
"""

from __future__ import annotations

import math
from typing import Any

from pagedserve.worker.config_fields import count, positive_int
from pagedserve.worker.mamba1_config import Mamba1Config
from pagedserve.worker.mamba_config import MambaConfig, time_step_limit

MAMBA_LM_MODEL_TYPES = ("mamba", "falcon_mamba", "mamba2")
# A context length for files that name none (a recurrent state has no limit of its own;
# ``max_model_len`` raises it): what the scheduler sizes block tables by.
DEFAULT_MAX_LEN = 32768


def mamba_lm_config(cfg: dict[str, Any]) -> tuple[dict[str, Any], Mamba1Config | MambaConfig]:
    """The Llama fields of an attention-free Mamba file and its mixers' config; a
    ``ValueError`` names a malformed field."""
    model_type = cfg["model_type"]
    num_layers = count(cfg, "num_hidden_layers", 32)
    hidden = positive_int("hidden_size", cfg.get("hidden_size"))
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"model config field 'hidden_act' must be 'silu', got "
                         f"{cfg.get('hidden_act')!r}")
    every = tuple(range(num_layers))
    width = count(cfg, "expand", 2) * hidden
    d_conv = count(cfg, "conv_kernel", 4)
    if d_conv < 2:
        raise ValueError(f"model config field 'conv_kernel' must be >= 2, got {d_conv}")
    conv_bias, proj_bias = bool(cfg.get("use_conv_bias", True)), bool(cfg.get("use_bias",
                                                                               False))
    mixer: Mamba1Config | MambaConfig
    if model_type == "mamba2":
        heads, head_dim = count(cfg, "num_heads", 128), count(cfg, "head_dim", 64)
        if heads * head_dim != width:
            raise ValueError(f"model config fields 'num_heads' ({heads}) x 'head_dim' "
                             f"({head_dim}) must equal 'expand' x 'hidden_size' ({width})")
        groups = count(cfg, "n_groups", 8)
        if heads % groups:
            raise ValueError(f"model config field 'n_groups' ({groups}) must divide "
                             f"'num_heads' ({heads})")
        low, high = time_step_limit(cfg.get("time_step_limit"), "time_step_limit")
        mixer = MambaConfig(
            layers=every, attention=(), num_heads=heads, head_dim=head_dim,
            d_state=count(cfg, "state_size", 128), num_groups=groups, d_conv=d_conv,
            chunk_size=count(cfg, "chunk_size", 256), conv_bias=conv_bias,
            proj_bias=proj_bias, dt_min=low, dt_max=high)
    else:  # (the mixer's width: the file's ``intermediate_size``, as transformers reads it)
        width = positive_int("intermediate_size", cfg.get("intermediate_size") or width)
        rank = cfg.get("time_step_rank", "auto")
        rank = positive_int("time_step_rank", math.ceil(hidden / 16) if rank == "auto" else rank)
        mixer = Mamba1Config(
            layers=every, attention=(), intermediate=width,
            d_state=count(cfg, "state_size", 16), d_conv=d_conv, dt_rank=rank,
            conv_bias=conv_bias, proj_bias=proj_bias,
            inner_norms="plain" if model_type == "falcon_mamba" else "none",
            norm_eps=float(cfg.get("mixer_rms_eps", 1e-6)))
    llama = {**cfg, "num_hidden_layers": num_layers,
             "rms_norm_eps": cfg.get("layer_norm_epsilon", 1e-5),
             "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": None,
             "intermediate_size": width, "attention_bias": False,
             "max_position_embeddings": cfg.get("max_position_embeddings", DEFAULT_MAX_LEN),
             "tie_word_embeddings": cfg.get("tie_word_embeddings", model_type != "mamba2")}
    return llama, mixer
