"""Quantised checkpoints written on the spot from a dense one (no such model is on this
machine), for the tests and ``bench/prequant.py``: GPTQ and AWQ packed as AutoGPTQ /
GPTQModel and AutoAWQ pack them (their packing loops, restated), compressed-tensors
through its own compressor, fp8 with block scales as transformers' fine-grained fp8
stores them.

Each writer also saves the dense checkpoint of the weights the quantised one stands for,
computed here element by element (codes minus zero, times the scale, rounded to the
scale's dtype), so a test can compare the engine on the quantised checkpoint with
transformers on the dense one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
        "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")  # (DeepSeek's MLA)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _state(src: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _save(src: Path, dest: Path, tensors: dict[str, torch.Tensor],
          quant: dict[str, Any] | None) -> Path:
    """``src``'s config and tokenizer files with ``tensors`` as the weights."""
    dest.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dest / f.name)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dest / "model.safetensors"),
              metadata={"format": "pt"})
    if quant is not None:
        cfg = json.loads((dest / "config.json").read_text())
        cfg["quantization_config"] = quant
        (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def _projections(state: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k[:-len(".weight")] for k in state
                  if k.endswith(".weight") and k.split(".")[-2] in PROJ)


def pack_dense(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``[rows, n]`` (0..2**bits-1) packed along each row into int32 words, code
    ``e`` at bit ``e * bits`` of the row, straddling words where it must (GPTQ's 3-bit
    rows, compressed-tensors' layout)."""
    rows, n = codes.shape
    words = torch.zeros(rows, -(-n * bits // 32), dtype=torch.int64)
    for e in range(n):
        word, off = divmod(e * bits, 32)
        value = codes[:, e].to(torch.int64)
        words[:, word] |= (value << off) & 0xFFFFFFFF
        if off + bits > 32:
            words[:, word + 1] |= value >> (32 - off)
    return (words - ((words >> 31) << 32)).to(torch.int32)  # as signed int32


def _grid(w: torch.Tensor, bits: int, groups: torch.Tensor, n_groups: int, sym: bool):
    """Min-max codes of ``w`` [out, in] per (row, group): codes [out, in], fp16 scales
    [groups, out], integer zeros [groups, out]."""
    maxq = (1 << bits) - 1
    scales = torch.empty(n_groups, w.shape[0], dtype=torch.float16)
    zeros = torch.empty(n_groups, w.shape[0], dtype=torch.int64)
    codes = torch.empty(w.shape, dtype=torch.int64)
    for g in range(n_groups):
        cols = groups == g
        wg = w[:, cols]
        lo, hi = wg.min(1).values.clamp(max=0), wg.max(1).values.clamp(min=0)
        if sym:
            s = torch.maximum(lo.abs(), hi) * 2 / maxq
            z = torch.full_like(s, (maxq + 1) // 2, dtype=torch.int64)
        else:
            s = (hi - lo) / maxq
            z = torch.round(-lo / s).to(torch.int64)
        s16 = s.clamp(min=1e-4).to(torch.float16)
        q = torch.round(wg / s16.float()[:, None]) + z[:, None]
        codes[:, cols] = q.clamp(0, maxq).to(torch.int64)
        scales[g], zeros[g] = s16, z
    return codes, scales, zeros


def _dequant(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
             groups: torch.Tensor) -> torch.Tensor:
    """The reference: ``fp16(s * (q - z))`` per weight, in float64 first."""
    s = scales.t()[:, groups].double()
    z = zeros.t()[:, groups].double()
    return (s * (codes.double() - z)).to(torch.float16).float()


def write_gptq(src: Path, dest: Path, bits: int = 4, group_size: int = 32,
               desc_act: bool = False, sym: bool = True, v1: bool = True,
               seed: int = 0) -> tuple[Path, Path]:
    """A GPTQ checkpoint of ``src`` (``dest``) and the dense one it stands for
    (``dest`` + "_dense"). ``desc_act`` shuffles which inputs share a group (``g_idx``);
    every projection without a bias gets a zero fp16 one, as AutoGPTQ saves them."""
    state, dense = _state(src), {}
    gen = torch.Generator().manual_seed(seed)
    for prefix in _projections(state):
        w = state.pop(prefix + ".weight").float()
        n_in = w.shape[1]
        size = n_in if group_size == -1 else group_size
        n_groups = -(-n_in // size)
        order = torch.randperm(n_in, generator=gen) if desc_act else torch.arange(n_in)
        groups = torch.empty(n_in, dtype=torch.int64)
        groups[order] = torch.arange(n_in) // size
        codes, scales, zeros = _grid(w, bits, groups, n_groups, sym)
        dense[prefix + ".weight"] = _dequant(codes, scales, zeros, groups)
        state[prefix + ".qweight"] = pack_dense(codes, bits).t().contiguous()  # [in*b/32, out]
        assert not v1 or bool((zeros >= 1).all())  # v1 stores z - 1 (AutoGPTQ's format)
        state[prefix + ".qzeros"] = pack_dense(zeros - (1 if v1 else 0), bits)
        state[prefix + ".scales"] = scales
        state[prefix + ".g_idx"] = groups.to(torch.int32)
        state.setdefault(prefix + ".bias", torch.zeros(w.shape[0], dtype=torch.float16))
    quant = {"quant_method": "gptq", "bits": bits, "group_size": group_size,
             "desc_act": desc_act, "sym": sym,
             "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    return _save(src, dest, state, quant), _dense(src, dest, dense)


def write_awq(src: Path, dest: Path, group_size: int = 32) -> tuple[Path, Path]:
    """An AutoAWQ GEMM checkpoint of ``src`` and the dense one it stands for."""
    state, dense = _state(src), {}
    for prefix in _projections(state):
        w = state.pop(prefix + ".weight").float()
        n_in = w.shape[1]
        groups = torch.arange(n_in) // group_size
        codes, scales, zeros = _grid(w, 4, groups, -(-n_in // group_size), sym=False)
        dense[prefix + ".weight"] = _dequant(codes, scales, zeros, groups)
        state[prefix + ".qweight"] = _pack_awq(codes.t())
        state[prefix + ".qzeros"] = _pack_awq(zeros)
        state[prefix + ".scales"] = scales
    quant = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
             "version": "gemm"}
    return _save(src, dest, state, quant), _dense(src, dest, dense)


def _pack_awq(values: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's loop: word ``col`` holds columns ``col * 8 + AWQ_ORDER[i]`` at bits
    ``4 * i``."""
    rows, n = values.shape
    out = torch.zeros(rows, n // 8, dtype=torch.int64)
    for col in range(n // 8):
        for i in range(8):
            out[:, col] |= values[:, col * 8 + AWQ_ORDER[i]].to(torch.int64) << (4 * i)
    return (out - ((out >> 31) << 32)).to(torch.int32)


def write_fp8(src: Path, dest: Path, block: tuple[int, int] = (32, 32)) -> tuple[Path, Path]:
    """transformers' fine-grained fp8 layout (``weight`` in E4M3, ``weight_scale_inv`` per
    block) and the dense checkpoint it stands for."""
    state, dense = _state(src), {}
    for prefix in _projections(state):
        w = state.pop(prefix + ".weight").float()
        rows, cols = -(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])
        scale = torch.empty(rows, cols)
        for r in range(rows):
            for c in range(cols):
                tile = w[r * block[0]:(r + 1) * block[0], c * block[1]:(c + 1) * block[1]]
                scale[r, c] = tile.abs().max().clamp(min=1e-6) / 448.0
        spread = scale.repeat_interleave(block[0], 0)[:w.shape[0]] \
            .repeat_interleave(block[1], 1)[:, :w.shape[1]]
        codes = (w / spread).to(torch.float8_e4m3fn)
        dense[prefix + ".weight"] = codes.float() * spread
        state[prefix + ".weight"] = codes
        state[prefix + ".weight_scale_inv"] = scale
    quant = {"quant_method": "fp8", "activation_scheme": "dynamic",
             "weight_block_size": list(block)}
    return _save(src, dest, state, quant), _dense(src, dest, dense)


def _dense(src: Path, dest: Path, weights: dict[str, torch.Tensor]) -> Path:
    state = _state(src)
    state.update(weights)
    return _save(src, dest.with_name(dest.name + "_dense"), state, None)


def write_compressed_tensors(src: Path, dest: Path, num_bits: int = 4,
                             strategy: str = "group", group_size: int | None = 32,
                             symmetric: bool = True) -> Path:
    """``src`` quantised by compressed-tensors itself (min-max scales) and saved in its
    ``pack-quantized`` format, as llm-compressor saves W4A16 / W8A16 models."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    args = QuantizationArgs(num_bits=num_bits, type="int", symmetric=symmetric,
                            strategy=strategy, group_size=group_size)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
        ignore=["lm_head"], format="pack-quantized"), show_progress=False)
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            w = module.weight.data
            w = w.reshape(w.shape[0], -1, group_size) if strategy == "group" else w[:, None]
            scale, zero = calculate_qparams(w.amin(-1), w.amax(-1), args)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(str(dest))
    compressor.update_config(str(dest))
    for f in src.iterdir():
        if "token" in f.name:
            shutil.copy(f, dest / f.name)
    return dest
