"""Int8 weights for linear layers: 8-bit codes in groups of 32, int8 activations.

Why: on CPU a decode step reads every weight once, so its time follows the
weights' bytes: codes and a scale per 32 weights take 1.125 bytes a weight
against fp32's 4 and bf16's 2. And quantising the activations too (per row
and group of 32, llama.cpp's scheme, finer than vLLM's per-token W8A8) lets
AVX512-VNNI run 64 multiply-adds an instruction, 4x fp32's FMAs, so large
batches gain as well (``cpu_int8.c``; CPUs with AVX2 but not VNNI run the
same integers through 256-bit byte multiplies, still faster than fp32).

A weight is ``W[n, g*32 + i] = scale[n, g] * (codes[n, g*32 + i] - zero) +
offs[n, g]`` (``offs`` optional): GGUF's Q8_0, Q4_0 and Q4_1 blocks exactly,
and :func:`quantize_symmetric`'s online int8; 4-bit codes (Q4_1's scheme,
:func:`quantize_asymmetric4`) are packed two to a byte and widened in the
kernel, for half the bytes again. :func:`reference` is the same
arithmetic in torch (the integer dot products are exact in fp32), used where
the native kernel cannot run and as the kernel's oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kernels import cpu_native
from pagedserve.kernels.cpu_moe import route_pairs

GROUP = 32
LANES = 16
# Elements per float32 chunk of the reference's integer products (bounds its memory).
_REF_CHUNK = 1 << 24


def native_available() -> bool:
    """Whether the compiled library has an int8 kernel, AVX512-VNNI or AVX2
    (``int8_linear_supported``: 1 or 2)."""
    lib = cpu_native.load()
    return lib is not None and bool(lib.int8_linear_supported())


@dataclass
class Int8Weight:
    """One projection's 8- or 4-bit codes, scales and optional offsets, in the kernel's
    packed layout when ``packed`` (else plain ``[N, K]`` / ``[N, K/32]`` for
    :func:`reference`)."""

    codes: torch.Tensor
    scale: torch.Tensor
    offs: torch.Tensor | None
    zero: int
    out_features: int
    in_features: int
    packed: bool
    bits: int = 8  # 4: codes 0..15, packed two to a byte

    @property
    def nbytes(self) -> int:
        n = self.codes.numel() + 4 * self.scale.numel()
        return n + (4 * self.offs.numel() if self.offs is not None else 0)

    def dequantize(self) -> torch.Tensor:
        """The fp32 ``[N, K]`` weight these codes stand for (tests and fallbacks)."""
        codes, scale, offs = self.codes, self.scale, self.offs
        if self.packed:
            codes, scale, offs = unpack(self)
        n, k = self.out_features, self.in_features
        w = (codes.float() - self.zero).view(n, k // GROUP, GROUP) * scale.unsqueeze(-1)
        if offs is not None:
            w = w + offs.unsqueeze(-1)
        return w.view(n, k)


def quantize_symmetric(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` (K a multiple of 32) as codes ``round(w / s) + 128`` with ``s =
    max|w| / 127`` per 32 inputs: (codes uint8 ``[N, K]``, scale fp32 ``[N, K/32]``)."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"in_features {k} is not a multiple of the group size {GROUP}")
    g = w.detach().float().reshape(n, k // GROUP, GROUP)
    scale = g.abs().amax(dim=-1) / 127.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(g * inv.unsqueeze(-1)).clamp_(-127, 127)
    return (q + 128).to(torch.uint8).reshape(n, k), scale


def quantize_asymmetric4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w [N, K]`` as 4-bit codes per 32 inputs, GGUF Q4_1's scheme: ``round((w - min) /
    s)`` with ``s = (max - min) / 15``: (codes uint8 0..15, scale, offs = min).

    A group whose values already sit on a grid of at most 16 evenly spaced levels (the
    weights of a 4-bit checkpoint: a GPTQ / AWQ group of 128 spans 16 levels, but its
    quarters often fewer) keeps that grid's step instead, so its codes are the
    checkpoint's and nothing is lost to quantising twice (``_on_grid``)."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"in_features {k} is not a multiple of the group size {GROUP}")
    g = w.detach().float().reshape(n, k // GROUP, GROUP)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = (hi - lo) / 15.0
    # Look for grids only where the first rows' groups are mostly on one (a quantised
    # checkpoint's all are): a dense model's weights skip the search.
    if bool((grid_steps(g[:8]) > 0).float().mean() > 0.5):
        step = grid_steps(g)
        scale = torch.where(step > 0, step, scale)
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round((g - lo.unsqueeze(-1)) * inv.unsqueeze(-1)).clamp_(0, 15)
    return q.to(torch.uint8).reshape(n, k), scale, lo


def grid_steps(g: torch.Tensor, native: bool = True) -> torch.Tensor:
    """Each group's (``g [..., 32]``) grid step where its values sit on an evenly spaced
    grid of at most 16 levels, else 0: the native kernel on CPU (``grid_steps4``), else
    torch (a sort per group; on GPUs, and the native kernel's oracle)."""
    lib = cpu_native.load() if native and g.device.type == "cpu" else None
    if lib is not None:
        flat = g.reshape(-1, GROUP).float().contiguous()
        out = torch.empty(flat.shape[0], dtype=torch.float32)
        lib.grid_steps4(flat.data_ptr(), flat.shape[0], out.data_ptr())
        return out.reshape(g.shape[:-1])
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    step = _grid_step(g, lo, hi)
    return torch.where(_on_grid(g, lo, hi, step), step, torch.zeros_like(step))


def _grid_step(g: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Each group's candidate grid step: its span over the levels its smallest gap
    between distinct values implies (inf where every value is the same)."""
    ordered = g.sort(dim=-1).values
    gaps = ordered[..., 1:] - ordered[..., :-1]
    smallest = torch.where(gaps > 0, gaps, torch.full_like(gaps, float("inf"))).amin(dim=-1)
    return (hi - lo) / torch.round((hi - lo) / smallest).clamp(min=1)


def _on_grid(g: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
             step: torch.Tensor) -> torch.Tensor:
    """Whether a group's values are ``lo + step * c`` for whole ``c`` in 0..15, to within
    a 16-bit dequantisation's rounding (a twentieth of a step)."""
    levels = (hi - lo) / step
    pos = (g - lo.unsqueeze(-1)) / step.unsqueeze(-1)
    off = (pos - pos.round()).abs().amax(dim=-1)
    return torch.isfinite(step) & (step > 0) & (levels < 15.5) & (off < 0.05)


def make(codes: torch.Tensor, scale: torch.Tensor, zero: int,
         offs: torch.Tensor | None = None, pack_for_kernel: bool | None = None,
         bits: int = 8) -> Int8Weight:
    """An :class:`Int8Weight` from plain codes ``[N, K]`` and per-group ``scale``/``offs``
    ``[N, K/32]``, packed when the native kernel is there (or as ``pack_for_kernel`` says);
    ``bits`` 4 packs codes 0..15 two to a byte. 4-bit codes are packed by default even
    without the kernel: kept one to a byte they would take more memory than int8's,
    which is the point of choosing them (:func:`reference` unpacks them per call)."""
    n, k = codes.shape
    if k % GROUP or tuple(scale.shape) != (n, k // GROUP):
        raise ValueError(f"codes {tuple(codes.shape)} and scale {tuple(scale.shape)} "
                         f"do not match groups of {GROUP}")
    if offs is not None and tuple(offs.shape) != tuple(scale.shape):
        raise ValueError(f"offs {tuple(offs.shape)} != scale {tuple(scale.shape)}")
    if not 0 <= zero <= 255:
        raise ValueError(f"zero point {zero} is outside 0..255")
    if bits not in (8, 4) or (bits == 4 and (zero > 15 or (codes.numel() and codes.max() > 15))):
        raise ValueError(f"bits must be 8, or 4 with codes and zero point in 0..15 "
                         f"(got {bits})")
    codes, scale = codes.to(torch.uint8).contiguous(), scale.float().contiguous()
    offs = offs.float().contiguous() if offs is not None else None
    if pack_for_kernel is None:
        pack_for_kernel = bits == 4 or native_available()
    w = Int8Weight(codes, scale, offs, zero, n, k, packed=False, bits=bits)
    return pack(w) if pack_for_kernel else w


def pack(w: Int8Weight) -> Int8Weight:
    """The kernel's layout: rows padded to 16 lanes, each (block, group) as 8 vectors of
    16 lanes x 4 codes (4-bit codes: vectors v and v + 4 share 64 bytes, low and high
    nibbles); scales and offsets ``[blocks, groups, 16]``."""
    if w.packed:
        return w
    n, k = w.out_features, w.in_features
    nb, g = -(-n // LANES), k // GROUP
    pad = nb * LANES - n
    codes, scale, offs = w.codes, w.scale, w.offs
    if pad:
        codes = torch.cat([codes, codes.new_full((pad, k), w.zero)])
        scale = torch.cat([scale, scale.new_zeros(pad, g)])
        offs = torch.cat([offs, offs.new_zeros(pad, g)]) if offs is not None else None
    packed = codes.view(nb, LANES, g, 8, 4).permute(0, 2, 3, 1, 4).contiguous()
    if w.bits == 4:  # vector v's codes low, vector v + 4's high
        packed = packed.view(nb, g, 8, 64)
        packed = packed[:, :, :4] | (packed[:, :, 4:] << 4)
    packed = packed.reshape(-1).contiguous()

    def lanes(t: torch.Tensor) -> torch.Tensor:
        return t.view(nb, LANES, g).permute(0, 2, 1).contiguous()

    return Int8Weight(packed, lanes(scale), lanes(offs) if offs is not None else None,
                      w.zero, n, k, packed=True, bits=w.bits)


def unpack(w: Int8Weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Plain (codes ``[N, K]``, scale, offs) of a packed weight."""
    n, k = w.out_features, w.in_features
    nb, g = -(-n // LANES), k // GROUP
    codes = w.codes
    if w.bits == 4:
        halves = codes.view(nb, g, 4, 64)
        codes = torch.cat([halves & 15, halves >> 4], dim=2)
    codes = codes.reshape(nb, g, 8, LANES, 4).permute(0, 3, 1, 2, 4).reshape(nb * LANES, k)

    def plain(t: torch.Tensor) -> torch.Tensor:
        return t.permute(0, 2, 1).reshape(nb * LANES, g)[:n]

    return codes[:n], plain(w.scale), plain(w.offs) if w.offs is not None else None


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row and 32 inputs, as the kernel: (q ``[M, G, 32]`` as floats, sx ``[M, G]``,
    qsum ``[M, G]``) with ``sx = max|x| / 127`` and ``q = round(x * (127 / max|x|))``."""
    m, k = x.shape
    g = x.float().reshape(m, k // GROUP, GROUP)
    amax = g.abs().amax(dim=-1)
    # A true division, as the kernel's: ``127.0 / amax`` would be ``reciprocal(amax) *
    # 127``, which rounds differently and moves values near .5 to the other integer.
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(g * inv.unsqueeze(-1))
    return q, amax / 127.0, q.sum(dim=-1)


def reference(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """``x [M, K]`` times the int8 weight, fp32 ``[M, N]``: the kernel's arithmetic in torch."""
    codes, scale, offs = (unpack(w) if w.packed else (w.codes, w.scale, w.offs))
    n, k = w.out_features, w.in_features
    g = k // GROUP
    q, sx, qsum = quantize_activations(x)
    wc = (codes.float() - w.zero).view(n, g, GROUP)
    out = x.new_empty(x.shape[0], n, dtype=torch.float32)
    chunk = max(1, _REF_CHUNK // max(1, x.shape[0] * g))
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        dots = torch.einsum("mgi,ngi->mng", q, wc[s:e])  # integers, exact in fp32
        y = dots * (scale[s:e].unsqueeze(0) * sx.unsqueeze(1))
        if offs is not None:
            y = y + offs[s:e].unsqueeze(0) * (sx * qsum).unsqueeze(1)
        out[:, s:e] = y.sum(dim=-1)
    return out


def linear(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ W^T (+ bias)`` in ``x``'s dtype, through the kernel when ``w`` is
    packed and the library has it, else :func:`reference`."""
    if x.shape[-1] != w.in_features:
        raise ValueError(f"input has {x.shape[-1]} features, the weight {w.in_features}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.in_features)
    xf = x2.float()
    if xf.stride(-1) != 1:
        xf = xf.contiguous()
    lib = cpu_native._loaded() if w.packed else None  # no lock: this runs per projection
    out = None
    if lib is not None and xf.shape[0] > 0:
        y = torch.empty(xf.shape[0], w.out_features, dtype=torch.float32)
        rc = lib.int8_linear(xf.data_ptr(), xf.stride(0), xf.shape[0], w.in_features,
                             w.codes.data_ptr(), w.scale.data_ptr(),
                             w.offs.data_ptr() if w.offs is not None else None,
                             w.zero, w.out_features, y.data_ptr(), y.stride(0), w.bits)
        if rc == 0:
            out = y
    if out is None:
        out = reference(xf, w)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*lead, w.out_features)


def stack_experts(weights: list[Int8Weight]) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed, symmetric (zero 128) weights of equal shape, one per expert, stacked for
    :func:`moe_experts`: (codes ``[E, ...]``, scales ``[E, ...]``)."""
    first = weights[0]
    if not all(w.packed and w.bits == 8 and w.offs is None and w.zero == 128
               and (w.out_features, w.in_features) == (first.out_features, first.in_features)
               for w in weights):
        raise ValueError("expert weights to stack must be packed, symmetric and alike")
    return (torch.stack([w.codes for w in weights]).contiguous(),
            torch.stack([w.scale.reshape(-1) for w in weights]).contiguous())


def moe_experts(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
                w13: tuple[torch.Tensor, torch.Tensor], w2: tuple[torch.Tensor, torch.Tensor]
                ) -> torch.Tensor:
    """A routed layer's SwiGLU experts on int8 weights in one native call: the sum over
    each row's ``chosen [T, K]`` experts of ``weights [T, K]`` times the expert's
    ``down(silu(gate(x)) * up(x))``, each matmul as :func:`linear` computes it.
    ``w13`` / ``w2``: :func:`stack_experts` of the gate/up ``[2I, H]`` and down
    ``[H, I]`` weights."""
    t, k = chosen.shape
    e, h = w13[0].shape[0], x.shape[1]
    i = w2[1].shape[1] * GROUP // h  # scales per expert: (H / 16) * (I / 32) * 16
    offsets, rows, scales, inv = route_pairs(chosen, weights, e)
    xf = x.float()
    if xf.stride(1) != 1:
        xf = xf.contiguous()
    out = torch.empty((t, h), dtype=torch.float32)
    lib = cpu_native._loaded()
    rc = -1 if lib is None else lib.moe_int8(
        xf.data_ptr(), xf.stride(0), out.data_ptr(), out.stride(0), t, h, i, e, k,
        w13[0].data_ptr(), w13[1].data_ptr(), w2[0].data_ptr(), w2[1].data_ptr(),
        offsets.data_ptr(), rows.data_ptr(), scales.data_ptr(), inv.data_ptr())
    if rc != 0:
        raise ValueError(f"int8 MoE kernel: shapes, top-k {k} or routing out of range "
                         f"(hidden {h}, width {i}, {e} experts)")
    return out.to(x.dtype)
