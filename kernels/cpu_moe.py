"""A mixture-of-experts layer's routed experts on CPU in one native call (``cpu_moe.c``).

Why: a decode step hands each expert a few rows, and per expert torch pays
an index-select, two matmuls, the activation, a scale and a scatter-add, at
a few rows each; dozens of experts per layer make that per-call overhead and
the matmuls' poor small-row efficiency the cost (``bench/moe.py``). The
kernel streams each expert's weights once per 4-row block from a layout
packed for it, fuses SiLU-and-multiply into the gate/up product and the
routing weight into the down product, and sums each token's choices in
ascending expert order, the order of Hugging Face's loop. fp32 only.
"""

from __future__ import annotations

import torch

from pagedserve.kernels import cpu_native


def available(device: torch.device, dtype: torch.dtype, hidden: int, width: int) -> bool:
    """Whether the kernel takes experts of this device, dtype and shape (CPU fp32, the
    hidden size and the expert width both multiples of 16)."""
    return (device.type == "cpu" and dtype == torch.float32 and hidden % 16 == 0
            and width % 16 == 0 and cpu_native.load() is not None)


def pack(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w13 [E, 2I, H]`` (gate rows, then up rows) and ``w2 [E, H, I]`` in the kernel's
    tile layout: two ``[E, 2 I H]`` and ``[E, H I]`` fp32 tensors."""
    lib = cpu_native.load()
    if lib is None:
        raise RuntimeError("native CPU kernels are unavailable")
    e, two_i, h = w13.shape
    i = two_i // 2
    if tuple(w2.shape) != (e, h, i) or w13.dtype != torch.float32 or w2.dtype != torch.float32:
        raise ValueError(f"expert weights {tuple(w13.shape)} / {tuple(w2.shape)} do not pair")
    w13, w2 = w13.contiguous(), w2.contiguous()
    p13 = torch.empty((e, two_i * h), dtype=torch.float32)
    p2 = torch.empty((e, h * i), dtype=torch.float32)
    for x in range(e):
        lib.moe_pack_f32(w13[x].data_ptr(), w2[x].data_ptr(), h, i, p13[x].data_ptr(),
                         p2[x].data_ptr())
    return p13, p2


def experts(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, p13: torch.Tensor,
            p2: torch.Tensor) -> torch.Tensor:
    """Sum over each row's ``chosen [T, K]`` experts of ``weights [T, K]`` times the
    expert's SwiGLU of ``x [T, H]`` (fp32, ``x`` rows contiguous)."""
    t, k = chosen.shape
    e, h = p13.shape[0], x.shape[1]
    i = p13.shape[1] // (2 * h)
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offsets = torch.zeros(e + 1, dtype=torch.int64)
    torch.cumsum(torch.bincount(flat, minlength=e), 0, out=offsets[1:])
    rows = order // k
    scales = weights.reshape(-1).to(torch.float32)[order]
    inv = torch.empty_like(order)
    inv[order] = torch.arange(t * k)
    ypairs = torch.empty((t * k, h), dtype=torch.float32)
    out = torch.empty((t, h), dtype=torch.float32)
    x = x if x.stride(1) == 1 else x.contiguous()
    rc = cpu_native._loaded().moe_experts_f32(
        x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), t, h, i, e, k,
        p13.data_ptr(), p2.data_ptr(), offsets.data_ptr(), rows.data_ptr(), scales.data_ptr(),
        inv.data_ptr(), ypairs.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise ValueError("MoE kernel: shapes or routing out of range")
    return out
