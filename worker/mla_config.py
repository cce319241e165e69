"""Multi-head latent attention facts of a checkpoint (DeepSeek-V2, V2-Lite, V3, R1).

MLA caches, per token and layer, one compressed vector (``kv_lora_rank`` wide,
512 in the releases) and one key part that RoPE turns (``qk_rope_head_dim``,
64), shared by every head: 576 numbers where the same model with plain
multi-head attention would cache ``2 * 128 * 192``. The paged pool holds that
vector as the single "KV head" of the cache (``head_dim`` = 576, one KV head),
and ``models.deepseek`` attends over it directly. Parsed once here so a
malformed config names its field at load time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pagedserve.worker.config_fields import count, non_negative_int

MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")


@dataclass(frozen=True)
class MLAConfig:
    """Shapes of one MLA layer. ``q_lora_rank`` None: the query is one projection
    (V2-Lite), else a low-rank pair with an RMSNorm between (V2, V3).
    ``rope_interleave``: the rotary dims come in pairs ``(x0, x1), (x2, x3)...``
    (DeepSeek's own layout; the loader reorders the weights into halves).
    ``softmax_scale``: ``qk_head_dim ** -0.5``, times YaRN's ``mscale_all_dim``
    factor squared where the RoPE is YaRN."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    softmax_scale: float
    # DeepSeek-V3's multi-token-prediction layers after the decoder's
    # (``num_nextn_predict_layers``; ``models.mtp`` drafts with the first).
    mtp_layers: int = 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Numbers cached per token and layer: the latent vector and the rotated key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def yarn_mscale(scale: float, mscale: float) -> float:
    """YaRN's magnitude correction for a context stretched ``scale`` times."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_config_from_hf(cfg: dict[str, Any], model_type: str,
                       rope_scaling: dict[str, Any] | None) -> MLAConfig | None:
    """The MLA part of a parsed ``config.json`` (None for other model types);
    ``rope_scaling`` as ``rope_config.parse_rope`` returned it."""
    if model_type not in MLA_MODEL_TYPES:
        return None
    if cfg.get("attention_bias"):
        raise ValueError("model config field 'attention_bias' = true is not supported for "
                         f"{model_type} (no release has one)")
    nope, rope = count(cfg, "qk_nope_head_dim"), count(cfg, "qk_rope_head_dim")
    scale = (nope + rope) ** -0.5
    if rope_scaling and rope_scaling.get("rope_type") == "yarn" \
            and rope_scaling.get("mscale_all_dim"):
        m = yarn_mscale(float(rope_scaling["factor"]), float(rope_scaling["mscale_all_dim"]))
        scale *= m * m
    # V2's reference code always interleaves (complex multiplication); V3 says so.
    interleave = bool(cfg.get("rope_interleave", True)) if model_type == "deepseek_v3" \
        else True
    kv_rank, v_dim = count(cfg, "kv_lora_rank"), count(cfg, "v_head_dim")
    q_rank = None if cfg.get("q_lora_rank") is None else count(cfg, "q_lora_rank")
    return MLAConfig(q_lora_rank=q_rank,
                     kv_lora_rank=kv_rank, qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                     v_head_dim=v_dim, rope_interleave=interleave, softmax_scale=scale,
                     mtp_layers=_mtp_layers(cfg, model_type))


def _mtp_layers(cfg: dict[str, Any], model_type: str) -> int:
    return non_negative_int(cfg, "num_nextn_predict_layers") if model_type == "deepseek_v3" \
        else 0
