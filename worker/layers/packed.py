"""oneDNN-prepacked weights for CPU matmuls.

On CPU the forward is ~80% GEMM time. oneDNN with a weight reordered once
into its blocked layout runs these shapes 15-25% faster than the MKL path of
``F.linear`` (up to 60% for the LM head at decode batch sizes), so after
loading, every projection keeps a packed copy and, unless the plain weight is
still needed (a tied embedding), drops the plain one. bf16 weights pack too
where the CPU has native bf16 dot products (AVX512-BF16, AMX): 10-25% faster
than bf16 ``F.linear`` at SmolLM2's shapes on a Zen 4, with identical results.
Packing uses internal ``torch.ops.mkldnn`` ops (the ones inductor's CPU
freezing pass emits); anything unexpected at pack time leaves the plain
``F.linear`` path in place.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels import cpu_int8

if TYPE_CHECKING:
    from pagedserve.kernels.triton_w4a16 import W4Weight
    from pagedserve.worker.layers.lora import LoRAWeights

logger = logging.getLogger(__name__)

# Batch size the packed layout is tuned for; any batch size is computed correctly.
PACK_BATCH_HINT = 64


def padded_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                multiple: int) -> torch.Tensor:
    """``fn(x)`` for a row-wise ``fn`` (a GEMM), with ``x``'s rows padded with zeros to
    a multiple of ``multiple`` (at least that many; 0: as they are) and the padding cut
    off again: BLAS libraries pick kernels by the number of rows, so padding makes a
    row's bits independent of how many rows share the call (batch-invariant mode)."""
    rows = x.shape[0]
    if multiple and x.dim() == 2 and (rows < multiple or rows % multiple):
        padded = max(multiple, -(-rows // multiple) * multiple)
        return fn(F.pad(x, (0, 0, 0, padded - rows)))[:rows]
    return fn(x)


class PackableLinear(nn.Module):
    """Base for projections: ``self.weight`` (+ optional ``self.bias``) or a packed copy."""

    packed: torch.Tensor | None = None
    # Set when the engine serves LoRA adapters (``worker.layers.lora``).
    lora: LoRAWeights | None = None
    # Set by ``layers.quant`` when the engine serves int8 / int4 weights.
    quant: cpu_int8.Int8Weight | W4Weight | None = None
    # Set by ``worker.batch_invariant``: the matmul's rows are padded to a multiple of
    # this, so a row's result does not depend on how many rows share the call.
    row_multiple: int = 0

    def with_lora(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``y`` (this module's matmul of ``x``) plus the step's adapter deltas."""
        if self.lora is not None and self.lora.batch.groups:
            self.lora.apply(y, x)
        return y

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return padded_rows(lambda t: self._matmul(t, bias), x, self.row_multiple)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant is not None:
            if isinstance(self.quant, cpu_int8.Int8Weight):
                return cpu_int8.linear(x, self.quant, bias)
            return self.quant.linear(x, bias)  # int4 on CUDA (kernels.triton_w4a16)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        return F.linear(x, self.weight, bias)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor],
               recurse: bool = True) -> PackableLinear:
        """``nn.Module.to`` and its kin move GPU int4 codes too (sleep moves the model
        to host memory and back); CPU int8 weights never leave the host."""
        super()._apply(fn, recurse)
        q = self.quant
        if q is not None and not isinstance(q, cpu_int8.Int8Weight):
            self.quant = replace(q, qweight=fn(q.qweight), scale=fn(q.scale), offs=fn(q.offs))
        return self

    def pack(self, release_plain: bool = True) -> None:
        """Reorder the weight for oneDNN; optionally free the plain copy."""
        weight = self.weight
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
        if release_plain:
            # Keep shape information for introspection without the storage.
            self.weight = nn.Parameter(weight.new_empty((0,)), requires_grad=False)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Packing applies on CPU builds with oneDNN to fp32, and to bf16 where the CPU
    computes bf16 natively (elsewhere oneDNN would emulate it)."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    if dtype == torch.bfloat16:
        native = getattr(ops, "_is_mkldnn_bf16_supported", None)
        if native is None or not native():
            return False
    return hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")


def slow_half_precision(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why a 16-bit model dtype will be slow on this CPU, or None.

    Without native bf16 (AVX512-BF16, AMX) or fp16 dot products, oneDNN and MKL
    emulate them: SmolLM2 in bf16 ran 0.21x fp32's tokens/s on a batch on an AVX2
    EPYC (``bench/quant.py``), so a user who asked for it to save memory is told
    what to use instead."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return None
    ops = torch.ops.mkldnn
    probe = "_is_mkldnn_bf16_supported" if dtype == torch.bfloat16 else \
        "_is_mkldnn_fp16_supported"
    native = getattr(ops, probe, None)
    if native is not None and native():
        return None
    return (f"this CPU has no native {dtype} dot products, so {dtype} matmuls are emulated "
            "and run several times slower than float32; for less memory at speed use "
            "--quantization int8 (or int4) with the default float32")


def pack_model(model: nn.Module, shared: set[int] | None = None) -> bool:
    """Pack every projection of ``model`` after a numerical self-check; False if skipped.

    ``shared`` holds ``id()`` of weights that other modules still read (a tied
    embedding): those modules get a packed copy and keep the plain weight.
    """
    shared = shared or set()
    linears = [m for m in model.modules()
               if isinstance(m, PackableLinear) and m.quant is None]
    # Modules that pack themselves (a mixture's stacked experts, ``layers.moe``).
    stacks = [m for m in model.modules()
              if not isinstance(m, PackableLinear) and callable(getattr(m, "pack", None))]
    dtype = linears[0].weight.dtype if linears else torch.float32
    try:
        x = torch.randn(3, 8).to(dtype)
        probe = torch.randn(5, 8).to(dtype)
        ref = F.linear(x, probe)
        got = torch.ops.mkldnn._linear_pointwise(
            x, torch.ops.mkldnn._reorder_linear_weight(probe, PACK_BATCH_HINT), None, "none",
            [], "")
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        if not torch.allclose(got.float(), ref.float(), atol=tol, rtol=tol):
            raise RuntimeError("packed matmul self-check mismatch")
    except Exception as exc:  # an internal API changed: keep the portable path
        logger.warning("oneDNN weight packing unavailable (%s); using F.linear", exc)
        return False
    for module in linears:
        module.pack(release_plain=id(module.weight) not in shared)
    for module in stacks:
        module.pack()
    return True
