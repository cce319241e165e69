"""Column- and row-parallel linear layers with shard-aware weight loading.

Each layer knows which slice of a full checkpoint tensor belongs to its rank
and reads only that slice from a lazy tensor (a safetensors ``get_slice``
handle), so a rank never materialises the full weight. Q/K/V and gate/up are
fused into one matmul each because on CPU one large GEMM beats three small
ones by a wide margin.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from pagedserve.worker.layers.packed import PackableLinear
from pagedserve.worker.parallel import ParallelContext


class LazyTensor(Protocol):
    """A checkpoint tensor that is read on indexing (safetensors slice or plain tensor)."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def __getitem__(self, idx: Any) -> torch.Tensor: ...


def _check_shape(name: str, lazy: LazyTensor, expected: tuple[int, ...]) -> None:
    if tuple(lazy.shape) != tuple(expected):
        raise ValueError(f"{name}: checkpoint shape {tuple(lazy.shape)} != expected {expected}")


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def kv_head_range(num_kv_heads: int, ctx: ParallelContext) -> tuple[int, int]:
    """KV heads held by this rank: an even split, or one replicated head when Hkv < world.

    With fewer KV heads than ranks, rank ``r`` holds head ``r // (world / Hkv)``,
    which is exactly the KV head its query heads are grouped with.
    """
    w = ctx.world_size
    if num_kv_heads >= w:
        if num_kv_heads % w:
            raise ValueError(f"num_kv_heads ({num_kv_heads}) is not divisible by TP size {w}")
        n = num_kv_heads // w
        return ctx.rank * n, ctx.rank * n + n
    if w % num_kv_heads:
        raise ValueError(f"TP size {w} is not a multiple of num_kv_heads ({num_kv_heads})")
    head = ctx.rank // (w // num_kv_heads)
    return head, head + 1


class QKVParallelLinear(PackableLinear):
    """Fused q/k/v projection, column-parallel by attention head."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool, ctx: ParallelContext, dtype: torch.dtype, device: torch.device):
        super().__init__()
        if num_heads % ctx.world_size:
            raise ValueError(f"num_heads ({num_heads}) is not divisible by TP size {ctx.world_size}")
        self.hidden, self.head_dim = hidden, head_dim
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.local_heads = num_heads // ctx.world_size
        self.q_start = ctx.rank * self.local_heads
        self.kv_start, kv_end = kv_head_range(num_kv_heads, ctx)
        self.local_kv_heads = kv_end - self.kv_start
        self.q_size = self.local_heads * head_dim
        self.kv_size = self.local_kv_heads * head_dim
        out = self.q_size + 2 * self.kv_size
        self.weight = _param((out, hidden), dtype, device)
        self.bias = _param((out,), dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.with_lora(self.matmul(x, self.bias), x)

    @property
    def weight_out_features(self) -> int:
        return self.q_size + 2 * self.kv_size

    lora_pieces = 3  # q, k, v

    @property
    def lora_in_features(self) -> int:
        return self.hidden

    def _piece_rows(self, shard: str) -> tuple[int, int, int, int]:
        """(full heads, first local head, local heads, output offset) of ``q``/``k``/``v``."""
        if shard == "q":
            return self.num_heads, self.q_start, self.local_heads, 0
        off = self.q_size + (0 if shard == "k" else self.kv_size)
        return self.num_kv_heads, self.kv_start, self.local_kv_heads, off

    def lora_full_shape(self, shard: str) -> tuple[int, int]:
        """(in, out) of the unsharded ``{shard}_proj`` an adapter's A and B must match."""
        return self.hidden, self._piece_rows(shard)[0] * self.head_dim

    def lora_piece(self, shard: str, a: torch.Tensor, b: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """This rank's share of an adapter's ``{shard}_proj``: A whole, B's local heads."""
        _, start, n, off = self._piece_rows(shard)
        d = self.head_dim
        return a, b[start * d:(start + n) * d], off

    def load(self, shard: str, lazy: LazyTensor, is_bias: bool) -> None:
        """Copy this rank's heads of the full ``{q,k,v}_proj`` tensor into the fused param."""
        d = self.head_dim
        full, start, n, off = self._piece_rows(shard)
        target = self.bias if is_bias else self.weight
        if target is None:
            raise ValueError(f"checkpoint has a {shard}_proj bias but the config says no bias")
        expected = (full * d,) if is_bias else (full * d, self.hidden)
        _check_shape(f"{shard}_proj", lazy, expected)
        target.data[off:off + n * d].copy_(lazy[start * d:(start + n) * d])


class MergedColumnParallelLinear(PackableLinear):
    """Several column-parallel outputs in one matmul (gate and up projections), with an
    optional bias (ModernBERT's ``Wi`` may have one)."""

    def __init__(self, in_features: int, out_features: list[int], ctx: ParallelContext,
                 dtype: torch.dtype, device: torch.device, bias: bool = False):
        super().__init__()
        for o in out_features:
            if o % ctx.world_size:
                raise ValueError(f"output size {o} is not divisible by TP size {ctx.world_size}")
        self.in_features = in_features
        self.full_sizes = out_features
        self.local_sizes = [o // ctx.world_size for o in out_features]
        self.rank = ctx.rank
        self.weight = _param((sum(self.local_sizes), in_features), dtype, device)
        self.bias = _param((sum(self.local_sizes),), dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.with_lora(self.matmul(x, self.bias), x)

    @property
    def weight_out_features(self) -> int:
        return sum(self.local_sizes)

    @property
    def lora_pieces(self) -> int:
        return len(self.local_sizes)

    @property
    def lora_in_features(self) -> int:
        return self.in_features

    def lora_full_shape(self, index: int) -> tuple[int, int]:
        return self.in_features, self.full_sizes[index]

    def lora_piece(self, index: int, a: torch.Tensor, b: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """This rank's share of output ``index``'s adapter: A whole, B's local rows."""
        n = self.local_sizes[index]
        return a, b[self.rank * n:(self.rank + 1) * n], sum(self.local_sizes[:index])

    def load(self, index: int, lazy: LazyTensor, is_bias: bool = False) -> None:
        """Copy this rank's rows of output ``index``'s full weight (or bias)."""
        target = self.bias if is_bias else self.weight
        if target is None:
            raise ValueError(f"checkpoint has a bias for merged[{index}] but the layer has "
                             "none")
        full = self.full_sizes[index]
        _check_shape(f"merged[{index}]", lazy, (full,) if is_bias else (full, self.in_features))
        n = self.local_sizes[index]
        off = sum(self.local_sizes[:index])
        target.data[off:off + n].copy_(lazy[self.rank * n:(self.rank + 1) * n])


class ColumnParallelLinear(PackableLinear):
    """One output-dim-sharded projection with an optional bias (an encoder's MLP input):
    each rank holds its rows, and the row-parallel projection after it sums them."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ctx: ParallelContext,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        if out_features % ctx.world_size:
            raise ValueError(f"output size {out_features} is not divisible by TP size "
                             f"{ctx.world_size}")
        self.in_features, self.out_features = in_features, out_features
        self.local_out = out_features // ctx.world_size
        self.rank = ctx.rank
        self.weight = _param((self.local_out, in_features), dtype, device)
        self.bias = _param((self.local_out,), dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.with_lora(self.matmul(x, self.bias), x)

    @property
    def weight_out_features(self) -> int:
        return self.local_out

    lora_pieces = 1

    @property
    def lora_in_features(self) -> int:
        return self.in_features

    def lora_full_shape(self, piece: None) -> tuple[int, int]:
        return self.in_features, self.out_features

    def lora_piece(self, piece: None, a: torch.Tensor, b: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """This rank's share of an adapter: A whole, B's local rows."""
        n = self.local_out
        return a, b[self.rank * n:(self.rank + 1) * n], 0

    def load(self, lazy: LazyTensor, is_bias: bool = False) -> None:
        """Copy this rank's rows of the full weight (or bias)."""
        target = self.bias if is_bias else self.weight
        if target is None:
            raise ValueError("checkpoint has a bias but the layer has none")
        expected = (self.out_features,) if is_bias else (self.out_features, self.in_features)
        _check_shape("column bias" if is_bias else "column weight", lazy, expected)
        n = self.local_out
        target.data.copy_(lazy[self.rank * n:(self.rank + 1) * n])


class RowParallelLinear(PackableLinear):
    """Input-dim-sharded linear whose partial sums are all-reduced across ranks.

    The bias is added once, after the reduction, so it is not counted
    ``world_size`` times.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, ctx: ParallelContext,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        if in_features % ctx.world_size:
            raise ValueError(f"input size {in_features} is not divisible by TP size "
                             f"{ctx.world_size}")
        self.ctx = ctx
        self.in_features, self.out_features = in_features, out_features
        self.local_in = in_features // ctx.world_size
        self.weight = _param((out_features, self.local_in), dtype, device)
        self.bias = _param((out_features,), dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.ctx.all_reduce(self.with_lora(self.matmul(x), x))
        if self.bias is not None:
            out = out + self.bias
        return out

    @property
    def weight_out_features(self) -> int:
        return self.out_features

    lora_pieces = 1

    @property
    def lora_in_features(self) -> int:
        return self.local_in

    def lora_full_shape(self, piece: None) -> tuple[int, int]:
        return self.in_features, self.out_features

    def lora_piece(self, piece: None, a: torch.Tensor, b: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """This rank's share of an adapter: A's local input columns, B whole; the
        partial deltas add up in the all-reduce like the base matmul's."""
        r = self.ctx.rank
        return a[:, r * self.local_in:(r + 1) * self.local_in], b, 0

    def load(self, lazy: LazyTensor, is_bias: bool = False) -> None:
        if is_bias:
            if self.bias is None:
                raise ValueError("checkpoint has an o_proj bias but the config says no bias")
            _check_shape("row bias", lazy, (self.out_features,))
            self.bias.data.copy_(lazy[:])
            return
        _check_shape("row weight", lazy, (self.out_features, self.in_features))
        r = self.ctx.rank
        self.weight.data.copy_(lazy[:, r * self.local_in:(r + 1) * self.local_in])
