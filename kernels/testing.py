"""Builders for paged test batches, shared by the kernel tests and the benchmark.

A batch is built twice: contiguous packed K/V (what the dense oracle reads)
and the same tokens scattered into a paged cache through a block table made of
a random permutation of block ids, so a kernel that ignores the table, reads a
neighbour's block, or reads past a sequence's length gives a wrong answer.
Unused cache slots hold large finite garbage for the same reason.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from pagedserve.kernels.backend import AttentionBackend
from pagedserve.kernels.kv_quant import dequantize, quantize
from pagedserve.kernels.metadata import build_varlen_metadata
from pagedserve.kernels.reference import dense_causal_attention


@dataclass
class PagedBatch:
    """One ragged batch in both contiguous and paged form."""

    q: torch.Tensor  # [Tq, Hq, D]
    k: torch.Tensor  # [Tk, Hkv, D], packed per sequence
    v: torch.Tensor
    key_cache: torch.Tensor  # [num_blocks, B, Hkv, D]
    value_cache: torch.Tensor
    block_table: torch.Tensor  # int32 [S, max_blocks], -1 padded
    slot_mapping: torch.Tensor  # int64 [Tk], slot of each packed key
    query_lens: list[int]
    key_lens: list[int]


def slots_for(block_table: torch.Tensor, lens: list[int], block_size: int) -> torch.Tensor:
    """Flat slots of positions ``[0, lens[s])`` of every sequence, packed."""
    out = []
    for s, n in enumerate(lens):
        p = torch.arange(n)
        blocks = block_table[s].long()[p // block_size]
        out.append(blocks * block_size + p % block_size)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def make_paged_batch(
    query_lens: list[int],
    key_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    extra_blocks: int = 3,
    garbage: float = 30.0,
    seed: int = 0,
    block_table: list[list[int]] | None = None,
    kv_dtype: torch.dtype | None = None,
) -> PagedBatch:
    """Random q/k/v for the given lengths, K/V scattered into a shuffled paged cache.

    ``kv_dtype`` (default ``dtype``) is the cache's element type; with a narrower
    one, ``k`` and ``v`` are the dequantised cached values, so the dense oracle
    reads exactly what a kernel reads and the fp32 tolerance still applies.
    """
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in key_lens]
    if block_table is None:
        num_blocks = sum(need) + extra_blocks
        perm = torch.randperm(num_blocks, generator=g).tolist()
        width = max([*need, 1])
        rows, i = [], 0
        for n in need:
            rows.append(perm[i : i + n] + [-1] * (width - n))
            i += n
        block_table = rows
    num_blocks = max([b for row in block_table for b in row] + [0]) + 1 + extra_blocks
    bt = torch.tensor(block_table, dtype=torch.int32)
    tq, tk = sum(query_lens), sum(key_lens)

    def rnd(*shape: int, mul: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * mul).to(dtype)

    q = rnd(tq, num_heads, head_dim)
    k = rnd(tk, num_kv_heads, head_dim)
    v = rnd(tk, num_kv_heads, head_dim)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = rnd(*cache_shape, mul=garbage)
    value_cache = rnd(*cache_shape, mul=garbage)
    slots = slots_for(bt, key_lens, block_size)
    key_cache.view(-1, num_kv_heads, head_dim)[slots] = k
    value_cache.view(-1, num_kv_heads, head_dim)[slots] = v
    if kv_dtype is not None and kv_dtype != dtype:
        key_cache, value_cache = quantize(key_cache, kv_dtype), quantize(value_cache, kv_dtype)
        k = dequantize(key_cache.view(-1, num_kv_heads, head_dim)[slots], dtype)
        v = dequantize(value_cache.view(-1, num_kv_heads, head_dim)[slots], dtype)
    dev = torch.device(device)
    return PagedBatch(
        q.to(dev), k.to(dev), v.to(dev), key_cache.to(dev), value_cache.to(dev),
        bt.to(dev), slots.to(dev), list(query_lens), list(key_lens),
    )


def mixed_lengths(block_size: int, seed: int) -> tuple[list[int], list[int]]:
    """Decode rows, no-context prefills and chunked prefills, edge lengths included."""
    rng = random.Random(seed)
    edges = [1, block_size, 2 * block_size, block_size + 1, block_size - 1]
    q_lens, k_lens = [], []
    for k in edges + [rng.randint(1, 3 * block_size) for _ in range(3)]:
        kind = rng.choice(["decode", "prefill", "chunk"])
        q_lens.append(1 if kind == "decode" else k if kind == "prefill" else rng.randint(1, k))
        k_lens.append(k)
    return q_lens, k_lens


def check_against_oracle(
    be: AttentionBackend, b: PagedBatch, tol: float, *, decode: bool, device: str = "cpu",
    window: int | None = None, softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Run one backend on ``b`` and compare with the dense oracle (on CPU)."""
    scale = 1 / math.sqrt(b.q.shape[-1])
    ref = dense_causal_attention(
        b.q.cpu(), b.k.cpu(), b.v.cpu(), b.query_lens, b.key_lens, scale, window, softcap,
        None if sinks is None else sinks.cpu(),
    )
    kw: dict = {"window": window} if softcap is None else {"window": window,
                                                           "softcap": softcap}
    if sinks is not None:
        kw["sinks"] = sinks.to(device)
    if decode:
        seqlens = torch.tensor(b.key_lens, dtype=torch.int32, device=device)
        out = be.decode_attention(b.q, b.key_cache, b.value_cache, b.block_table, seqlens,
                                  scale, **kw)
    else:
        md = build_varlen_metadata(b.query_lens, b.key_lens, device=device)
        out = be.varlen_attention(b.q, b.key_cache, b.value_cache, b.block_table, md, scale,
                                  **kw)
    assert out.shape == b.q.shape and out.dtype == b.q.dtype
    err = (out.cpu().double() - ref.double()).abs().max().item()
    assert err <= tol, f"{be.name}: max abs error {err} > {tol}"
