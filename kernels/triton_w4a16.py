"""4-bit weights on a GPU: a Triton GEMM that rebuilds int4 weights tile by tile (W4A16).

``quantization="int4"`` on CUDA. A projection keeps the CPU path's codes (GGUF Q4_1's
scheme per 32 inputs from ``cpu_int8.quantize_asymmetric4``, which keeps a 4-bit
checkpoint's own grid): ``w[n, k] = scale[k // 32, n] * code[n, k] + offs[k // 32, n]``.
Codes are packed eight to an int32 down the input dimension (``qweight [K / 8, N]``, code
``k`` at bits ``4 * (k % 8)`` of word ``k // 8``: GPTQ's layout), scales and minimums are
``[K / 32, N]`` in the activations' dtype, so every load of a tile is contiguous along N.
Each step of the K loop takes 32 inputs (one group: one scale and one minimum per
column), rebuilds those weights in the activations' dtype and multiplies on tensor cores
with fp32 accumulation, as GPTQ's and Marlin's W4A16 kernels do; activations stay in
their dtype (no int8 rounding, unlike the CPU kernel). A decode step reads 4.5 bits a
weight (codes, then a 16-bit scale and minimum per 32) instead of 16.

Tested on CPU through the Triton interpreter (fp32) and compiled for sm_80 / sm_90
without a device (``tests/kernels/_aot_compile.py``); ``bench/gpu_check.sh`` launches it.
Its tiles (16 / 32 / 64 rows x 64 columns x 32 inputs) are untuned. Where the output
tiles alone fill less than one wave of SMs (a few decode rows on a 4,096-wide
projection: 64 tiles on 132 SMs), K is split too, the partial sums added after.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

GROUP = 32  # inputs per scale and minimum, and the K step of the kernel
BLOCK_N = 64


@dataclass(frozen=True)
class W4Weight:
    """A projection's 4-bit codes as the kernel reads them (see the module docstring)."""

    qweight: torch.Tensor  # int32 [K / 8, N]
    scale: torch.Tensor  # [K / 32, N], the activations' dtype
    offs: torch.Tensor  # [K / 32, N]
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scale, self.offs))

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, self, bias)

    def dequantize(self) -> torch.Tensor:
        """The weights ``[N, K]`` in fp32 (tests and references)."""
        shifts = torch.arange(0, 32, 4, device=self.qweight.device, dtype=torch.int32)
        codes = (self.qweight.unsqueeze(1) >> shifts[None, :, None]) & 0xF  # [K/8, 8, N]
        codes = codes.reshape(self.in_features, self.out_features).float()
        groups = torch.arange(self.in_features, device=codes.device) // GROUP
        w = codes * self.scale.float()[groups] + self.offs.float()[groups]
        return w.t().contiguous()


def make(codes: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor,
         dtype: torch.dtype) -> W4Weight:
    """A ``W4Weight`` from codes ``[N, K]`` (0..15) and per-group ``scale`` / ``offs``
    ``[N, K / 32]`` (``cpu_int8.quantize_asymmetric4``'s output), on their device."""
    n, k = codes.shape
    if k % GROUP or tuple(scale.shape) != (n, k // GROUP) or scale.shape != offs.shape:
        raise ValueError(f"codes {tuple(codes.shape)}, scale {tuple(scale.shape)} and offs "
                         f"{tuple(offs.shape)} do not match groups of {GROUP}")
    shifts = torch.arange(0, 32, 4, device=codes.device, dtype=torch.int64)
    words = (codes.to(torch.int64).reshape(n, k // 8, 8) << shifts).sum(-1)
    words = (words - ((words >> 31) << 32)).to(torch.int32)  # two's complement int32
    return W4Weight(words.t().contiguous(), scale.t().to(dtype).contiguous(),
                    offs.t().to(dtype).contiguous(), n, k)


@triton.jit
def _w4a16_kernel(
    x_ptr, q_ptr, s_ptr, o_ptr, b_ptr, y_ptr, M, N, K, k_per_split, stride_xm, stride_ym,
    stride_split, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """y[m, n] = sum_k x[m, k] * (scale[k // 32, n] * code[k, n] + offs[k // 32, n]), over
    program axis 2's ``k_per_split`` inputs (split-K: each split writes its own partial
    sums, ``stride_split`` apart; the bias goes with split 0)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    kk = tl.arange(0, 32)
    shift = (kk % 8) * 4
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    for k0 in range(k_start, k_end, 32):
        ks = k0 + kk
        a = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None],
                    other=0.0)
        words = tl.load(q_ptr + (ks[:, None] // 8).to(tl.int64) * N + cols[None, :],
                        mask=col_ok[None, :], other=0)
        codes = ((words >> shift[:, None]) & 0xF).to(tl.float32)
        g = k0 // 32
        sc = tl.load(s_ptr + g * N + cols, mask=col_ok, other=0.0).to(tl.float32)
        of = tl.load(o_ptr + g * N + cols, mask=col_ok, other=0.0).to(tl.float32)
        w = codes * sc[None, :] + of[None, :]
        if DOT_F32:
            acc += tl.dot(a.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(a, w.to(a.dtype))
    if HAS_BIAS:  # noqa: SIM102 - a constexpr test, then a runtime one (no "and" in Triton)
        if pid_k == 0:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y_ptr = y_ptr + pid_k.to(tl.int64) * stride_split
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def block_m(rows: int) -> int:
    """Rows per tile: the fewest of 16 / 32 / 64 that cover a small batch (decode)."""
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_splits(tiles: int, groups: int, device: torch.device) -> int:
    """K splits for a grid of ``tiles`` output tiles: enough for two programs per SM where
    the tiles alone fill less (few-row decode on a narrow projection), at least 4 groups
    of 32 inputs a split, at most 16 splits; 1 on CPU (the interpreter) or a full grid."""
    if device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    if tiles >= sms:
        return 1
    return max(1, min(16, groups // 4, -(-2 * sms // tiles)))


def linear(x: torch.Tensor, w: W4Weight, bias: torch.Tensor | None = None,
           splits: int | None = None) -> torch.Tensor:
    """``x [..., K] @ W^T (+ bias)`` in ``x``'s dtype, fp32 accumulation; ``splits``
    (default ``num_splits``) cuts K, the partial sums added in fp32 after the kernel."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.in_features)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m, n, k = x2.shape[0], w.out_features, w.in_features
    if not m:
        return x.new_empty((*lead, n))
    bm = block_m(m)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, BLOCK_N)
    groups = k // GROUP
    split = splits or num_splits(tiles, groups, x.device)
    per_split = -(-groups // split) * GROUP
    split = -(-k // per_split)  # no empty split
    if split == 1:
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    else:
        y = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    _w4a16_kernel[(triton.cdiv(m, bm), triton.cdiv(n, BLOCK_N), split)](
        x2, w.qweight, w.scale, w.offs, bias if bias is not None else y, y,
        m, n, k, per_split, x2.stride(0), n, m * n,
        HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=BLOCK_N,
        DOT_F32=x.dtype == torch.float32)
    if split > 1:
        y = y.sum(dim=0).to(x.dtype)
    return y.reshape(*lead, n)
