"""Triton paged attention: one kernel for varlen prefill (with context) and decode.

Each program owns one query tile of one sequence and one KV head. Its rows pack
``BLOCK_M // G`` query positions times the ``G`` query heads that share the KV
head (GQA packing), so each K/V tile is loaded once for the whole group. Keys
are gathered token by token through the block table, so any block size works.
The grid's third axis splits the key range (flash-decoding): with few
sequences a decode batch would otherwise leave most SMs idle; each split
writes an unnormalised partial result plus its running max and sum, and
``_combine_kernel`` merges them.

Math is fp32 (loads are upcast: the interpreter mishandles bf16 arithmetic and
fp32 caches need IEEE dots, not tf32). With 16-bit queries on a GPU the two
dots take the query's dtype to use tensor cores, accumulating in fp32.

fp8 caches (``KV_FP8``) arrive as uint8 bytes and are decoded by integer bit
manipulation in :func:`_widen_kv`: exact, needing no fp8 support in the
compiler or the interpreter, and never forming an fp32 denormal (which a GPU
may flush to zero). A widened fp8 element is exact in fp16, bf16 and fp32, so
the tensor-core path stays exact too. The flag is constexpr: other caches
compile to the same code as before.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # scores run in log2 units: exp(x) = exp2(x log2 e)


@triton.jit
def _widen_kv(x, KV_FP8: tl.constexpr):
    """Cached K/V elements as float: fp8 bytes decoded to fp32 (1: E4M3FN, 2: E5M2),
    any other cache dtype returned as loaded."""
    if KV_FP8 == 1:
        b = x.to(tl.uint32)
        # Normal: shift exponent and mantissa into fp32's fields and rebias (7 -> 127).
        normal = (((b & 0x7F) << 20) + (120 << 23)).to(tl.float32, bitcast=True)
        # Subnormal (exponent 0): m * 2^-9, an fp32 normal, so nothing is flushed.
        sub = (b & 7).to(tl.float32) * 0.001953125
        mag = tl.where((b & 0x78) == 0, sub, normal)
        return tl.where((b & 0x80) != 0, -mag, mag)
    elif KV_FP8 == 2:
        # E5M2 is the high byte of an fp16 (same exponent width and bias).
        return (x.to(tl.uint16) << 8).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        return x


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_ml_ptr, sinks_ptr,
    block_table_ptr, cu_q_ptr, seq_lens_k_ptr, tile_seq_ptr, tile_qoff_ptr,
    scale_log2, softcap_inv, cap_log2, num_q_heads, block_size, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_F32: tl.constexpr, KV_FP8: tl.constexpr,
    SOFTCAP: tl.constexpr = False, SINKS: tl.constexpr = False,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tile_seq_ptr + tile)
    qoff = tl.load(tile_qoff_ptr + tile)
    q_begin = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_begin
    k_len = tl.load(seq_lens_k_ptr + seq)
    shift = k_len - q_len  # bottom-right causal alignment

    r = tl.arange(0, BLOCK_M)
    qi = qoff + r // G  # query index inside the sequence
    head = kvh * G + r % G
    row_ok = (r < BLOCK_Q * G) & (qi < q_len)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    tok = (q_begin + qi).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)

    last_q = tl.minimum(qoff + BLOCK_Q, q_len) - 1
    kv_end = tl.maximum(tl.minimum(k_len, last_q + shift + 1), 0)
    # A sliding window: the tile's first row sees keys from qoff + shift - window + 1 on,
    # so the splits cover [kv_begin, kv_end) and earlier blocks are never read.
    kv_begin = tl.minimum(tl.maximum(qoff + shift - window + 1, 0), kv_end)
    per_split = tl.cdiv(tl.cdiv(kv_end - kv_begin, BLOCK_N), NUM_SPLITS) * BLOCK_N
    lo = kv_begin + split * per_split
    hi = tl.minimum(lo + per_split, kv_end)
    limit = qi + shift  # last visible key per row

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        blk = tl.load(block_table_ptr + seq * stride_bt + n // block_size, mask=n_ok, other=0)
        blk = blk.to(tl.int64)
        in_blk = n % block_size
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = _widen_kv(tl.load(
            k_cache_ptr + (blk * stride_kb + in_blk * stride_ks + kvh * stride_kh)[:, None]
            + d[None, :], mask=kv_mask, other=0,
        ), KV_FP8)
        v = _widen_kv(tl.load(
            v_cache_ptr + (blk * stride_vb + in_blk * stride_vs + kvh * stride_vh)[:, None]
            + d[None, :], mask=kv_mask, other=0,
        ), KV_FP8)
        if DOT_F32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
        if SOFTCAP:  # Gemma 2: cap * tanh(scale * s / cap), tanh from exp (any backend)
            t = s * softcap_inv
            s = (1.0 - 2.0 / (tl.exp(2.0 * t) + 1.0)) * cap_log2
        else:
            s = s * scale_log2
        vis = row_ok[:, None] & n_ok[None, :] & (n[None, :] <= limit[:, None]) & (
            n[None, :] > limit[:, None] - window)
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_F32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        if SINKS:  # the head's sink joins the sum as exp(sink) (log2 units here)
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
            m_fin = tl.maximum(m_i, sink)
            acc = acc * tl.exp2(m_i - m_fin)[:, None]
            l_i = l_i * tl.exp2(m_i - m_fin) + tl.exp2(sink - m_fin)
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty), mask=out_mask,
        )
    else:
        part = (tok * num_q_heads + head) * NUM_SPLITS + split
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=out_mask)
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _combine_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, sinks_ptr, num_q_heads, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, SINKS: tl.constexpr = False,
):
    """Merge split-K partials of one (token, head): rescale by each split's max (and add
    the head's sink to the sum, once)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_P2)
    s_ok = s < NUM_SPLITS
    base = (t * num_q_heads + h) * NUM_SPLITS
    m = tl.load(part_ml_ptr + (base + s) * 2, mask=s_ok, other=float("-inf"))
    l_part = tl.load(part_ml_ptr + (base + s) * 2 + 1, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    if SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32) * LOG2E
        m_max = tl.maximum(m_max, sink)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_safe)
    denom = tl.sum(w * l_part, 0)
    if SINKS:
        denom += tl.exp2(sink - m_safe)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    acc = tl.load(
        part_acc_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :],
        mask=s_ok[:, None] & d_ok[None, :], other=0.0,
    )
    o = tl.sum(acc * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d_ok)


def next_pow2(x: int) -> int:
    """Smallest power of two >= x (Triton block dims must be powers of two)."""
    return triton.next_power_of_2(max(int(x), 1))
