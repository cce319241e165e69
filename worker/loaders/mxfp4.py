"""MXFP4 expert weights (OpenAI's gpt-oss releases), dequantised as the model loads them.

A gpt-oss checkpoint (``quantization_config: {"quant_method": "mxfp4"}``) stores each
layer's routed experts as two uint8 tensors per projection instead of the dense one:
``<prefix>_blocks`` ``[E, out, in / 32, 16]`` (FP4 E2M1 codes, two to a byte, low nibble
first, along the inputs) and ``<prefix>_scales`` ``[E, out, in / 32]`` (one e8m0 exponent
per 32 inputs: ``2 ** (s - 127)``). Everything else (attention, router, embeddings,
the experts' biases) is plain. We have no MXFP4 kernels, so ``mxfp4_weights`` pairs the
two parts and hands the model one ``<prefix>`` in the dense layout of transformers' bf16
GptOss checkpoints, ``[E, in, out]`` (``gate_up_proj`` ``[E, H, 2I]`` with gate / up
interleaved along the last dim, ``down_proj`` ``[E, I, H]``): the GPT-OSS model loads
either file through one path.

The values are transformers' ``convert_moe_packed_tensors`` (the oracle, equal bit for
bit in bf16 and fp32). They come out in bf16: every FP4 value times a power of two in
e8m0's range is exact there (3 significant bits, fp32's exponent range), so bf16 loses
nothing against fp32 at half the bytes, and the model copies into its own dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any

import torch

# E2M1's 16 codes: bit 3 the sign, then 2 exponent bits and 1 mantissa bit.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32  # inputs sharing one e8m0 scale (16 bytes of a block)
E8M0_BIAS = 127
PARTS = ("blocks", "scales")
# Each byte's two values (low nibble, then high): one gather per byte, not two.
_PAIRS = torch.tensor([[FP4_VALUES[b & 15], FP4_VALUES[b >> 4]] for b in range(256)],
                      dtype=torch.float32)
# Each e8m0 code's factor, 2 ** (s - 127), exact in fp32 but for 255's 2 ** 128 (e8m0's
# NaN): that code takes 2 ** 127, then twice that, as transformers' ``ldexp`` (0 stays 0,
# the rest overflow to inf).
_SCALES = torch.pow(2.0, torch.arange(256, dtype=torch.int32).clamp(max=254) - E8M0_BIAS)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Blocks ``[E, out, G, 16]`` and scales ``[E, out, G]`` as the dense ``[E, G * 32,
    out]`` in ``dtype``: transformers' ``convert_moe_packed_tensors`` (the FP4 value
    ``ldexp``'d by ``scale - 127`` in fp32, rounded once to ``dtype``), one expert at a
    time so the fp32 scratch is one expert's, not the layer's (a gpt-oss-20b layer's
    ``gate_up_proj``, 530 M values, takes about 4 s on 2 cores; transformers' 9 to 11 s)."""
    n_exp, rows, groups, nbytes = blocks.shape
    out = torch.empty(n_exp, groups * 2 * nbytes, rows, dtype=dtype)
    for e in range(n_exp):
        codes = blocks[e].reshape(-1).to(torch.int32)
        values = _PAIRS.index_select(0, codes).view(rows, groups, 2 * nbytes)
        exps = scales[e].reshape(-1).to(torch.int32)
        values.mul_(_SCALES.index_select(0, exps).view(rows, groups, 1))
        if bool((top := scales[e] == 255).any()):
            values[top] *= 2.0
        out[e].copy_(values.view(rows, -1).to(dtype).t())
    return out


class Mxfp4Weight:
    """One MXFP4 expert projection as the loader's lazy tensor: ``shape`` is the dense
    ``(E, in, out)``. An index that keeps every input (``w[e]``, ``w[a:b]``, ``w[:, :,
    a:b]``: an expert-parallel rank's experts, a tensor-parallel rank's outputs)
    dequantises only what it selects; any other index dequantises the whole projection
    once (later indices read that copy)."""

    def __init__(self, name: str, blocks: torch.Tensor, scales: torch.Tensor,
                 dtype: torch.dtype = torch.bfloat16):
        if blocks.dtype != torch.uint8 or blocks.dim() != 4 or blocks.shape[-1] != GROUP // 2:
            raise ValueError(f"{name}_blocks must be uint8 [experts, out, in / {GROUP}, "
                             f"{GROUP // 2}], got {blocks.dtype} {tuple(blocks.shape)}")
        if scales.dtype != torch.uint8 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
            raise ValueError(f"{name}_scales must be uint8 {tuple(blocks.shape[:-1])} (as "
                             f"{name}_blocks), got {scales.dtype} {tuple(scales.shape)}")
        n_exp, rows, groups, _ = blocks.shape
        self.name, self.dtype = name, dtype
        self.shape = (int(n_exp), int(groups) * GROUP, int(rows))
        self._blocks, self._scales = blocks, scales
        self._dense: torch.Tensor | None = None

    def __getitem__(self, idx: Any) -> torch.Tensor:
        if self._dense is None:
            cut = _experts_and_outputs(idx, self.shape)
            if cut is not None and cut != ((slice(None), False), (slice(None), False)):
                (experts, one_expert), (rows, one_output) = cut
                part = dequantize_mxfp4(self._blocks[experts][:, rows],
                                        self._scales[experts][:, rows], self.dtype)
                part = part[:, :, 0] if one_output else part
                return part[0] if one_expert else part
            self._dense = dequantize_mxfp4(self._blocks, self._scales, self.dtype)
            self._blocks = self._scales = torch.empty(0, dtype=torch.uint8)
        return self._dense[idx]


Cut = tuple[slice, bool]  # what a dim's index selects, and whether it drops the dim (an int)


def _experts_and_outputs(idx: Any, shape: tuple[int, int, int]) -> tuple[Cut, Cut] | None:
    """The experts and outputs an index selects with ints / slices on dims 0 and 2,
    keeping dim 1 (the inputs) whole; None for any other index."""
    parts = idx if isinstance(idx, tuple) else (idx,)
    if len(parts) > 3 or not all(isinstance(p, (int, slice)) and not isinstance(p, bool)
                                 for p in parts):
        return None
    experts, inputs, outputs = (*parts, slice(None), slice(None))[:3]
    if not isinstance(inputs, slice) or inputs.indices(shape[1]) != (0, shape[1], 1):
        return None
    return _cut(experts, shape[0]), _cut(outputs, shape[2])


def _cut(i: int | slice, size: int) -> Cut:
    if isinstance(i, slice):
        return i, False
    if not -size <= i < size:
        raise IndexError(f"index {i} is out of bounds for a dim of size {size}")
    i %= size
    return slice(i, i + 1), True


def packed_projections(names: Collection[str]) -> set[str]:
    """The dense names of the checkpoint's MXFP4 projections (``<prefix>`` of each
    ``<prefix>_blocks`` / ``_scales``); a ``ValueError`` naming the tensor when one of
    a pair is missing, before anything is read."""
    found: dict[str, set[str]] = {}
    for name in names:
        for part in PARTS:
            if name.endswith("_" + part):
                found.setdefault(name[:-len(part) - 1], set()).add(part)
    for prefix, parts in sorted(found.items()):
        if len(parts) != len(PARTS):
            (have,), (lack,) = parts, set(PARTS) - parts
            raise ValueError(f"checkpoint's MXFP4 {prefix}_{have} has no {prefix}_{lack}")
    return set(found)


def mxfp4_weights(weights: Iterable[tuple[str, Any]], names: Collection[str],
                  keep: Callable[[str], bool] | None = None,
                  dtype: torch.dtype = torch.bfloat16) -> Iterator[tuple[str, Any]]:
    """``weights`` with each ``<prefix>_blocks`` / ``<prefix>_scales`` pair replaced by
    one dense ``<prefix>`` (a ``Mxfp4Weight``), everything else as it comes. The packed
    parts are read as they arrive (their file may close before the pair's other half);
    a projection ``keep`` refuses (another pipeline stage's) is never read nor yielded."""
    expected = packed_projections(names)
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, lazy in weights:
        prefix, _, part = name.rpartition("_")
        if prefix not in expected or part not in PARTS:
            yield name, lazy
            continue
        if keep is not None and not keep(prefix):
            continue
        got = pending.setdefault(prefix, {})
        got[part] = lazy[:]
        if len(got) == len(PARTS):
            del pending[prefix]
            yield prefix, Mxfp4Weight(prefix, got["blocks"], got["scales"], dtype)
    if pending:
        prefix, got = next(iter(pending.items()))
        (lack,) = set(PARTS) - got.keys()
        raise ValueError(f"checkpoint's MXFP4 {prefix} lacks {prefix}_{lack} "
                         f"({len(pending)} projection(s) incomplete)")
