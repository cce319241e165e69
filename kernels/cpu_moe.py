"""A mixture-of-experts layer's routed experts on CPU in one native call (``cpu_moe.c``).

Why: a decode step hands each expert a few rows, and per expert torch pays
an index-select, two matmuls, the activation, a scale and a scatter-add, at
a few rows each; dozens of experts per layer make that per-call overhead and
the matmuls' poor small-row efficiency the cost (``bench/moe.py``). The
kernel streams each expert's weights once per 4-row block from a layout
packed for it, fuses SiLU-and-multiply into the gate/up product and the
routing weight into the down product, and sums each token's choices in
ascending expert order, the order of Hugging Face's loop. fp32, or bf16
weights and activations (a bf16 model's) widened on load and summed in fp32,
the output rounded once: a decode step's experts are read from memory every
step, so bf16 halves what it waits for.
"""

from __future__ import annotations

import torch

from pagedserve.kernels import cpu_native

_DTYPES = (torch.float32, torch.bfloat16)
GU_TILE, DOWN_TILE = 32, 64  # GU_TILE, DOWN_TILE in cpu_moe.c


def available(device: torch.device, dtype: torch.dtype, hidden: int, width: int) -> bool:
    """Whether the kernel takes experts of this device, dtype and shape (CPU, fp32 or bf16,
    the hidden size and the expert width both multiples of 16)."""
    return (device.type == "cpu" and dtype in _DTYPES and hidden % 16 == 0
            and width % 16 == 0 and cpu_native.load() is not None)


def _tiles(w: torch.Tensor, tile: int) -> list[torch.Tensor]:
    """``w [E, n, k]`` cut along ``n`` into tiles of ``tile`` (then of 16), each transposed
    to ``[E, tiles, k, width]``."""
    e, n, k = w.shape
    full = n // tile * tile
    out = [w[:, :full].reshape(e, -1, tile, k).transpose(2, 3)]
    if full < n:
        out.append(w[:, full:].reshape(e, -1, 16, k).transpose(2, 3))
    return out


def pack(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w13 [E, 2I, H]`` (gate rows, then up rows) and ``w2 [E, H, I]`` in the kernel's
    tile layout, same dtype: ``[E, 2 I H]`` and ``[E, H I]``."""
    e, two_i, h = w13.shape
    i = two_i // 2
    if (tuple(w2.shape) != (e, h, i) or w13.dtype not in _DTYPES or w2.dtype != w13.dtype
            or h % 16 or i % 16):
        raise ValueError(f"expert weights {tuple(w13.shape)} / {tuple(w2.shape)} do not pair")
    gate_up = [torch.cat([g, u], dim=3).reshape(e, -1)
               for g, u in zip(_tiles(w13[:, :i], GU_TILE), _tiles(w13[:, i:], GU_TILE),
                               strict=True)]
    down = [t.reshape(e, -1) for t in _tiles(w2, DOWN_TILE)]
    return torch.cat(gate_up, dim=1).contiguous(), torch.cat(down, dim=1).contiguous()


def route_pairs(chosen: torch.Tensor, weights: torch.Tensor, num_experts: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's (token, expert) pairs sorted by expert, as the native kernels take them:
    (offsets ``[E + 1]``: expert e's pairs are ``offsets[e] .. offsets[e + 1]``, rows
    ``[P]``: each pair's token row, scales ``[P]``: its routing weight in fp32, inv
    ``[T * K]``: the pair of each token's j-th choice). A choice of -1 (an expert another
    rank holds, under expert parallelism) sorts past ``offsets[E]``: the kernels run no
    expert for it and add nothing to its token."""
    t, k = chosen.shape
    flat = chosen.reshape(-1)
    if flat.numel() and int(flat.max()) >= num_experts:
        raise ValueError(f"MoE kernel: routing out of range (expert {int(flat.max())} of "
                         f"{num_experts})")
    flat = torch.where(flat < 0, num_experts, flat)
    order = torch.argsort(flat, stable=True)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64)
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts]
    torch.cumsum(counts, 0, out=offsets[1:])
    inv = torch.empty_like(order)
    inv[order] = torch.arange(t * k)
    return offsets, order // k, weights.reshape(-1).to(torch.float32)[order], inv


def experts(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, p13: torch.Tensor,
            p2: torch.Tensor) -> torch.Tensor:
    """Sum over each row's ``chosen [T, K]`` experts of ``weights [T, K]`` times the
    expert's SwiGLU of ``x [T, H]`` (``x`` in the packed weights' dtype, rows contiguous)."""
    t, k = chosen.shape
    e, h = p13.shape[0], x.shape[1]
    i = p13.shape[1] // (2 * h)
    if x.dtype != p13.dtype or p2.dtype != p13.dtype or x.device.type != "cpu":
        raise ValueError(f"MoE kernel: activations {x.dtype} on {x.device} for {p13.dtype} "
                         "experts")
    offsets, rows, scales, inv = route_pairs(chosen, weights, e)
    ypairs = torch.empty((t * k, h), dtype=torch.float32)
    out = torch.empty((t, h), dtype=x.dtype)
    x = x if x.stride(1) == 1 else x.contiguous()
    rc = cpu_native._loaded().moe_experts(
        x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), t, h, i, e, k,
        p13.data_ptr(), p2.data_ptr(), offsets.data_ptr(), rows.data_ptr(), scales.data_ptr(),
        inv.data_ptr(), ypairs.data_ptr(), int(x.dtype == torch.bfloat16),
        torch.get_num_threads())
    if rc != 0:
        raise ValueError("MoE kernel: shapes or routing out of range")
    return out
