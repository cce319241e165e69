"""Mixture-of-experts GGUF files: llama.cpp's stacked expert tensors and the config
keys transformers' GGUF mapping drops.

llama.cpp stores a layer's experts as one tensor per matrix kind
(``ffn_gate_exps [E, I, H]``, ``ffn_up_exps``, ``ffn_down_exps [E, H, I]``);
they are split here into the per-expert names an HF checkpoint has. Mixtral
files say ``general.architecture = llama`` and differ from a Llama only by
``llama.expert_count``; Qwen's are ``qwen2moe`` / ``qwen3moe``. Whether the
top-k routing weights are renormalised is not a GGUF key but fixed per
architecture in llama.cpp, and the expert widths (``expert_feed_forward_length``,
``expert_shared_feed_forward_length``) are keys transformers does not map:
both are written into the converted config here, so the model is the one
llama.cpp runs.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# llama.cpp architecture -> (HF model_type, top-k weights renormalised as llama.cpp does).
MOE_ARCHS: dict[str, tuple[str, bool]] = {
    "llama": ("mixtral", True),
    "qwen2moe": ("qwen2_moe", False),
    "qwen3moe": ("qwen3_moe", True),
}
_STACKED = {"ffn_gate_exps": 0, "ffn_up_exps": 1, "ffn_down_exps": 2}
_EXPERT_NAMES = {True: ("w1", "w3", "w2"), False: ("gate_proj", "up_proj", "down_proj")}
# Router and shared-expert tensors -> HF names under the layer's MoE prefix.
_SINGLE = {
    "ffn_gate_inp": "gate",
    "ffn_gate_shexp": "shared_expert.gate_proj",
    "ffn_up_shexp": "shared_expert.up_proj",
    "ffn_down_shexp": "shared_expert.down_proj",
    "ffn_gate_inp_shexp": "shared_expert_gate",
}


def _field(fields: Any, key: str) -> Any:
    f = fields.get(key)
    return None if f is None else f.contents()


def expert_count(fields: Any, arch: str) -> int:
    """``<arch>.expert_count``; 0 for a dense file."""
    return int(_field(fields, f"{arch}.expert_count") or 0)


def moe_tensors(arch: str, layer: str, kind: str, suffix: str, w: np.ndarray
                ) -> dict[str, np.ndarray] | None:
    """The HF tensors of MoE tensor ``blk.{layer}.{kind}.{suffix}``; None when ``kind``
    is not a MoE tensor. Stacked experts are split one per expert."""
    mixtral = MOE_ARCHS[arch][0] == "mixtral"
    prefix = f"model.layers.{layer}.{'block_sparse_moe' if mixtral else 'mlp'}"
    if kind in _SINGLE:
        if kind == "ffn_gate_inp_shexp":  # a vector in GGUF, [1, H] in HF
            w = w.reshape(1, -1)
        return {f"{prefix}.{_SINGLE[kind]}.{suffix}": w}
    if kind not in _STACKED:
        return None
    if w.ndim != 3:
        raise ValueError(f"GGUF tensor blk.{layer}.{kind}.{suffix} must be 3-D (experts "
                         f"stacked), got shape {w.shape}")
    name = _EXPERT_NAMES[mixtral][_STACKED[kind]]
    return {f"{prefix}.experts.{e}.{name}.{suffix}": w[e] for e in range(w.shape[0])}


def moe_config_fields(fields: Any, arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """``config`` (transformers' config of the file, as a dict) with the MoE fields it
    lacks; unchanged for a dense file."""
    experts = expert_count(fields, arch)
    if not experts:
        return config
    if arch not in MOE_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} with {experts} experts is not supported "
                         f"(mixture-of-experts architectures: {sorted(MOE_ARCHS)})")
    model_type, renormalize = MOE_ARCHS[arch]
    norm = _field(fields, f"{arch}.expert_weights_norm")  # a file may say it outright
    renormalize = renormalize if norm is None else bool(norm)
    if model_type == "mixtral" and not renormalize:
        raise ValueError(f"GGUF key {arch}.expert_weights_norm = false is not supported for "
                         "Mixtral-style files (their top-k weights are always renormalised)")
    used = int(_field(fields, f"{arch}.expert_used_count") or 0)
    out = dict(config, model_type=model_type, num_experts_per_tok=used,
               architectures=[{"mixtral": "MixtralForCausalLM",
                               "qwen2_moe": "Qwen2MoeForCausalLM",
                               "qwen3_moe": "Qwen3MoeForCausalLM"}[model_type]])
    if model_type == "mixtral":
        out["num_local_experts"] = experts
        return out
    width = _field(fields, f"{arch}.expert_feed_forward_length")
    if width is None:
        raise ValueError(f"GGUF key {arch}.expert_feed_forward_length is missing")
    out.update(num_experts=experts, moe_intermediate_size=int(width),
               norm_topk_prob=renormalize, decoder_sparse_step=1, mlp_only_layers=[])
    out.pop("num_local_experts", None)
    if model_type == "qwen2_moe":
        shared = _field(fields, f"{arch}.expert_shared_feed_forward_length")
        if shared is None:
            raise ValueError(f"GGUF key {arch}.expert_shared_feed_forward_length is missing")
        out["shared_expert_intermediate_size"] = int(shared)
    return out
