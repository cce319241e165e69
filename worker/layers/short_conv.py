"""LFM2's gated short convolution over a flat, mixed batch, each sequence's last
inputs in its slot (``worker.mamba_state``; only the convolution part is used).

``B, C, x = in_proj(h)``; the depthwise causal convolution (``layers.causal_conv``:
one-token rows batched, longer rows one sequence at a time after their slot's
inputs) runs over ``B * x``; its output times ``C`` goes through ``out_proj``:
transformers' ``Lfm2ShortConv``, which the tests hold this to. Tensor parallelism
splits the channels (each rank its share of B, C and x, and of the taps), the
row-parallel ``out_proj`` summing the ranks.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.worker.layers.causal_conv import conv_decode, conv_prefill
from pagedserve.worker.layers.linear import (
    LazyTensor,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from pagedserve.worker.layers.mixer_params import check_shape, frozen_param, rank_share
from pagedserve.worker.lfm2_config import ShortConvConfig
from pagedserve.worker.mamba_state import MambaStep
from pagedserve.worker.models.fused_weights import split_rows
from pagedserve.worker.parallel import ParallelContext


class ShortConv(nn.Module):
    """One conv layer; ``state_index`` is its place among this rank's recurrent layers
    (the slot tensors it reads in a ``MambaStep``)."""

    def __init__(self, sc: ShortConvConfig, ctx: ParallelContext, dtype: torch.dtype,
                 device: torch.device, state_index: int = 0) -> None:
        super().__init__()
        tp = ctx.world_size
        if sc.hidden % tp:
            raise ValueError(f"model config field 'hidden_size' ({sc.hidden}) must be "
                             f"divisible by tensor_parallel_size ({tp})")
        self.sc, self.rank, self.state_index = sc, ctx.rank, state_index
        self.width = sc.hidden // tp
        self.in_proj = MergedColumnParallelLinear(sc.hidden, [sc.hidden] * 3, ctx, dtype,
                                                  device, bias=sc.bias)
        self.conv_weight = frozen_param((self.width, sc.d_conv), dtype, device)
        self.conv_bias = frozen_param((self.width,), dtype, device) if sc.bias else None
        self.out_proj = RowParallelLinear(sc.hidden, sc.hidden, sc.bias, ctx, dtype, device)

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """One sequence's slot on this rank: the convolution's last inputs ``[width,
        d_conv - 1]``, and no recurrent matrix (an empty one)."""
        return (self.width, self.sc.d_conv - 1), (0, 0, 0)

    def checkpoint_names(self) -> set[str]:
        """Its tensors, as named under the layer's ``conv.``."""
        names = {"in_proj.weight", "conv.weight", "out_proj.weight"}
        if self.sc.bias:
            names |= {"in_proj.bias", "conv.bias", "out_proj.bias"}
        return names

    def load(self, name: str, lazy: LazyTensor) -> bool:
        """Copy this rank's share of tensor ``name`` (under ``conv.``); False if unknown."""
        sc = self.sc
        bias = name.endswith(".bias")
        if bias and not sc.bias:
            return False
        if name in ("in_proj.weight", "in_proj.bias"):
            for i, rows in enumerate(split_rows(lazy, [sc.hidden] * 3, name)):
                self.in_proj.load(i, rows, bias)
        elif name in ("out_proj.weight", "out_proj.bias"):
            self.out_proj.load(lazy, bias)
        elif name == "conv.weight":
            check_shape(name, lazy, (sc.hidden, 1, sc.d_conv))
            self.conv_weight.data.copy_(rank_share(lazy[:].reshape(sc.hidden, sc.d_conv),
                                                   self.width, self.rank))
        elif name == "conv.bias":
            check_shape(name, lazy, (sc.hidden,))
            self.conv_bias.data.copy_(rank_share(lazy[:], self.width, self.rank))
        else:
            return False
        return True

    def forward(self, x: torch.Tensor, step: MambaStep) -> torch.Tensor:
        """``[T, hidden]`` in, ``[T, hidden]`` out; the rows' slots updated in place."""
        b, c, h = self.in_proj(x).split([self.width] * 3, dim=-1)
        bx = b * h
        conv = step.conv[self.state_index]
        y = torch.empty_like(bx)
        for j, (rows, slots) in enumerate(step.batches):
            out = conv_decode(bx if rows is None else bx[rows], conv, slots,
                              self.conv_weight, self.conv_bias)
            if rows is None:  # every row a single token, in order
                y.copy_(out)
            else:
                y[rows] = out.to(y.dtype)
            step.keep(self.state_index, j)
        for start, n, slot in step.multi:
            y[start:start + n] = conv_prefill(bx[start:start + n], conv, slot,
                                              self.conv_weight, self.conv_bias)
        return self.out_proj(c * y)
