"""Triton kernels that write the paged KV cache: store new tokens, copy blocks.

Both move whole rows of ``Hkv * D`` elements, so each program handles one token
(store) or one chunk of one block (copy); the data is never interpreted. The
host quantises new rows to the cache dtype first (``kv_quant.quantize``: torch's
rounding, fp8/fp16 saturating, which a Triton cast would not reproduce on every
device) and hands fp8 tensors over as uint8 views, so these kernels only move
elements and need no fp8 types.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
    stride_kt, stride_vt, stride_kcb, stride_kcs, stride_vcb, stride_vcs, block_size,
    ROW: tl.constexpr, BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        blk = slot // block_size
        pos = slot % block_size
        offs = tl.arange(0, BLOCK)
        mask = offs < ROW
        k = tl.load(key_ptr + t.to(tl.int64) * stride_kt + offs, mask=mask)
        v = tl.load(value_ptr + t.to(tl.int64) * stride_vt + offs, mask=mask)
        tl.store(
            key_cache_ptr + blk * stride_kcb + pos * stride_kcs + offs,
            k.to(key_cache_ptr.dtype.element_ty), mask=mask,
        )
        tl.store(
            value_cache_ptr + blk * stride_vcb + pos * stride_vcs + offs,
            v.to(value_cache_ptr.dtype.element_ty), mask=mask,
        )


@triton.jit
def _copy_blocks_kernel(cache_ptr, pairs_ptr, block_numel, CHUNK: tl.constexpr):
    """cache[dst] = cache[src] for one (pair, chunk); dst blocks must not be sources."""
    p = tl.program_id(0)
    c = tl.program_id(1)
    src = tl.load(pairs_ptr + 2 * p).to(tl.int64)
    dst = tl.load(pairs_ptr + 2 * p + 1).to(tl.int64)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_numel
    x = tl.load(cache_ptr + src * block_numel + offs, mask=mask)
    tl.store(cache_ptr + dst * block_numel + offs, x, mask=mask)
