"""MXFP4 checkpoints written on the spot from a dense GPT-OSS one (no gpt-oss release is
on this machine), for the tests: each layer's routed experts packed as OpenAI's releases
store them (``loaders.mxfp4`` reads them back), everything else as it was.

Each group of 32 inputs gets the smallest e8m0 scale ``2 ** e`` that fits its largest
magnitude in E2M1's range (``max |x| / 2 ** e <= 6``), and each value the nearest FP4
value (ties to the even code, as IEEE rounding): what the release's own quantiser aims
at, though any scale choice reads back the same way, which is what the tests check.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pagedserve.worker.loaders.mxfp4 import E8M0_BIAS, FP4_VALUES, GROUP

# The release's quantization_config (gpt-oss-20b / -120b's config.json).
QUANTIZATION_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
PACKED = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
_MAGNITUDES = torch.tensor(FP4_VALUES[:8])
_MIDPOINTS = (_MAGNITUDES[1:] + _MAGNITUDES[:-1]) / 2


def _codes(name: str, dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense ``[E, in, out]`` as FP4 codes ``[E, out, in / 32, 32]`` and their groups'
    unbiased exponents ``[E, out, in / 32]``."""
    if dense.dim() != 3 or dense.shape[1] % GROUP:
        raise ValueError(f"{name}: MXFP4 needs [experts, in, out] with in a multiple of "
                         f"{GROUP}, got {tuple(dense.shape)}")
    n_exp, n_in, n_out = dense.shape
    x = dense.to(torch.float32).transpose(1, 2).contiguous() \
        .view(n_exp, n_out, n_in // GROUP, GROUP)
    # ceil(log2(amax / 6)), exactly: frexp's mantissa is 0.5 only at a power of two.
    mant, exp = torch.frexp(x.abs().amax(-1) / FP4_VALUES[7])
    exp = torch.where(mant == 0.5, exp - 1, exp)
    exp = torch.where(mant == 0, -E8M0_BIAS, exp).clamp(-E8M0_BIAS, E8M0_BIAS)
    mag = torch.ldexp(x.abs(), -exp.unsqueeze(-1))
    idx = torch.bucketize(mag, _MIDPOINTS)  # a tie goes down: up where that code is odd
    tie_odd = (idx % 2 == 1) & (mag == _MIDPOINTS[idx.clamp(max=len(_MIDPOINTS) - 1)])
    idx = (idx + tie_odd.to(idx.dtype)).clamp(max=7)
    return (idx | torch.where(torch.signbit(x), 8, 0)).to(torch.uint8), exp


def quantize_mxfp4(name: str, dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense ``[E, in, out]`` as the release's ``<name>_blocks`` uint8 ``[E, out, in / 32,
    16]`` (two codes a byte, low nibble first) and ``<name>_scales`` uint8 ``[E, out, in /
    32]`` (``e + 127``); ``ValueError`` naming ``name`` when ``in`` is not a multiple of 32."""
    codes, exp = _codes(name, dense)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exp + E8M0_BIAS).to(torch.uint8)


def mxfp4_values(name: str, dense: torch.Tensor) -> torch.Tensor:
    """The fp32 values ``quantize_mxfp4``'s codes stand for, in ``dense``'s ``[E, in, out]``
    layout, computed from the codes before any packing."""
    codes, exp = _codes(name, dense)
    signs = torch.where(codes >= 8, -1.0, 1.0)
    values = torch.ldexp(signs * _MAGNITUDES[(codes & 7).long()], exp.unsqueeze(-1))
    n_exp, n_in, n_out = dense.shape
    return values.reshape(n_exp, n_out, n_in).transpose(1, 2).contiguous()


def write_mxfp4_checkpoint(dense_dir: str | Path, out_dir: str | Path) -> Path:
    """``dense_dir``'s GPT-OSS checkpoint (``save_pretrained``'s config and safetensors)
    written to ``out_dir`` with each layer's ``experts.gate_up_proj`` / ``down_proj`` as
    MXFP4 blocks and scales, the release's ``quantization_config`` in its config, and
    every other file (tokenizer, generation config) copied."""
    src, dest = Path(dense_dir), Path(out_dir)
    dest.mkdir(parents=True)
    state: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(str(f)))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith(PACKED):
            out[name + "_blocks"], out[name + "_scales"] = quantize_mxfp4(name, tensor)
        else:
            out[name] = tensor.contiguous()
    if len(out) == len(state):
        raise ValueError(f"{src}: no experts' gate_up_proj / down_proj to pack")
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" \
                and f.name != "model.safetensors.index.json":
            shutil.copy(f, dest / f.name)
    save_file(out, str(dest / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dest / "config.json").read_text())
    cfg["quantization_config"] = QUANTIZATION_CONFIG
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    return dest
