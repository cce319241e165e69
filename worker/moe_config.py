"""Mixture-of-experts facts of a checkpoint (Mixtral, Qwen2-MoE, Qwen3-MoE).

The three families differ only in config spellings and in three choices:
whether the top-k routing weights are renormalised to sum to one (Mixtral
always; the Qwen models by ``norm_topk_prob``), whether a gated shared expert
runs beside the routed ones (Qwen2-MoE), and which layers are sparse (the
Qwen models may keep dense MLPs in ``mlp_only_layers`` or off the
``decoder_sparse_step`` rhythm). Parsed once here, so the model code reads
plain fields and a malformed config names its field at load time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")


@dataclass(frozen=True)
class MoEConfig:
    """Routing and expert shapes; ``sparse_layers`` lists the layers whose MLP is routed.

    ``mixtral_names``: the checkpoint spells a layer's experts Mixtral's way
    (``block_sparse_moe.experts.{e}.w1/w3/w2``), else Qwen's
    (``mlp.experts.{e}.gate_proj/up_proj/down_proj``).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    shared_intermediate_size: int
    sparse_layers: tuple[int, ...]
    mixtral_names: bool = False


def _count(cfg: dict[str, Any], name: str, default: Any = None) -> int:
    value = cfg.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"model config field {name!r} must be a positive integer, got {value!r}")
    return value


def moe_config_from_hf(cfg: dict[str, Any], model_type: str, num_layers: int
                       ) -> MoEConfig | None:
    """The MoE part of a parsed ``config.json``; None for a dense model type.

    Transformers 5 writes Qwen3-MoE's expert count as ``num_local_experts``
    (Mixtral's spelling); checkpoints on disk say ``num_experts``: both count.
    """
    if model_type not in MOE_MODEL_TYPES:
        return None
    key = "num_local_experts" if model_type == "mixtral" else "num_experts"
    if cfg.get(key) is None:
        key = "num_experts" if key == "num_local_experts" else "num_local_experts"
    num_experts = _count(cfg, key)
    top_k = _count(cfg, "num_experts_per_tok")
    if top_k > num_experts:
        raise ValueError(f"model config field 'num_experts_per_tok' ({top_k}) must be at most "
                         f"the number of experts ({num_experts})")
    if model_type == "mixtral":
        return MoEConfig(num_experts, top_k, _count(cfg, "intermediate_size"), True, 0,
                         tuple(range(num_layers)), mixtral_names=True)
    step = _count(cfg, "decoder_sparse_step", 1)
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise ValueError(f"model config field 'mlp_only_layers' must be a list of layer "
                         f"indices, got {dense!r}")
    sparse = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    shared = 0
    if model_type == "qwen2_moe":
        shared = _count(cfg, "shared_expert_intermediate_size")
    return MoEConfig(num_experts, top_k, _count(cfg, "moe_intermediate_size"),
                     bool(cfg.get("norm_topk_prob", False)), shared, sparse)
