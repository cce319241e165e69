"""A tensor-parallel rank's part of a pre-quantised projection, cut from its packed parts.

A column-parallel rank (q / k / v, gate / up) takes a slice of a projection's output
rows, a row-parallel one (o, down) a slice of its inputs. Where the packed parts split
at the slice's edges (whole packed words, whole quantisation groups), the rank's part is
the same checkpoint format over fewer rows or inputs, and ``prequant``'s dequantisers
turn it into exactly the whole matrix's slice (each weight is dequantised on its own,
from its own code, zero point and scale). Anywhere else these answer None and the
loader dequantises the whole projection before slicing it.

Layouts (``prequant``): GPTQ ``qweight [in * bits / 32, out]``, ``qzeros [groups, out *
bits / 32]``, ``scales [groups, out]``, act-order ``g_idx [in]``; AWQ ``qweight [in, out /
8]``, ``qzeros [groups, out / 8]``, ``scales [groups, out]``; compressed-tensors
``weight_packed [out, in * bits / 32]``, ``weight_scale [out, groups]``, integer zero
points packed down the columns ``[out * bits / 32, groups]``, ``weight_g_idx [in]``;
int8 / fp8 ``weight [out, in]`` with a tensor, channel, group or block scale.
"""

from __future__ import annotations

import torch

from pagedserve.worker.loaders.prequant_config import PrequantConfig

Parts = dict[str, torch.Tensor]


def row_parts(cfg: PrequantConfig, prefix: str, p: Parts, shape: tuple[int, int], a: int,
              b: int) -> Parts | None:
    """The parts of output rows ``[a, b)`` alone, or None where they do not split."""
    n_out = shape[0]
    cuts: dict[str, torch.Tensor | None]
    out = dict(p)
    if cfg.method in ("gptq", "awq"):
        per = _per_word(cfg.bits if cfg.method == "gptq" else 4)
        if per is None:
            return None
        cuts = {"scales": _cut(p["scales"], 1, a, b), "qzeros": _cut(p["qzeros"], 1, a, b, per),
                "qweight": _cut(p["qweight"], 1, a, b, 1 if cfg.method == "gptq" else per)}
    elif "weight_packed" in p:
        scheme = cfg.scheme_for(prefix)
        per = _per_word(scheme.num_bits)
        if scheme.strategy not in ("group", "channel") or per is None:
            return None
        out["weight_shape"] = torch.tensor([b - a, shape[1]])
        cuts = {"weight_packed": _cut(p["weight_packed"], 0, a, b),
                "weight_scale": _cut(p["weight_scale"], 0, a, b)}
        zp = p.get("weight_zero_point")
        if zp is not None:
            cuts["weight_zero_point"] = _cut(zp, 0, a, b, per if zp.dtype == torch.int32
                                             else 1)
    else:
        key = "weight_scale" if "weight_scale" in p else "weight_scale_inv"
        scale = p.get(key)
        if scale is None or (scale.numel() > 1 and scale.shape[0] != n_out) \
                or (cfg.method == "fp8" and cfg.block):
            return None  # (block scales: rows of blocks)
        cuts = {"weight": _cut(p["weight"], 0, a, b), key: _per_row(scale, n_out, a, b)}
        zp = p.get("weight_zero_point")
        if zp is not None:
            cuts["weight_zero_point"] = _per_row(zp, n_out, a, b)
    return _with(out, cuts)


def input_parts(cfg: PrequantConfig, prefix: str, p: Parts, shape: tuple[int, int], a: int,
                b: int) -> Parts | None:
    """The parts of inputs ``[a, b)`` alone, or None where they do not split. With a
    group index (act-order) every group's scale stays and the index is cut; without
    one the cut must fall on whole groups."""
    n_in = shape[1]
    cuts: dict[str, torch.Tensor | None]
    out = dict(p)
    if cfg.method in ("gptq", "awq"):
        per = _per_word(cfg.bits) if cfg.method == "gptq" else 1
        if per is None:
            return None
        cuts = {"qweight": _cut(p["qweight"], 0, a, b, per)}
        cuts.update(_groups(p, ("scales", "qzeros"), 0, "g_idx", cfg.group_size, n_in, a, b))
    elif "weight_packed" in p:
        scheme = cfg.scheme_for(prefix)
        per = _per_word(scheme.num_bits)
        if scheme.strategy not in ("group", "channel") or per is None:
            return None
        out["weight_shape"] = torch.tensor([shape[0], b - a])
        cuts = {"weight_packed": _cut(p["weight_packed"], 1, a, b, per)}
        if scheme.strategy == "group":
            cuts.update(_groups(p, ("weight_scale", "weight_zero_point"), 1, "weight_g_idx",
                                scheme.group_size or n_in, n_in, a, b))
    else:
        key = "weight_scale" if "weight_scale" in p else "weight_scale_inv"
        scale = p.get(key)
        if scale is None or (cfg.method == "fp8" and cfg.block):
            return None
        cuts = {"weight": _cut(p["weight"], 1, a, b)}
        if scale.numel() > 1 and scale.shape != (shape[0], 1):  # per group of inputs
            scheme = cfg.scheme_for(prefix)
            if scheme.strategy != "group" or not scheme.group_size:
                return None
            cuts.update(_groups(p, (key, "weight_zero_point"), 1, "weight_g_idx",
                                scheme.group_size, n_in, a, b))
    return _with(out, cuts)


def _groups(p: Parts, names: tuple[str, ...], dim: int, index: str, group_size: int,
            n_in: int, a: int, b: int) -> dict[str, torch.Tensor | None]:
    """The group-wise parts for inputs ``[a, b)``: the group index cut (every group's
    scale kept) when the file has one, else the whole groups the cut spans."""
    if index in p:
        return {index: p[index][a:b]}
    size = n_in if group_size == -1 else group_size
    cuts: dict[str, torch.Tensor | None] = {}
    for name in names:
        t = p.get(name)
        if t is None:
            continue
        if t.shape[dim] == 1 and size == n_in:
            continue  # one group over every input: its scale serves any slice
        cuts[name] = _cut(t, dim, a, b, size)
    return cuts


def _per_word(bits: int | None) -> int | None:
    """Codes per int32 word, or None when codes straddle words."""
    return None if bits is None or 32 % bits else 32 // bits


def _cut(t: torch.Tensor, dim: int, a: int, b: int, per: int = 1) -> torch.Tensor | None:
    if a % per or b % per:
        return None
    return t[a // per:b // per] if dim == 0 else t[:, a // per:b // per]


def _per_row(t: torch.Tensor, n_out: int, a: int, b: int) -> torch.Tensor | None:
    """A scale or zero point for rows ``[a, b)``: one for the tensor stays as it is."""
    if t.numel() == 1:
        return t
    return t[a:b] if t.shape[0] == n_out else None


def _with(out: Parts, cuts: dict[str, torch.Tensor | None]) -> Parts | None:
    if any(v is None for v in cuts.values()):
        return None
    out.update({k: v for k, v in cuts.items() if v is not None})
    return out
