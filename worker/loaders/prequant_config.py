"""``quantization_config`` of a checkpoint quantised ahead of time, checked before any load.

Most quantised models that people serve with vLLM ship their linear weights as integer
or fp8 codes with scales and name the scheme in ``config.json``: GPTQ (AutoGPTQ,
GPTQModel), AWQ (AutoAWQ's GEMM layout), compressed-tensors (llm-compressor's output,
vLLM's own format: packed int4 / int8 / fp8 weights), transformers' fine-grained
``fp8`` (block-scaled, as Qwen3's and DeepSeek's fp8 releases) and ``mxfp4`` (OpenAI's
gpt-oss releases: the routed experts in FP4 with e8m0 scales). This module reads that
dict into a ``PrequantConfig`` and refuses, as a ``ValueError`` naming the field, what
``loaders.prequant`` cannot turn back into the checkpoint's weights exactly (kernel-
specific repackings such as AWQ's GEMV layouts or GPTQ's Marlin format, sparse or rotated
compressed-tensors models, another method), so a bad model fails at config time, not halfway through a
load.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PREQUANT_METHODS = ("gptq", "awq", "compressed-tensors", "fp8", "mxfp4")
# compressed-tensors formats whose weights dequantise exactly: packed ints, int8 codes,
# fp8 codes, and dense (a module left in full precision).
CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized", "dense")


@dataclass(frozen=True)
class CTScheme:
    """One compressed-tensors config group's weight arguments and the modules it covers."""

    targets: tuple[str, ...]
    num_bits: int
    kind: str  # "int" or "float"
    symmetric: bool
    strategy: str  # "tensor", "channel", "group" or "block"
    group_size: int | None
    block: tuple[int, int] | None

    def covers(self, module: str) -> bool:
        return any(_matches(t, module) for t in self.targets)


@dataclass(frozen=True)
class PrequantConfig:
    """What ``loaders.prequant`` needs to dequantise a checkpoint's projections.

    ``bits`` / ``group_size`` (-1: one group per row) / ``zero_offset`` are GPTQ's and
    AWQ's (AutoGPTQ's "gptq" format stores each zero point one below its value: offset
    1); ``schemes`` compressed-tensors' groups; ``block`` fp8's scale block (None:
    per-tensor or per-channel scales). ``notes`` say what the checkpoint asks for that
    runs differently here (activation quantisation, calibrated KV scales), for the log.
    """

    method: str
    bits: int | None = None
    group_size: int = -1
    zero_offset: int = 0
    schemes: tuple[CTScheme, ...] = ()
    block: tuple[int, int] | None = None
    notes: tuple[str, ...] = field(default=())

    def scheme_for(self, module: str) -> CTScheme:
        """The compressed-tensors scheme of a quantised module (``ValueError`` if none)."""
        for s in self.schemes:
            if s.covers(module):
                return s
        if len(self.schemes) == 1:
            return self.schemes[0]
        raise ValueError(f"quantization_config.config_groups: no group targets {module!r}")


def legacy_quantization_config(path: Path) -> dict[str, Any] | None:
    """The quantisation settings of a file made before ``config.json`` carried them:
    AutoGPTQ's ``quantize_config.json`` or AutoAWQ's ``quant_config.json`` (many older
    hub repos have only those), with the method they imply; None when neither is there."""
    for name, method in (("quantize_config.json", "gptq"), ("quant_config.json", "awq")):
        file = path / name
        if file.is_file():
            raw = json.loads(file.read_text())
            if not isinstance(raw, dict):
                raise ValueError(f"{file} must hold an object")
            return {"quant_method": method, **raw}
    return None


def prequant_config(raw: Any) -> PrequantConfig | None:
    """Parse ``config.json``'s ``quantization_config`` (None when absent)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"quantization_config must be an object, got {type(raw).__name__}")
    method = str(raw.get("quant_method", "")).lower()
    if method == "gptq":
        return _gptq(raw)
    if method == "awq":
        return _awq(raw)
    if method == "compressed-tensors":
        return _compressed_tensors(raw)
    if method == "fp8":
        return _fp8(raw)
    if method == "mxfp4":
        return _mxfp4(raw)
    raise ValueError(f"quantization_config.quant_method must be one of {PREQUANT_METHODS}, "
                     f"got {raw.get('quant_method')!r}")


def _gptq(raw: dict[str, Any]) -> PrequantConfig:
    bits = _int(raw, "bits")
    if bits not in (2, 3, 4, 8):
        raise ValueError(f"quantization_config.bits must be 2, 3, 4 or 8 for GPTQ, got {bits}")
    group = _group_size(raw, "group_size")
    fmt = str(raw.get("checkpoint_format") or raw.get("format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError("quantization_config.checkpoint_format must be 'gptq' or 'gptq_v2', "
                         f"got {fmt!r} (a kernel-specific repacking)")
    return PrequantConfig("gptq", bits, group, 1 if fmt == "gptq" else 0)


def _awq(raw: dict[str, Any]) -> PrequantConfig:
    bits = _int(raw, "bits" if "bits" in raw else "w_bit")
    if bits != 4:
        raise ValueError(f"quantization_config.bits must be 4 for AWQ, got {bits}")
    version = str(raw.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"quantization_config.version must be 'gemm', got {version!r} "
                         "(GEMV and kernel-specific layouts are not read)")
    if raw.get("zero_point", True) is not True:
        raise ValueError("quantization_config.zero_point must be true for AWQ")
    key = "group_size" if "group_size" in raw else "q_group_size"
    return PrequantConfig("awq", bits, _group_size(raw, key))


def _compressed_tensors(raw: dict[str, Any]) -> PrequantConfig:
    sparsity = raw.get("sparsity_config") or {}
    if sparsity and str(sparsity.get("format", "dense")) != "dense":
        raise ValueError("quantization_config.sparsity_config.format must be 'dense', got "
                         f"{sparsity.get('format')!r} (sparse weights are not read)")
    if raw.get("transform_config"):
        raise ValueError("quantization_config.transform_config is not supported (the "
                         "weights need online rotations)")
    status = raw.get("quantization_status", "compressed")
    if status not in ("compressed", "frozen"):
        raise ValueError(f"quantization_config.quantization_status must be 'compressed' or "
                         f"'frozen', got {status!r}")
    top = raw.get("format")
    groups = raw.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError("quantization_config.config_groups must be a non-empty object")
    schemes, notes = [], []
    for name, g in groups.items():
        where = f"quantization_config.config_groups.{name}"
        fmt = g.get("format") or top or "dense"
        if fmt not in CT_FORMATS:
            raise ValueError(f"{where}.format must be one of {CT_FORMATS}, got {fmt!r}")
        w = g.get("weights")
        if not isinstance(w, dict):
            raise ValueError(f"{where}.weights must be an object")
        kind = str(w.get("type", "int"))
        bits = _int(w, "num_bits", where + ".weights")
        if kind not in ("int", "float") or not 1 <= bits <= 8 or (kind == "float" and bits != 8):
            raise ValueError(f"{where}.weights: type {kind!r} with num_bits {bits} is not "
                             "supported (int of 1-8 bits, or float of 8)")
        strategy = str(w.get("strategy", "tensor"))
        if strategy not in ("tensor", "channel", "group", "block"):
            raise ValueError(f"{where}.weights.strategy must be tensor, channel, group or "
                             f"block, got {strategy!r}")
        block = w.get("block_structure")
        if strategy == "block" and not (isinstance(block, list) and len(block) == 2):
            raise ValueError(f"{where}.weights.block_structure must be [rows, columns]")
        targets = g.get("targets") or ["Linear"]
        schemes.append(CTScheme(tuple(str(t) for t in targets), bits, kind,
                                bool(w.get("symmetric", True)), strategy,
                                w.get("group_size"),
                                (int(block[0]), int(block[1])) if strategy == "block" else None))
        if g.get("input_activations"):
            notes.append(f"{name}: activations are quantised in the checkpoint's scheme, run "
                         "in the model's dtype here")
    if raw.get("kv_cache_scheme"):
        notes.append("kv_cache_scheme: calibrated KV scales are not used (see kv_cache_dtype)")
    return PrequantConfig("compressed-tensors", schemes=tuple(schemes), notes=tuple(notes))


def _fp8(raw: dict[str, Any]) -> PrequantConfig:
    block = raw.get("weight_block_size")
    if block is not None and not (isinstance(block, list) and len(block) == 2
                                  and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"quantization_config.weight_block_size must be [rows, columns], "
                         f"got {block!r}")
    notes = ()
    if raw.get("activation_scheme", "dynamic") == "static":
        notes = ("activation_scheme static: activations run in the model's dtype here",)
    return PrequantConfig("fp8", block=tuple(block) if block else None, notes=notes)


def _mxfp4(raw: dict[str, Any]) -> PrequantConfig:
    """gpt-oss's MXFP4 (``loaders.mxfp4``): FP4 codes in groups of 32 with e8m0 scales,
    only the routed experts' ``*_blocks`` / ``*_scales`` pairs; the tensors named say
    what is packed, so ``modules_to_not_convert`` (the rest, as transformers writes it)
    is only checked."""
    skip = raw.get("modules_to_not_convert")
    if skip is not None and not (isinstance(skip, list)
                                 and all(isinstance(m, str) for m in skip)):
        raise ValueError("quantization_config.modules_to_not_convert must be a list of "
                         f"module names, got {skip!r}")
    if not isinstance(raw.get("dequantize", False), bool):
        raise ValueError(f"quantization_config.dequantize must be a boolean, got "
                         f"{raw.get('dequantize')!r}")
    return PrequantConfig("mxfp4")


def _int(raw: dict[str, Any], key: str, where: str = "quantization_config") -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}.{key} must be an integer, got {value!r}")
    return value


def _group_size(raw: dict[str, Any], key: str) -> int:
    group = raw.get(key, -1)
    if isinstance(group, bool) or not isinstance(group, int) or (group <= 0 and group != -1):
        raise ValueError(f"quantization_config.{key} must be a positive integer or -1, "
                         f"got {group!r}")
    return group


def _matches(target: str, module: str) -> bool:
    """compressed-tensors' target rule: a class name (every projection here is a
    ``Linear``), ``re:`` and a pattern, or a module name (whole, or its last parts)."""
    if target == "Linear":
        return True
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return module == target or module.endswith("." + target)
