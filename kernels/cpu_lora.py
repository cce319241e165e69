"""Multi-LoRA deltas on CPU in one native call per projection (``cpu_lora.c``).

Why: with many adapters of a few rows each (a decode batch spread over 16
adapters), torch pays two small matmuls per adapter per projection, and at
~4 rows per matmul the per-call overhead, not the FLOPs, is the cost (see
``bench/lora.py --num-adapters 16``). The kernel runs a
batch's segments in one OpenMP region, each weight vector it loads feeding
four rows, and never touches an adapter's zero blocks (the q/k/v or gate/up
pieces are separate entries instead of one block-diagonal B).

The weights are kept transposed (``A^T [in, rank]``, ``B^T [rank, width]``)
in fp32 with ``rank`` padded to a multiple of 16 by zero columns/rows, which
adds exact zeros. Activations may be fp32 or bf16 (a bf16 model's): they are
widened on load, the delta is summed in fp32 and added to ``y`` with one
rounding, where torch's bf16 matmuls round the thin intermediate too. A
projection's adapters are a table ``[slots, pieces, 5]`` of int64 (pointers,
rank, first output column, width); ``NativeLoRATable`` owns it and keeps the
tensors it points into alive.
"""

from __future__ import annotations

import torch

from pagedserve.kernels import cpu_native

ENTRY = 5  # A^T pointer, B^T pointer, rank, first output column, width
MAX_RANK = 1024  # MAX_RANK in cpu_lora.c: a piece's padded rank
_DTYPES = (torch.float32, torch.bfloat16)


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the native path serves adapters of this device and model dtype (CPU,
    fp32 or bf16)."""
    return device.type == "cpu" and dtype in _DTYPES and cpu_native.load() is not None


def pad_rank(a_t: torch.Tensor, b_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``A^T [in, r]`` and ``B^T [r, w]`` with ``r`` padded to a multiple of 16."""
    r = a_t.shape[1]
    pad = -r % 16
    if pad:
        a_t = torch.cat([a_t, a_t.new_zeros(a_t.shape[0], pad)], dim=1)
        b_t = torch.cat([b_t, b_t.new_zeros(pad, b_t.shape[1])], dim=0)
    return a_t.contiguous(), b_t.contiguous()


class NativeLoRATable:
    """One projection's adapters as the kernel reads them."""

    def __init__(self, pieces: int, in_features: int, out_features: int) -> None:
        self.pieces = pieces
        self.in_features, self.out_features = in_features, out_features
        self.table = torch.zeros((0, pieces, ENTRY), dtype=torch.int64)
        # Per slot, what the table points at: (A^T, B^T, first column) per piece.
        self.entries: dict[int, list[tuple[torch.Tensor, torch.Tensor, int]]] = {}

    def fits(self, width: int, column: int) -> bool:
        """Whether a piece of ``width`` output columns at ``column`` fits the kernel."""
        return width > 0 and width % 16 == 0 and column >= 0 \
            and column + width <= self.out_features

    def set(self, slot: int, pieces: list[tuple[torch.Tensor, torch.Tensor, int]]) -> None:
        """Slot ``slot``'s adapter: (A^T, B^T, first column) per piece, rank padded."""
        if len(pieces) > self.pieces:
            raise ValueError(f"{len(pieces)} LoRA pieces for a projection of {self.pieces}")
        if slot >= self.table.shape[0]:
            grown = torch.zeros((max(2 * self.table.shape[0], slot + 1), self.pieces, ENTRY),
                                dtype=torch.int64)
            grown[:self.table.shape[0]] = self.table
            self.table = grown
        for p, (a_t, b_t, col) in enumerate(pieces):
            if not self.fits(b_t.shape[1], col) or a_t.shape[1] != b_t.shape[0] \
                    or a_t.shape[0] != self.in_features or a_t.shape[1] % 16 \
                    or a_t.shape[1] > MAX_RANK \
                    or not (a_t.is_contiguous() and b_t.is_contiguous()) \
                    or a_t.dtype != torch.float32 or b_t.dtype != torch.float32:
                raise ValueError(f"LoRA piece {p} does not fit the native layout")
        self.table[slot] = 0
        for p, (a_t, b_t, col) in enumerate(pieces):
            self.table[slot, p] = torch.tensor(
                [a_t.data_ptr(), b_t.data_ptr(), a_t.shape[1], col, b_t.shape[1]])
        self.entries[slot] = list(pieces)

    def clear(self, slot: int) -> None:
        if slot < self.table.shape[0]:
            self.table[slot] = 0
        self.entries.pop(slot, None)

    def apply(self, y: torch.Tensor, x: torch.Tensor, segments: torch.Tensor) -> bool:
        """Add every segment's deltas to ``y`` in place; False (nothing written) when the
        tensors are not for the kernel. ``segments``: int64 ``[n, 3]`` (start, end, slot)."""
        lib = cpu_native._loaded()
        if (lib is None or x.dim() != 2 or y.dim() != 2 or x.dtype not in _DTYPES
                or y.dtype != x.dtype or x.stride(1) != 1 or y.stride(1) != 1
                or x.shape[0] != y.shape[0] or x.shape[1] != self.in_features
                or y.shape[1] != self.out_features
                or x.device.type != "cpu" or y.device.type != "cpu"
                or segments.dtype != torch.int64 or not segments.is_contiguous()):
            return False
        rc = lib.lora_sgmv(x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), x.shape[0],
                           x.shape[1], y.shape[1], segments.data_ptr(), segments.shape[0],
                           self.table.data_ptr(), self.table.shape[0], self.pieces,
                           int(x.dtype == torch.bfloat16), torch.get_num_threads())
        if rc != 0:
            raise ValueError("LoRA segments or adapter table out of range")
        return True
