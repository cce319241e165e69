"""Weight quantisation of a loaded model's projections (``quantization="int8"`` or
``"int4"``; on CUDA int4 only, through ``kernels.triton_w4a16``, the LM head and routed
experts left in the model's dtype).

After loading, every projection (q/k/v, o, gate/up, down, the LM head, a
shared expert) keeps its weight as 8-bit codes with a scale per 32 inputs
(``kernels.cpu_int8``; "int4": 4-bit codes with a scale and a minimum per 32,
GGUF Q4_1's scheme, half the bytes again) and drops the full-precision copy,
as vLLM's online quantisation does; the matmuls then run on int8 codes and int8 activations.
A tied embedding keeps its rows for the lookup, and the LM head gets its own
codes. Routed experts (``layers.moe``) are quantised the same way, each
expert's matrices on their own (vLLM's ``experts_int8``); the router and
the norms stay in the model's dtype. Each rank quantises its own shard, so
tensor parallelism needs every rank's share of a row-parallel input to be
whole groups of 32.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from pagedserve.kernels import cpu_int8
from pagedserve.worker.layers.embedding import ParallelLMHead
from pagedserve.worker.layers.moe import SparseMoE
from pagedserve.worker.layers.packed import PackableLinear
from pagedserve.worker.loaders.prequant_config import PrequantConfig

logger = logging.getLogger(__name__)

# int8: symmetric 8-bit codes; int4: 4-bit codes with a per-group minimum (GGUF Q4_1's
# scheme), two to a byte, except the LM head, which keeps 8 bits (as llama.cpp's
# files keep the output matrix wider). Activations are int8 either way; experts take
# int8.
QUANTIZATION_METHODS = ("int8", "int4")
# vLLM's names for a checkpoint's own quantisation: accepted (the file must say so) and
# served as the file's weights, dequantised at load (``loaders.prequant``).
CHECKPOINT_METHODS = ("gptq", "awq", "compressed-tensors", "fp8", "mxfp4")


def check_quantization(method: str | None, device: str | None = None) -> None:
    """Raise a ``ValueError`` naming ``quantization`` for a method or device we cannot run:
    both on CPU; on CUDA int4 only (``kernels.triton_w4a16``)."""
    if method is None or method in CHECKPOINT_METHODS:
        return
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS + CHECKPOINT_METHODS}"
                         f" or None, got {method!r}")
    if device is not None and device != "cpu" and (device != "cuda" or method != "int4"):
        raise ValueError(f"quantization={method!r} runs on CPU only (device {device!r}; "
                         "on CUDA: int4)")


def online_method(method: str | None, prequant: PrequantConfig | None) -> str | None:
    """The quantisation to apply after loading: ``method`` when it is ours (int8 / int4);
    None for a checkpoint method (vLLM's ``--quantization awq``...), which must be the
    file's own (else a ``ValueError`` naming ``quantization``)."""
    if method not in CHECKPOINT_METHODS:
        return method
    found = prequant.method if prequant is not None else None
    if found != method:
        raise ValueError(f"quantization={method!r}, but the checkpoint's quantization_config "
                         f"says {found!r}" if found else
                         f"quantization={method!r}, but the checkpoint is not quantised "
                         "(no quantization_config): use int8 or int4 to quantise it here")
    return None


def quantize_model(model: nn.Module, method: str, shared: set[int] | None = None,
                   skip: set[int] | None = None, prefix: str = "") -> int:
    """Quantise every projection of ``model`` in place; returns the bytes its weights now
    take (codes, scales). ``shared`` holds ``id()`` of weights other modules still read
    (a tied embedding), which are kept; ``skip`` ``id()`` of modules never run (an
    embedding model's LM head), left as they are; ``prefix`` names ``model``'s modules in
    errors (a decoder layer quantised as it loads: ``model.layers.3.``)."""
    check_quantization(method)
    shared, skip = shared or set(), skip or set()
    total = 0
    for name, module in model.named_modules(prefix=prefix.rstrip(".")):
        if (not isinstance(module, PackableLinear) or module.quant is not None
                or id(module) in skip):
            continue
        weight = module.weight.detach()
        if weight.dim() != 2:
            raise ValueError(f"quantization={method!r}: {name} has no plain weight to quantise")
        if weight.shape[1] % cpu_int8.GROUP:
            raise ValueError(f"quantization={method!r}: {name} has {weight.shape[1]} inputs "
                             f"per rank, not a multiple of {cpu_int8.GROUP}")
        if weight.is_cuda:  # int4 codes for the W4A16 GEMM; the LM head stays 16-bit
            check_quantization(method, "cuda")
            if isinstance(module, ParallelLMHead):
                continue
            from pagedserve.kernels import triton_w4a16

            module.quant = triton_w4a16.make(*cpu_int8.quantize_asymmetric4(weight),
                                             dtype=weight.dtype)
        elif method == "int4" and not isinstance(module, ParallelLMHead):
            codes, scale, offs = cpu_int8.quantize_asymmetric4(weight)
            module.quant = cpu_int8.make(codes, scale, 0, offs, bits=4)
        else:
            codes, scale = cpu_int8.quantize_symmetric(weight)
            module.quant = cpu_int8.make(codes, scale, 128)
        total += module.quant.nbytes
        if id(module.weight) not in shared:
            module.weight = nn.Parameter(weight.new_empty((0,)), requires_grad=False)
    for name, module in model.named_modules(prefix=prefix.rstrip(".")):
        if isinstance(module, SparseMoE) and module.int8 is None and module.int8_native is None:
            if module.w13.is_cuda:  # the fused Triton MoE reads 16-bit experts
                logger.info("quantization=%r: %s experts stay in the model's dtype on CUDA",
                            method, name)
                continue
            total += module.quantize(name)
    logger.debug("quantized %s's projections to %s: %.1f MiB", prefix or "the model", method,
                 total / 2**20)
    return total


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and quantised weight the model holds (its resident size)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    for module in model.modules():
        # int8 codes, and copies packed for oneDNN or a native kernel.
        for attr in ("quant", "int8", "int8_native", "packed", "native"):
            total += _nbytes(getattr(module, attr, None))
    return total


def _nbytes(value: object) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    nbytes = getattr(value, "nbytes", 0)  # Int8Weight, GPU int4's W4Weight
    return nbytes if isinstance(nbytes, int) else 0
