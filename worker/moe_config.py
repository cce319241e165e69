"""Mixture-of-experts facts of a checkpoint (Mixtral, Qwen2-MoE, Qwen3-MoE, Qwen3-Next,
DeepSeek-V2/V3, GPT-OSS, Granite MoE, GLM-4.5, Ernie 4.5 MoE, LFM2-MoE, Jamba,
Nemotron 3).

The families differ only in config spellings and in a few choices: whether
the top-k routing weights are renormalised to sum to one (Mixtral always; the
others by ``norm_topk_prob``), whether a shared expert runs beside the routed
ones (Qwen2-MoE's gated by a sigmoid, DeepSeek's plain), and which layers are
sparse (the Qwen models may keep dense MLPs in ``mlp_only_layers`` or off the
``decoder_sparse_step`` rhythm; DeepSeek keeps its first ``first_k_dense_replace``).
DeepSeek also routes differently (``layers.moe_routing``): V2 limits each token to
the ``topk_group`` groups of experts with the best single score, V3 scores by a
sigmoid, picks groups by their two best scores and experts by scores plus a learnt
bias (``e_score_correction_bias``), and both scale the weights by
``routed_scaling_factor``. GPT-OSS adds biases (router, experts) and a clamped
SwiGLU (``layers.moe_gpt_oss``); Granite stacks its experts (``layers.moe_granite``).
Parsed once here, so the model code reads plain fields
and a malformed config names its field at load time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.worker.config_fields import count, non_negative_int

MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3",
                   "gpt_oss", "granitemoe", "granitemoeshared", "granitemoehybrid", "glm4_moe",
                   "ernie4_5_moe", "qwen3_next", "qwen3_5_moe_text", "lfm2_moe", "jamba",
                   "nemotron_h")
DEEPSEEK_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")


@dataclass(frozen=True)
class MoEConfig:
    """Routing and expert shapes; ``sparse_layers`` lists the layers whose MLP is routed.

    ``mixtral_names``: the checkpoint spells a layer's experts Mixtral's way
    (``block_sparse_moe.experts.{e}.w1/w3/w2``), else Qwen's
    (``mlp.experts.{e}.gate_proj/up_proj/down_proj``).

    The rest is DeepSeek's routing (defaults: Mixtral's and Qwen's): ``scoring``
    "softmax" or "sigmoid"; ``num_groups`` groups of experts of which each token may
    use ``topk_group``, ranked by their best score ("max") or the sum of their two
    best ("top2"); ``score_bias``: a per-expert bias added to the scores that choose
    (not to the weights); ``routed_scale`` multiplies the weights, after
    renormalising, unless ``scale_unnormalized_only`` (V2 scales only weights it did
    not renormalise). ``shared_gated``: Qwen2-MoE's sigmoid gate on the shared
    expert, which DeepSeek (``shared_experts``, plural) has not. ``router_fp32``: the
    router's weight and logits stay float32 in any model dtype (DeepSeek's, as
    Hugging Face keeps them).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    shared_intermediate_size: int
    sparse_layers: tuple[int, ...]
    mixtral_names: bool = False
    scoring: str = "softmax"
    num_groups: int = 1
    topk_group: int = 1
    group_rank: str = "max"
    score_bias: bool = False
    routed_scale: float = 1.0
    scale_unnormalized_only: bool = False
    shared_gated: bool = True
    router_fp32: bool = False
    # GPT-OSS: a biased router and experts, SwiGLU as ``(up + 1) * g * sigmoid(alpha g)``
    # with ``g`` capped at ``swiglu_limit`` and ``up`` clamped to +-it.
    gpt_oss: bool = False
    swiglu_alpha: float = 1.0
    swiglu_limit: float = 0.0
    # Ernie 4.5's layout: the routing bias filed as ``moe_statics.e_score_correction_bias``.
    ernie: bool = False
    # Granite's layout: experts stacked in ``block_sparse_moe.input_linear`` /
    # ``output_linear``, the shared expert in the layer's ``shared_mlp``.
    granite: bool = False

    @property
    def grouped(self) -> bool:
        """Whether routing first narrows each token to ``topk_group`` groups."""
        return self.num_groups > 1 and self.topk_group < self.num_groups


def moe_config_from_hf(cfg: dict[str, Any], model_type: str, num_layers: int
                       ) -> MoEConfig | None:
    """The MoE part of a parsed ``config.json``; None for a dense model type.

    Transformers 5 writes Qwen3-MoE's expert count as ``num_local_experts``
    (Mixtral's spelling); checkpoints on disk say ``num_experts``: both count.
    """
    if model_type not in MOE_MODEL_TYPES:
        return None
    if model_type == "granitemoehybrid" and not cfg.get("num_local_experts"):
        return None  # (granite-4.0-h-micro: dense, its shared MLP the only one)
    if model_type == "ernie4_5_moe":
        return _ernie(cfg, num_layers)
    if model_type == "jamba":
        return _jamba(cfg, num_layers)
    if model_type == "nemotron_h":
        return _nemotron(cfg)
    key = "num_local_experts" if model_type == "mixtral" else "num_experts"
    if cfg.get(key) is None:
        key = "num_experts" if key == "num_local_experts" else "num_local_experts"
    if model_type in (*DEEPSEEK_MODEL_TYPES, "glm4_moe"):
        key = "n_routed_experts"
    num_experts = count(cfg, key)
    top_k = count(cfg, "num_experts_per_tok")
    if top_k > num_experts:
        raise ValueError(f"model config field 'num_experts_per_tok' ({top_k}) must be at most "
                         f"the number of experts ({num_experts})")
    if model_type in DEEPSEEK_MODEL_TYPES:
        return _deepseek(cfg, model_type, num_layers, num_experts, top_k)
    if model_type == "glm4_moe":  # GLM-4.5 / 4.6: DeepSeek-V3's routing and shared experts
        return _deepseek(cfg, "deepseek_v3", num_layers, num_experts, top_k)
    if model_type.startswith("granitemoe"):  # Mixtral's routing, a plain shared expert
        shared = non_negative_int(cfg, "shared_intermediate_size") \
            if model_type in ("granitemoeshared", "granitemoehybrid") else 0
        return MoEConfig(num_experts, top_k, count(cfg, "intermediate_size"), True, shared,
                         tuple(range(num_layers)), shared_gated=False, granite=True)
    if model_type == "gpt_oss":
        return MoEConfig(num_experts, top_k, count(cfg, "intermediate_size"), True, 0,
                         tuple(range(num_layers)), gpt_oss=True,
                         swiglu_alpha=_positive(cfg, "swiglu_alpha", 1.702),
                         swiglu_limit=_positive(cfg, "swiglu_limit", 7.0))
    if model_type == "lfm2_moe":  # sigmoid scores, a choosing bias, no groups
        return MoEConfig(num_experts, top_k, count(cfg, "moe_intermediate_size"),
                         bool(cfg.get("norm_topk_prob", True)), 0,
                         tuple(range(non_negative_int(cfg, "num_dense_layers"), num_layers)),
                         scoring="sigmoid", score_bias=bool(cfg.get("use_expert_bias", True)),
                         routed_scale=_positive(cfg, "routed_scaling_factor", 1.0),
                         shared_gated=False)
    if model_type == "mixtral":
        return MoEConfig(num_experts, top_k, count(cfg, "intermediate_size"), True, 0,
                         tuple(range(num_layers)), mixtral_names=True)
    step = count(cfg, "decoder_sparse_step", 1)
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise ValueError(f"model config field 'mlp_only_layers' must be a list of layer "
                         f"indices, got {dense!r}")
    sparse = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    shared = 0
    if model_type in ("qwen2_moe", "qwen3_next", "qwen3_5_moe_text"):
        shared = count(cfg, "shared_expert_intermediate_size")
    renormalize = cfg.get("norm_topk_prob", model_type == "qwen3_next")  # (its default)
    if model_type == "qwen3_5_moe_text":
        renormalize = True  # (its router always does; the config has no such field)
    return MoEConfig(num_experts, top_k, count(cfg, "moe_intermediate_size"),
                     bool(renormalize), shared, sparse)


def _deepseek(cfg: dict[str, Any], model_type: str, num_layers: int, num_experts: int,
              top_k: int) -> MoEConfig:
    """DeepSeek-V2 / V3 routing: V2's ``topk_method`` "greedy" or "group_limited_greedy"
    over softmax scores, V3's sigmoid scores with a bias and groups ranked by their two
    best (its ``topk_method`` "noaux_tc"; Hugging Face's implementation reads none)."""
    first_dense = non_negative_int(cfg, "first_k_dense_replace")
    step = count(cfg, "moe_layer_freq", 1)
    sparse = tuple(i for i in range(num_layers) if i >= first_dense and i % step == 0)
    shared = non_negative_int(cfg, "n_shared_experts")
    width = count(cfg, "moe_intermediate_size")
    v3 = model_type == "deepseek_v3"
    method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    methods = ("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")
    if method not in methods:
        raise ValueError(f"model config field 'topk_method' must be one of {methods} for "
                         f"{model_type}, got {method!r}")
    groups = topk_group = 1
    if v3 or method == "group_limited_greedy":
        groups, topk_group = _groups(cfg, num_experts, top2=v3)
    return MoEConfig(num_experts, top_k, width, bool(cfg.get("norm_topk_prob", False)),
                     width * shared, sparse, scoring="sigmoid" if v3 else "softmax",
                     num_groups=groups, topk_group=topk_group,
                     group_rank="top2" if v3 else "max", score_bias=v3,
                     routed_scale=_positive(cfg, "routed_scaling_factor", 1.0),
                     scale_unnormalized_only=not v3, shared_gated=False, router_fp32=True)


def _groups(cfg: dict[str, Any], num_experts: int, top2: bool) -> tuple[int, int]:
    """``(n_group, topk_group)``: groups that split the experts, of which each token may
    use at most all; ranked by their two best (``top2``), at least two experts each."""
    groups = count(cfg, "n_group", 1)
    topk_group = count(cfg, "topk_group", 1)
    if num_experts % groups or topk_group > groups:
        raise ValueError(f"model config fields 'n_group' ({groups}) and 'topk_group' "
                         f"({topk_group}) must split {num_experts} experts into groups "
                         "and pick at most all of them")
    if top2 and num_experts // groups < 2:
        raise ValueError(f"model config field 'n_group' ({groups}) must leave at least "
                         "two experts a group (groups rank by their two best)")
    return groups, topk_group


def _nemotron(cfg: dict[str, Any]) -> MoEConfig | None:
    """Nemotron 3's routed-expert blocks (``E`` in a Nemotron-H pattern; None without
    any): DeepSeek-V3's routing over ``n_routed_experts`` ungated experts
    (``layers.moe_nemotron``), the shared expert as wide as
    ``moe_shared_expert_intermediate_size``."""
    from pagedserve.worker.nemotron_h_config import block_kinds

    sparse = tuple(i for i, k in enumerate(block_kinds(cfg)) if k == "moe")
    if not sparse:
        return None
    experts, top_k = count(cfg, "n_routed_experts", 8), count(cfg, "num_experts_per_tok", 2)
    if top_k > experts:
        raise ValueError(f"model config field 'num_experts_per_tok' ({top_k}) must be at most "
                         f"'n_routed_experts' ({experts})")
    groups, topk_group = _groups(cfg, experts, top2=True)
    return MoEConfig(
        experts, top_k, count(cfg, "moe_intermediate_size", 7688),
        bool(cfg.get("norm_topk_prob", True)),
        non_negative_int(cfg, "moe_shared_expert_intermediate_size"), sparse,
        scoring="sigmoid", num_groups=groups, topk_group=topk_group, group_rank="top2",
        score_bias=True, routed_scale=_positive(cfg, "routed_scaling_factor", 1.0),
        shared_gated=False, router_fp32=True)


def _positive(cfg: dict[str, Any], key: str, default: float) -> float:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"model config field {key!r} must be a positive number, "
                         f"got {value!r}")
    return float(value)


def _ernie(cfg: dict[str, Any], num_layers: int) -> MoEConfig:
    """Ernie 4.5's MoE (``ernie4_5_moe``): softmax scores, a routing bias on the scores
    that choose (not the weights), the top-k renormalised, shared experts; routed
    layers every ``moe_layer_interval`` from ``moe_layer_start_index`` to
    ``moe_layer_end_index`` (as transformers picks them). The release spells the
    counts ``moe_num_experts`` / ``moe_k`` (transformers 5: ``num_experts`` /
    ``num_experts_per_tok``)."""
    e_key = "moe_num_experts" if "moe_num_experts" in cfg else "num_experts"
    k_key = "moe_k" if "moe_k" in cfg else "num_experts_per_tok"
    num_experts, top_k = count(cfg, e_key), count(cfg, k_key)
    if top_k > num_experts:
        raise ValueError(f"model config field {k_key!r} ({top_k}) must be at most the number "
                         f"of experts ({num_experts})")
    width = count(cfg, "moe_intermediate_size")
    start = non_negative_int(cfg, "moe_layer_start_index")
    end = cfg.get("moe_layer_end_index", num_layers - 1)
    if isinstance(end, bool) or not isinstance(end, int):
        raise ValueError(f"model config field 'moe_layer_end_index' must be an integer, "
                         f"got {end!r}")
    step = count(cfg, "moe_layer_interval", 1)
    sparse = tuple(i for i in range(num_layers) if (i + 1) % step == 0 and start <= i <= end)
    shared = non_negative_int(cfg, "moe_num_shared_experts") * width
    return MoEConfig(num_experts, top_k, width, True, shared, sparse, score_bias=True,
                     shared_gated=False, router_fp32=True, ernie=True)


def _jamba(cfg: dict[str, Any], num_layers: int) -> MoEConfig | None:
    """Jamba's experts: one layer in every ``expert_layer_period`` (at
    ``expert_layer_offset``) routes, softmax top-k, the weights not renormalised; None
    for a file with one expert (every MLP dense)."""
    from pagedserve.worker.mamba1_config import period_layers

    num_experts = count(cfg, "num_experts", 16)
    if num_experts == 1:
        return None
    top_k = count(cfg, "num_experts_per_tok", 2)
    if top_k > num_experts:
        raise ValueError(f"model config field 'num_experts_per_tok' ({top_k}) must be at most "
                         f"the number of experts ({num_experts})")
    sparse = period_layers(cfg, "expert_layer_period", "expert_layer_offset", 2, 1, num_layers)
    return MoEConfig(num_experts, top_k, count(cfg, "intermediate_size"), False, 0, sparse)
