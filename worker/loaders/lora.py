"""Read a PEFT LoRA adapter directory: ``adapter_config.json`` plus its weights.

Only what the serving forward can apply exactly is accepted: plain LoRA on
the attention and MLP projections (``q/k/v/o_proj``, ``gate/up/down_proj``),
with ``rank_pattern`` / ``alpha_pattern`` / rsLoRA scaling. DoRA, trained
biases, ``modules_to_save``, embedding or LM-head adapters would change the
model in ways this engine does not compute, so they are refused with a
``ValueError`` naming the field instead of serving silently different text.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY_RE = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_PEFT_PREFIX = "base_model.model."
# Config fields that must be off / empty: each changes what the adapter computes.
_REFUSED = {
    "use_dora": "DoRA adapters are not supported",
    "modules_to_save": "modules_to_save (fully trained extra modules) is not supported",
    "fan_in_fan_out": "fan_in_fan_out (GPT-2 Conv1D layout) is not supported",
    "lora_bias": "trained LoRA biases are not supported",
    "layer_replication": "layer_replication is not supported",
    "target_parameters": "target_parameters (parameter-level LoRA) is not supported",
    "trainable_token_indices": "trainable_token_indices is not supported",
}


@dataclass
class LoRAAdapter:
    """Full (unsharded) fp32 weights: ``(layer, module) -> (A [r, in], B [out, r], scale)``."""

    path: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]


def read_lora_config(path: str | Path) -> dict[str, Any]:
    """The adapter's config, checked for what this engine can serve."""
    cfg_path = Path(path) / "adapter_config.json"
    if not cfg_path.is_file():
        raise ValueError(f"lora_path {str(path)!r} has no adapter_config.json")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{cfg_path}: cannot read the adapter config ({e})") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_path}: the adapter config is not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{cfg_path}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for name, why in _REFUSED.items():
        if cfg.get(name):
            raise ValueError(f"{cfg_path}: {name} is set; {why}")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"{cfg_path}: bias {cfg.get('bias')!r}; trained biases are not supported")
    for name in ("r", "lora_alpha"):
        v = cfg.get(name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise ValueError(f"{cfg_path}: {name} must be a positive number, got {v!r}")
    return cfg


def _pattern_value(patterns: dict[str, Any], name: str, default: float) -> float:
    """PEFT's rule: a pattern key applies to a module whose name ends in it (regex)."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", name):
            return float(value)
    return default


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The weights file's tensors; an unreadable file is a ``ValueError`` (a bad adapter,
    not a failed worker)."""
    st = path / "adapter_model.safetensors"
    bin_file = path / "adapter_model.bin"
    try:
        if st.is_file():
            from safetensors.torch import load_file

            return load_file(str(st))
        if bin_file.is_file():
            return torch.load(bin_file, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"{path}: cannot read the adapter weights ({e})") from e
    raise ValueError(f"lora_path {str(path)!r} has no adapter_model.safetensors or "
                     "adapter_model.bin")


def load_lora_adapter(path: str | Path, num_layers: int, max_lora_rank: int,
                      fused: dict[str, list[tuple[str, int]]] | None = None,
                      rename: Callable[[str], str] | None = None) -> LoRAAdapter:
    """Every ``lora_A`` / ``lora_B`` pair of the adapter with its scale, in fp32 (the
    engine scales and fuses them before casting to the model's dtype).

    ``fused`` names the model's fused projections (Phi-3's ``qkv_proj`` as
    ``[("q_proj", rows), ("k_proj", rows), ("v_proj", rows)]``): an adapter on one is
    served as adapters on its parts, each with the shared A and its rows of B (the
    same product, row for row). ``rename`` maps the model's own module names (a
    hybrid's ``feed_forward``, LFM2's ``w1``...) to Llama's, as its weights load.

    Raises ``ValueError`` for a rank above ``max_lora_rank``, a layer the model
    does not have, a module other than the projections, or an A without its B.
    """
    fused = fused or {}
    path = Path(path)
    cfg = read_lora_config(path)
    tensors = _read_tensors(path)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        if rename is not None and key.startswith(_PEFT_PREFIX):
            key = _PEFT_PREFIX + rename(key[len(_PEFT_PREFIX):])
        m = _KEY_RE.match(key)
        if m is None:
            raise ValueError(f"{path}: unsupported adapter weight {key!r} (only LoRA on "
                             f"{', '.join(MODULES)} is served)")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in MODULES and module not in fused:
            raise ValueError(f"{path}: adapter targets {module!r}; only "
                             f"{', '.join((*MODULES, *fused))} are supported")
        if layer >= num_layers:
            raise ValueError(f"{path}: adapter has layer {layer}, the model has {num_layers}")
        pairs.setdefault((layer, module), {})[ab] = t
    if not pairs:
        raise ValueError(f"{path}: the adapter has no LoRA weights")
    use_rslora = bool(cfg.get("use_rslora"))
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]] = {}
    max_rank = 0
    for (layer, module), ab in sorted(pairs.items()):
        where = f"layer {layer} {module}"
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{path}: {where} has lora_{''.join(ab)} without its pair")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"{path}: {where}: lora_A {tuple(a.shape)} and lora_B "
                             f"{tuple(b.shape)} do not multiply")
        rank = a.shape[0]
        if rank > max_lora_rank:
            raise ValueError(f"{path}: {where} has rank {rank} > max_lora_rank "
                             f"({max_lora_rank})")
        parent = "mlp" if module in ("gate_proj", "up_proj", "down_proj", "gate_up_proj") \
            else "self_attn"
        name = f"model.layers.{layer}.{parent}.{module}"
        alpha = _pattern_value(cfg.get("alpha_pattern"), name, float(cfg["lora_alpha"]))
        scale = alpha / (math.sqrt(rank) if use_rslora else rank)
        parts = fused.get(module, [(module, b.shape[0])])
        if sum(n for _, n in parts) != b.shape[0]:
            raise ValueError(f"{path}: {where}: lora_B {tuple(b.shape)} does not cover "
                             f"the fused projection's {sum(n for _, n in parts)} rows")
        row = 0
        for part, n in parts:
            weights[(layer, part)] = (a.float(), b[row:row + n].float(), scale)
            row += n
        max_rank = max(max_rank, rank)
    return LoRAAdapter(str(path), max_rank, weights)
