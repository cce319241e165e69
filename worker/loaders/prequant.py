"""Projections of a checkpoint quantised ahead of time, dequantised as the model loads them.

A GPTQ, AWQ, compressed-tensors or fp8 checkpoint (``loaders.prequant_config``) holds each
quantised projection as several tensors: packed integer codes, scales, zero points, a
group index. vLLM runs those through Marlin / Machete kernels on GPUs; we have none, so
``dequantized_weights`` sits between the safetensors stream and ``load_weights``: it
gathers a projection's parts and hands the model one ``<module>.weight`` whose indexing
returns the dense matrix, computed as the checkpoint's reference does (codes minus zero
point, times the scale, rounded once to the scale's dtype: AutoGPTQ's, AutoAWQ's and
compressed-tensors' own dequantisation). Everything after that is a dense model's path:
tensor-parallel slices, pipeline stages, LoRA, CUDA graphs, and ``quantization="int8"`` /
``"int4"`` on CPU, which quantise again in their own groups of 32.

Costs: the weights are dense after load (a 4-bit checkpoint takes 4x its bytes in bf16,
8x in fp32). A tensor-parallel rank dequantises just its slice of a projection's
outputs or inputs where the packing splits there (``prequant_slices``; elsewhere the
whole projection, then the slice), and a pipeline stage reads only its own layers'
parts (``keep``). Activation scales (``input_scale``), calibrated KV scales and the like are
dropped: activations and the KV pool run in the engine's dtypes. MXFP4 files (gpt-oss's
experts) pair their blocks and scales in ``loaders.mxfp4``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any

import torch

from pagedserve.worker.loaders.mxfp4 import mxfp4_weights
from pagedserve.worker.loaders.prequant_config import PrequantConfig
from pagedserve.worker.loaders.prequant_slices import input_parts, row_parts

logger = logging.getLogger(__name__)

# Parts a quantised checkpoint may carry that the dense model does not use.
_UNUSED_PARTS = frozenset({"input_scale", "input_zero_point", "input_global_scale",
                           "output_scale", "output_zero_point", "k_scale", "v_scale",
                           "q_scale", "prob_scale", "kv_scale"})
# AutoAWQ packs output columns 0..7 of each word in this order (its AWQ_ORDER); the
# inverse puts them back.
_AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
_NARROW = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)


class DequantizedWeight:
    """A quantised projection as the loader's lazy tensor: ``shape`` is the dense
    ``(out, in)``. A slice of output rows (a column-parallel rank's share) or of inputs
    (a row-parallel rank's, ``[:, a:b]``) dequantises only that part when ``part`` can
    cut the packed parts there; any other index dequantises the whole matrix once (the
    slice a rank takes follows the checkpoint's dense layout, not its packed one)."""

    def __init__(self, name: str, shape: tuple[int, int], make: Callable[[], torch.Tensor],
                 part: Callable[[int, int, int], torch.Tensor | None] | None = None):
        self.name, self.shape = name, shape
        self._make: Callable[[], torch.Tensor] | None = make
        self._part = part
        self._dense: torch.Tensor | None = None

    def __getitem__(self, idx: Any) -> torch.Tensor:
        if self._dense is None and self._part is not None:
            cut = _one_dim_slice(idx)
            if cut is not None:
                dim, sl = cut
                a, b, _ = sl.indices(self.shape[dim])
                part = self._part(dim, a, b) if 0 < b - a < self.shape[dim] else None
                if part is not None:
                    want = (b - a, self.shape[1]) if dim == 0 else (self.shape[0], b - a)
                    if tuple(part.shape) != want:
                        raise ValueError(f"{self.name}: a slice {a}:{b} of dim {dim} "
                                         f"dequantised to {tuple(part.shape)}")
                    return part
        if self._dense is None:
            assert self._make is not None
            dense = self._make()
            if tuple(dense.shape) != self.shape:
                raise ValueError(f"{self.name}: dequantised to {tuple(dense.shape)}, "
                                 f"expected {self.shape}")
            self._dense, self._make = dense, None
        return self._dense[idx]


def _one_dim_slice(idx: Any) -> tuple[int, slice] | None:
    """``(0, rows)`` for ``w[a:b]``, ``(1, inputs)`` for ``w[:, a:b]``, else None."""
    if isinstance(idx, slice) and idx.step in (None, 1):
        return 0, idx
    if isinstance(idx, tuple) and len(idx) == 2 and all(isinstance(i, slice) for i in idx) \
            and idx[0] == slice(None) and idx[1].step in (None, 1):
        return 1, idx[1]
    return None


def dequantized_weights(weights: Iterable[tuple[str, Any]], cfg: PrequantConfig,
                        names: Collection[str], keep: Callable[[str], bool] | None = None
                        ) -> Iterator[tuple[str, Any]]:
    """``weights`` with each quantised projection's parts replaced by one dense
    ``<module>.weight``; ``names`` is every tensor name of the checkpoint (which parts a
    projection has is known before the first arrives). Parts are read as they come (the
    file they are in may close before the rest); a projection missing one is a
    ``ValueError`` at the end. A projection whose ``<module>.weight`` ``keep`` refuses
    (another pipeline stage's) is never read nor yielded. An MXFP4 file's expert
    pairs (``<prefix>_blocks`` / ``_scales``) become ``<prefix>`` (``loaders.mxfp4``)."""
    if cfg.method == "mxfp4":
        yield from mxfp4_weights(weights, names, keep)
        return
    expected = _quantised_parts(cfg, set(names))
    pending: dict[str, dict[str, torch.Tensor]] = {}
    dropped = 0
    for name, lazy in weights:
        prefix, _, part = name.rpartition(".")
        parts = expected.get(prefix)
        if parts is None or part not in parts:
            if part in _UNUSED_PARTS:
                dropped += 1
                continue
            yield name, lazy
            continue
        if keep is not None and not keep(prefix + ".weight"):
            continue
        got = pending.setdefault(prefix, {})
        got[part] = lazy[:]
        if len(got) == len(parts):
            del pending[prefix]
            yield prefix + ".weight", _dequantizer(cfg, prefix, got)
    if pending:
        prefix, got = next(iter(pending.items()))
        missing = sorted(expected[prefix] - got.keys())
        raise ValueError(f"checkpoint's quantised {prefix} lacks {missing} "
                         f"({len(pending)} projection(s) incomplete)")
    for note in cfg.notes:
        logger.info("quantized checkpoint (%s): %s", cfg.method, note)
    if dropped:
        logger.info("quantized checkpoint (%s): %d activation / KV scale tensors unused",
                    cfg.method, dropped)


def _quantised_parts(cfg: PrequantConfig, names: set[str]) -> dict[str, frozenset[str]]:
    """Each quantised projection's prefix and the parts the checkpoint has for it."""
    def have(prefix: str, *parts: str) -> set[str]:
        return {p for p in parts if f"{prefix}.{p}" in names}

    out: dict[str, frozenset[str]] = {}
    for name in names:
        prefix, _, part = name.rpartition(".")
        if cfg.method in ("gptq", "awq") and part == "qweight":
            extra = have(prefix, "g_idx") if cfg.method == "gptq" else set()
            out[prefix] = frozenset({"qweight", "qzeros", "scales", *extra})
        elif cfg.method == "compressed-tensors" and part == "weight_packed":
            out[prefix] = frozenset({"weight_packed", "weight_scale", "weight_shape",
                                     *have(prefix, "weight_zero_point", "weight_g_idx")})
        elif (cfg.method in ("compressed-tensors", "fp8") and part in ("weight_scale",
                                                                       "weight_scale_inv")
              and f"{prefix}.weight" in names):
            out[prefix] = frozenset({"weight", part, *have(prefix, "weight_zero_point",
                                                           "weight_g_idx")})
    return out


def _dequantizer(cfg: PrequantConfig, prefix: str, parts: dict[str, torch.Tensor]
                 ) -> DequantizedWeight:
    shape, make = _maker(cfg, prefix, parts)

    def part(dim: int, a: int, b: int) -> torch.Tensor | None:
        sub = (row_parts if dim == 0 else input_parts)(cfg, prefix, parts, shape, a, b)
        return None if sub is None else _maker(cfg, prefix, sub)[1]()

    return DequantizedWeight(prefix + ".weight", shape, make, part)


Maker = tuple[tuple[int, int], Callable[[], torch.Tensor]]


def _maker(cfg: PrequantConfig, prefix: str, parts: dict[str, torch.Tensor]) -> Maker:
    if cfg.method == "gptq":
        return _gptq(cfg, prefix, parts)
    if cfg.method == "awq":
        return _awq(cfg, prefix, parts)
    if "weight_packed" in parts:
        return _ct_packed(cfg, prefix, parts)
    return _scaled(cfg, prefix, parts)


def _gptq(cfg: PrequantConfig, prefix: str, p: dict[str, torch.Tensor]) -> Maker:
    """AutoGPTQ's layout: ``qweight`` [in * bits / 32, out] packs inputs down the rows,
    ``qzeros`` [groups, out * bits / 32] outputs along the row, ``scales`` [groups, out]."""
    assert cfg.bits is not None
    bits, qweight, scales = cfg.bits, _int32(prefix, "qweight", p), p["scales"]
    n_in, n_out = qweight.shape[0] * 32 // bits, qweight.shape[1]
    _expect(prefix, "scales", scales, (None, n_out))

    def make() -> torch.Tensor:
        codes = _unpack(qweight.t(), bits, n_in)  # [out, in]
        zeros = _unpack(_int32(prefix, "qzeros", p), bits, n_out).to(torch.int32) \
            + cfg.zero_offset  # [g, out]; 8-bit v1 zeros reach 256
        _expect(prefix, "qzeros", zeros, tuple(scales.shape))
        cols = _group_index(prefix, p.get("g_idx"), cfg.group_size, n_in, scales.shape[0])
        return _grouped(codes, zeros.t(), scales.t(), cols)

    return (n_out, n_in), make


def _awq(cfg: PrequantConfig, prefix: str, p: dict[str, torch.Tensor]) -> Maker:
    """AutoAWQ's GEMM layout: ``qweight`` [in, out / 8] and ``qzeros`` [groups, out / 8]
    pack outputs along the row in AWQ's interleaved order; ``scales`` [groups, out]."""
    qweight, scales = _int32(prefix, "qweight", p), p["scales"]
    n_in, n_out = qweight.shape[0], qweight.shape[1] * 8
    _expect(prefix, "scales", scales, (None, n_out))

    def make() -> torch.Tensor:
        codes = _awq_order(_unpack(qweight, 4, n_out))  # [in, out]
        zeros = _awq_order(_unpack(_int32(prefix, "qzeros", p), 4, n_out))
        _expect(prefix, "qzeros", zeros, tuple(scales.shape))
        rows = _group_index(prefix, None, cfg.group_size, n_in, scales.shape[0])
        return _grouped(codes.t(), zeros.t(), scales.t(), rows)

    return (n_out, n_in), make


def _ct_packed(cfg: PrequantConfig, prefix: str, p: dict[str, torch.Tensor]) -> Maker:
    """compressed-tensors' ``pack-quantized``: signed codes offset by ``2**(bits-1)`` and
    packed densely along each row of ``weight_packed``; an asymmetric scheme's zero
    points packed the same way down the columns."""
    scheme = cfg.scheme_for(prefix)
    bits = scheme.num_bits
    n_out, n_in = (int(v) for v in p["weight_shape"].tolist())
    packed = _int32(prefix, "weight_packed", p)
    _expect(prefix, "weight_packed", packed, (n_out, -(-n_in * bits // 32)))
    offset = 1 << (bits - 1)

    def make() -> torch.Tensor:
        # The codes stay unsigned; the offset joins the zero point (one subtraction).
        codes = _unpack(packed, bits, n_in)
        zp = p.get("weight_zero_point")
        if zp is not None and zp.dtype == torch.int32 and scheme.strategy in ("group",
                                                                               "channel"):
            zp = _unpack(zp.t().contiguous(), bits, n_out).t()
        elif zp is not None:
            zp = zp.to(torch.float32) + offset
        else:
            zp = torch.full((1, 1), float(offset))
        return _ct_dequant(prefix, scheme.strategy, scheme.group_size, scheme.block, codes,
                           p["weight_scale"], zp, p.get("weight_g_idx"))

    return (n_out, n_in), make


def _scaled(cfg: PrequantConfig, prefix: str, p: dict[str, torch.Tensor]) -> Maker:
    """A whole ``weight`` of int8 or fp8 codes with a scale (compressed-tensors' int /
    float formats; fp8's ``weight_scale_inv`` per block or ``weight_scale``); a weight
    already in full precision ("frozen" status) passes as it is."""
    weight = p["weight"]
    scale = p.get("weight_scale", p.get("weight_scale_inv"))
    assert scale is not None and weight.dim() == 2
    shape = (int(weight.shape[0]), int(weight.shape[1]))
    if weight.dtype not in _NARROW:
        return shape, lambda: weight
    if cfg.method == "fp8":
        strategy = "block" if cfg.block else _strategy_of(scale, shape[0])
        group, block, zp = None, cfg.block, None
    else:
        scheme = cfg.scheme_for(prefix)
        strategy, group, block = scheme.strategy, scheme.group_size, scheme.block
        zp = p.get("weight_zero_point")
    return shape, lambda: _ct_dequant(prefix, strategy, group, block, weight, scale, zp,
                                      p.get("weight_g_idx"))


def _ct_dequant(prefix: str, strategy: str, group_size: int | None,
                block: tuple[int, int] | None, codes: torch.Tensor, scale: torch.Tensor,
                zp: torch.Tensor | None, g_idx: torch.Tensor | None) -> torch.Tensor:
    """``(codes - zp) * scale`` with the scale (and zero point) spread to each weight."""
    n_out, n_in = codes.shape
    shift = zp if zp is not None and zp.shape == (1, 1) else None  # pack-quantized's offset
    if strategy == "tensor":
        spread = lambda t: t.reshape(()).expand(n_out, n_in)  # noqa: E731
    elif strategy == "channel":
        spread = lambda t: t.reshape(n_out, 1).expand(n_out, n_in)  # noqa: E731
    elif strategy == "block":
        assert block is not None
        rows, cols = torch.arange(n_out) // block[0], torch.arange(n_in) // block[1]
        _expect(prefix, "weight scale", scale, (int(rows[-1]) + 1, int(cols[-1]) + 1))
        spread = lambda t: t[rows][:, cols]  # noqa: E731
    else:
        n_groups = scale.shape[-1]
        cols = _group_index(prefix, g_idx, group_size or -(-n_in // n_groups), n_in, n_groups)
        _expect(prefix, "weight_scale", scale, (n_out, n_groups))
        return _grouped(codes, zp if shift is None else shift.expand(n_out, n_groups), scale,
                        cols)
    values = codes.to(torch.float32)
    if zp is not None:
        values = values - (shift if shift is not None else spread(zp.to(torch.float32)))
    return _scale(values, spread(scale))


def _strategy_of(scale: torch.Tensor, n_out: int) -> str:
    return "tensor" if scale.numel() == 1 else "channel" if scale.numel() == n_out else "block"


def _grouped(codes: torch.Tensor, zeros: torch.Tensor | None, scale: torch.Tensor,
             groups: torch.Tensor | int) -> torch.Tensor:
    """``(codes - zeros) * scale`` for codes ``[rows, n]`` whose inputs fall in groups
    (``zeros`` / ``scale`` ``[rows, groups]``): runs of an ``int`` size (the last one
    whole) broadcast over a grouped view, an index (act-order) gathers per input. In
    place on one fp32 copy of the codes: with ``_unpack``'s byte split, a 4096 x 14,336
    GPTQ projection dequantises in 0.18 s on the 2-core box (2.65 s gathering per
    input from int32 codes), so a 7B model's load gains about 20 s, not 5 minutes."""
    rows, n = codes.shape
    out = codes.to(torch.float32, memory_format=torch.contiguous_format)
    if isinstance(groups, int):
        view = out.view(rows, n // groups, groups)
        if zeros is not None:
            view.sub_(zeros.to(torch.float32).unsqueeze(-1))
        view.mul_(scale.to(torch.float32).unsqueeze(-1))
    else:
        if zeros is not None:
            out.sub_(zeros.to(torch.float32)[:, groups])
        out.mul_(scale.to(torch.float32)[:, groups])
    return out.to(scale.dtype) if scale.dtype.is_floating_point else out


def _scale(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``values * scale`` rounded once to the scale's dtype (the product of a small integer
    and a 16-bit scale is exact in fp32, so this is the reference's 16-bit product)."""
    out = values.to(torch.float32) * scale.to(torch.float32)
    return out.to(scale.dtype) if scale.dtype.is_floating_point else out


def _unpack(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The ``count`` codes of ``bits`` bits packed little-end first along each row of an
    int32 ``words`` (code ``e`` at bit ``e * bits`` of the row; codes of 3, 5, 6 or 7 bits
    straddle words): uint8 for 1, 2, 4 or 8 bits (split from the words' bytes on a
    little-endian host, 2x faster than shifting whole words), else int32."""
    if 8 % bits == 0 and sys.byteorder == "little":
        per = 8 // bits
        data = words.contiguous().view(torch.uint8)  # [..., 4 * words], in code order
        if per == 1:
            return data[..., :count]
        mask = (1 << bits) - 1
        codes = torch.stack([(data >> (bits * i)) & mask for i in range(per)], dim=-1)
        return codes.reshape(*words.shape[:-1], -1)[..., :count]
    if 32 % bits == 0:
        shifts = torch.arange(0, 32, bits, dtype=torch.int32)
        codes = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
        return codes.reshape(*words.shape[:-1], -1)[..., :count]
    bit_of = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    flat = bit_of.reshape(*words.shape[:-1], -1)[..., :count * bits]
    weights = torch.tensor([1 << k for k in range(bits)], dtype=torch.int32)
    return (flat.reshape(*words.shape[:-1], count, bits) * weights).sum(-1, dtype=torch.int32)


def _awq_order(codes: torch.Tensor) -> torch.Tensor:
    """Columns of AutoAWQ's packed order back in their own order."""
    rows, n = codes.shape
    return codes.reshape(rows, n // 8, 8)[..., list(_AWQ_REVERSE_ORDER)].reshape(rows, n)


def _group_index(prefix: str, g_idx: torch.Tensor | None, group_size: int, n_in: int,
                 n_groups: int) -> torch.Tensor | int:
    """Each input's group: the checkpoint's ``g_idx`` (act-order GPTQ), else consecutive
    runs of ``group_size`` (-1: one group). Runs that tile the inputs come back as their
    size (``_grouped``'s fast path), an act-order file's trivial ``g_idx`` included."""
    size = n_in if group_size == -1 else group_size
    if g_idx is not None:
        if tuple(g_idx.shape) != (n_in,):
            raise ValueError(f"{prefix}: group index has shape {tuple(g_idx.shape)}, "
                             f"expected ({n_in},)")
        cols = g_idx.to(torch.long)
    else:
        cols = torch.arange(n_in) // size
    if n_in and (int(cols.min()) < 0 or int(cols.max()) >= n_groups):
        raise ValueError(f"{prefix}: inputs fall in groups outside the {n_groups} scales "
                         f"(group_size {group_size})")
    if size > 0 and n_in == size * n_groups and torch.equal(cols, torch.arange(n_in) // size):
        return size
    return cols


def _int32(prefix: str, part: str, p: dict[str, torch.Tensor]) -> torch.Tensor:
    t = p[part]
    if t.dtype != torch.int32 or t.dim() != 2:
        raise ValueError(f"{prefix}.{part} must be a 2-D int32 tensor, got {t.dtype} "
                         f"{tuple(t.shape)}")
    return t


def _expect(prefix: str, part: str, t: torch.Tensor, shape: tuple[int | None, ...]) -> None:
    if len(t.shape) != len(shape) or any(s is not None and s != d
                                         for s, d in zip(shape, t.shape, strict=True)):
        raise ValueError(f"{prefix}: {part} has shape {tuple(t.shape)}, expected "
                         f"{tuple('*' if s is None else s for s in shape)}")
