"""Fused row ops on the native CPU library: RMSNorm with its residual add,
SiLU-and-multiply and RoPE (``cpu_fused_ops.c``).

Why: each is one pass per row where torch makes two to seven ops, each reading and
writing the whole activation; at decode the model runs them on every layer's rows.
Every op answers None when its tensors are not for it (dtype, device, strides,
shapes, or no library: ``cpu_native.load``) and the caller runs its torch path.
"""

from __future__ import annotations

import ctypes

import torch

from pagedserve.kernels import cpu_native


def _fused_lib(*ts: torch.Tensor | None, dtypes: tuple[torch.dtype, ...] = (torch.float32,)
               ) -> ctypes.CDLL | None:
    """The library when every given tensor is on the CPU with one dtype among ``dtypes``
    and it is built, else None."""
    given = [t for t in ts if t is not None]
    dtype = given[0].dtype if given else None
    if dtype in dtypes and all(t.device.type == "cpu" and t.dtype == dtype for t in given):
        return cpu_native._loaded()
    return None


_ROW_DTYPES = (torch.float32, torch.bfloat16)


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
             eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(norm(x + residual) * weight, x + residual)`` in one pass per row.

    None when these tensors are not for the native op (not CPU fp32 or bf16
    2-D, or no library): the caller runs its torch path. Row sums are fp32, as
    in transformers' LlamaRMSNorm.
    """
    if x.dim() != 2 or x.stride(1) != 1:
        return None
    m, h = x.shape
    if weight.shape != (h,) or (residual is not None and residual.shape != x.shape):
        return None
    lib = _fused_lib(x, residual, weight, dtypes=_ROW_DTYPES)
    if lib is None:
        return None
    weight = weight.contiguous()
    out = torch.empty((m, h), dtype=x.dtype)
    new_res = x
    res_ptr = res_out_ptr = None
    if residual is not None:
        residual = residual.contiguous()
        new_res = torch.empty((m, h), dtype=x.dtype)
        res_ptr, res_out_ptr = residual.data_ptr(), new_res.data_ptr()
    fn = lib.rms_norm_bf16 if x.dtype == torch.bfloat16 else lib.rms_norm_f32
    fn(x.data_ptr(), x.stride(0), res_ptr, res_out_ptr, weight.data_ptr(), out.data_ptr(), m,
       h, float(eps), torch.get_num_threads())
    return out, new_res


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` rows, in one pass; None if not
    for the native op (the caller runs its torch path)."""
    if gate_up.dim() != 2 or gate_up.stride(1) != 1 or gate_up.shape[1] % 2:
        return None
    lib = _fused_lib(gate_up)
    if lib is None:
        return None
    m, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((m, i), dtype=gate_up.dtype)
    lib.silu_and_mul_f32(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), m, i,
                         torch.get_num_threads())
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """Rotary embedding of ``x [T, H, D]`` (heads contiguous within a token, tokens any
    stride) with ``cos``/``sin`` ``[T, 1, D/2]``, into a new contiguous tensor (fp32 or
    bf16, computed in fp32); None if not for the native op (the caller runs its torch
    path)."""
    if x.dim() != 3 or x.stride(2) != 1 or x.stride(1) != x.shape[2] or x.shape[2] % 2:
        return None
    t, h, d = x.shape
    if cos.shape != (t, 1, d // 2) or sin.shape != cos.shape:
        return None
    lib = _fused_lib(x, cos, sin, dtypes=_ROW_DTYPES)
    if lib is None:
        return None
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty((t, h, d), dtype=x.dtype)
    fn = lib.rope_bf16 if x.dtype == torch.bfloat16 else lib.rope_f32
    fn(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), t, h, d,
       torch.get_num_threads())
    return out
