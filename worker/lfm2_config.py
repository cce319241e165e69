"""What Liquid AI's LFM2 needs beyond a Llama config, read from ``config.json``.

LFM2 (``model_type: lfm2``: LFM2-350M / 700M / 1.2B / 2.6B, LFM2.5; ``lfm2_moe``:
LFM2-8B-A1B, routed experts after its first ``num_dense_layers``) puts a few
attention layers (``full_attention`` in ``layer_types``; ``full_attn_idxs`` in the
first files) among gated short-convolution layers (``conv``): ``B, C, x =
in_proj(h)``, a depthwise causal convolution of ``conv_L_cache`` taps over ``B *
x``, times ``C``, then ``out_proj`` (``layers.short_conv``). A conv layer keeps no
KV; each sequence carries its last ``conv_L_cache - 1`` inputs, in the same slots
Mamba layers use (``worker.mamba_state``). The fields are spelt their own way
(``norm_eps``, ``tie_embedding``, ``block_ff_dim``) and the MLP's width is adjusted
as the model builds it (``block_auto_adjust_ff_dim``); ``lfm2_config`` turns the file
into the Llama fields ``ModelConfig`` reads and the layers' ``ShortConvConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.worker.config_fields import count, positive_int

_KINDS = {"conv": "conv", "full_attention": "attention", "attention": "attention"}


@dataclass(frozen=True)
class ShortConvConfig:
    """The conv layers (every one alike: ``hidden`` channels, ``d_conv`` taps) and the
    attention layers; the fields the engine reads of a ``MambaConfig``."""

    layers: tuple[int, ...]
    attention: tuple[int, ...]
    hidden: int
    d_conv: int
    bias: bool

    def state_bytes(self, conv_elem: int, tp: int = 1) -> int:
        """Bytes of one sequence's state on one of ``tp`` ranks: every conv layer's last
        ``d_conv - 1`` inputs (``conv_elem`` bytes a number)."""
        return len(self.layers) * self.hidden * (self.d_conv - 1) * conv_elem // tp


def _ff_dim(cfg: dict[str, Any]) -> int:
    """The MLP's width as ``Lfm2MLP`` builds it from the file's fields (LFM2-MoE's
    dense layers take ``intermediate_size`` as it is)."""
    width = positive_int("intermediate_size", cfg.get("block_ff_dim",
                                                      cfg.get("intermediate_size", 12288)))
    if cfg.get("model_type") == "lfm2_moe" or not cfg.get("block_auto_adjust_ff_dim", True):
        return width
    width = int(2 * width / 3)
    multiplier = cfg.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is not None:
        width = int(multiplier * width)
        step = count(cfg, "block_multiple_of", 256)
        width = step * ((width + step - 1) // step)
    return width


def lfm2_config(cfg: dict[str, Any]) -> tuple[dict[str, Any], ShortConvConfig]:
    """The Llama fields of an LFM2 file and its conv layers' config; a ``ValueError``
    names a malformed field."""
    num_layers = count(cfg, "num_hidden_layers", 32)
    kinds = cfg.get("layer_types")
    if kinds is None:
        full = cfg.get("full_attn_idxs")
        full = range(num_layers) if full is None else full
        kinds = ["full_attention" if i in full else "conv" for i in range(num_layers)]
    if (not isinstance(kinds, list) or len(kinds) != num_layers
            or any(k not in _KINDS for k in kinds)):
        raise ValueError(f"model config field 'layer_types' must name each of {num_layers} "
                         f"layers 'conv' or 'full_attention', got {kinds!r}")
    d_conv = count(cfg, "conv_L_cache", 3)
    if d_conv < 2:
        raise ValueError(f"model config field 'conv_L_cache' must be >= 2, got {d_conv}")
    hidden = positive_int("hidden_size", cfg.get("hidden_size", 2560))
    llama = {**cfg, "intermediate_size": _ff_dim(cfg), "hidden_size": hidden,
             "num_hidden_layers": num_layers,
             "rms_norm_eps": cfg.get("norm_eps", 1e-5),
             "tie_word_embeddings": cfg.get("tie_embedding",
                                            cfg.get("tie_word_embeddings", True)),
             "attention_bias": False}
    conv = ShortConvConfig(
        layers=tuple(i for i, k in enumerate(kinds) if _KINDS[k] == "conv"),
        attention=tuple(i for i, k in enumerate(kinds) if _KINDS[k] == "attention"),
        hidden=hidden, d_conv=d_conv, bias=bool(cfg.get("conv_bias", False)))
    return llama, conv
