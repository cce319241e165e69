"""Triton backend: host-side planning and launches for the kernels in triton_*.py.

Importing this module imports triton; ``get_backend("triton")`` does so only on
request. On CPU the kernels run under ``TRITON_INTERPRET=1`` (tests only).
Planning avoids device synchronisation: decode builds its tile map on the
device and bounds the context by the block table's width; varlen uses the
host length lists carried by :class:`VarlenMetadata`.
"""

from __future__ import annotations

import math
import os

import torch
import triton

from pagedserve.kernels.backend import AttentionBackend
from pagedserve.kernels.kv_quant import quantize, storage_view
from pagedserve.kernels.metadata import VarlenMetadata
from pagedserve.kernels.triton_attention import (
    _combine_kernel,
    _paged_attention_kernel,
    next_pow2,
)
from pagedserve.kernels.triton_cache import _copy_blocks_kernel, _store_kv_kernel

_LOG2E = 1.4426950408889634
_MIN_KEYS_PER_SPLIT = 256
# Launch settings ``bench/kernels.py --sweep`` times on a GPU, as (block_n, num_warps,
# num_stages), likelier winners for bandwidth-bound decode first (a time limit may cut
# the sweep short); every one compiles for sm_90 (tests/kernels/_aot_compile.py).
LAUNCH_SWEEP = tuple((n, w, s) for n in (64, 128, 32) for w in (4, 8) for s in (3, 4, 2))
# Decode fills the GPU at this many programs per multiprocessor. Launches that reach it
# take two pipeline stages: less shared memory per program, more programs resident. On
# an H200 (bench/figures/sweep_h200.json, 3 KV heads) that ran 1.39x / 1.35x faster at
# 256 sequences of 8192 / 2048 keys (5.8 waves) and 0.93x / 0.97x at 64 (1.5 waves).
DECODE_FULL_WAVES = 4
# Decode grids between one and DECODE_FULL_WAVES waves split K up to that many waves,
# each split keeping at least this many keys (the combine launch must stay small beside
# it). Why: 64 sequences x 8192 keys unsplit is 192 programs of 8192 keys and ran at 35%
# of HBM; split 4 it is 768 programs of <= 2048 keys, the grid and per-program work of
# 256 x 2048 unsplit, which ran at 69-71% with two stages (same bytes read).
_MIN_KEYS_PER_FILL_SPLIT = 1024
# The attention kernel's KV_FP8 flag: fp8 caches arrive as uint8 bytes, decoded in-kernel.
_KV_FP8 = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
# The kernel's window when there is none: wider than any context, small enough that
# ``position - window`` stays inside int32.
_NO_WINDOW = 1 << 30


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class TritonBackend(AttentionBackend):
    """Paged attention with Triton kernels (CUDA; CPU via the interpreter).

    ``num_splits`` forces the split-K factor (tests use it to exercise the
    combine path); ``None`` picks it from the grid size and context length.
    ``block_n`` (keys per loop step), ``num_warps`` and ``num_stages`` (software
    pipelining depth) override the launch defaults: ``bench/kernels.py --sweep``
    times the candidates on a GPU.
    """

    name = "triton"

    def __init__(self, device: torch.device | str = "cuda", num_splits: int | None = None,
                 block_n: int | None = None, num_warps: int | None = None,
                 num_stages: int | None = None) -> None:
        super().__init__(device)
        self.num_splits = num_splits
        for name, v in (("block_n", block_n), ("num_warps", num_warps)):
            if v is not None and (v < 1 or v & (v - 1)):
                raise ValueError(f"{name} must be a power of two, got {v}")
        if block_n is not None and block_n < 16:
            raise ValueError(f"block_n must be >= 16 (tl.dot's minimum), got {block_n}")
        if num_stages is not None and num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {num_stages}")
        self.block_n, self.num_warps, self.num_stages = block_n, num_warps, num_stages
        self._num_sms: int | None = None

    # ---------------------------------------------------------------- cache ops
    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        t = slot_mapping.numel()
        if t == 0:
            return
        _, bsz, hkv, d = key_cache.shape
        for c in (key_cache, value_cache):
            if c.stride(2) != d or c.stride(3) != 1:
                raise ValueError("cache heads and head_dim must be contiguous")
        # Rounding on the host (a no-op when the dtypes match) keeps stores bit-identical
        # to quantize() on every device; fp8 then travels as bytes.
        key = storage_view(_rows_contiguous(quantize(key.reshape(t, hkv, d), key_cache.dtype)))
        value = storage_view(
            _rows_contiguous(quantize(value.reshape(t, hkv, d), value_cache.dtype)))
        key_cache, value_cache = storage_view(key_cache), storage_view(value_cache)
        slots = slot_mapping.to(key_cache.device, torch.int64).contiguous()
        _store_kv_kernel[(t,)](
            key, value, key_cache, value_cache, slots,
            key.stride(0), value.stride(0),
            key_cache.stride(0), key_cache.stride(1),
            value_cache.stride(0), value_cache.stride(1), bsz,
            ROW=hkv * d, BLOCK=next_pow2(hkv * d),
        )

    def copy_blocks(
        self,
        key_caches: list[torch.Tensor],
        value_caches: list[torch.Tensor],
        pairs: torch.Tensor,
    ) -> None:
        if pairs.numel() == 0:
            return
        p = pairs.to(key_caches[0].device, torch.int64).contiguous()
        if bool(torch.isin(p[:, 1], p[:, 0]).any()):
            # Chained copies need ordering a parallel launch cannot give.
            super().copy_blocks(key_caches, value_caches, pairs)
            return
        for cache in [*key_caches, *value_caches]:
            if not cache.is_contiguous():
                raise ValueError("copy_blocks needs contiguous caches")
            cache = storage_view(cache)
            numel = cache[0].numel()
            chunk = min(4096, next_pow2(numel))
            _copy_blocks_kernel[(p.shape[0], triton.cdiv(numel, chunk))](
                cache, p, numel, CHUNK=chunk
            )

    # ------------------------------------------------------------ attention
    def _splits(self, programs: int, max_k: int, block_m: int) -> int:
        if self.num_splits is not None:
            return self.num_splits
        sms = self._sms()
        return 1 if sms is None else plan_splits(programs, max_k, block_m, sms)

    def _sms(self) -> int | None:
        """The GPU's multiprocessor count; None under the interpreter (no launch rules)."""
        if self._num_sms is None and not _interpreting() and torch.cuda.is_available():
            self._num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        return self._num_sms

    def _launch(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        cu_q: torch.Tensor,
        seq_lens_k: torch.Tensor,
        tile_seq: torch.Tensor,
        tile_qoff: torch.Tensor,
        block_m: int,
        max_k: int,
        total_q: int,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self.check_window(window, softcap)
        self.check_sinks(sinks, q.shape[1])
        tq, hq, d = q.shape
        _, bsz, hkv, _ = key_cache.shape
        if hq % hkv:
            raise ValueError(f"query heads {hq} not a multiple of kv heads {hkv}")
        if q.stride(2) != 1 or key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
            raise ValueError("head_dim must be the contiguous dimension")
        if key_cache.dtype != value_cache.dtype:
            raise ValueError(f"key cache {key_cache.dtype} and value cache "
                             f"{value_cache.dtype} differ")
        group = hq // hkv
        n_tiles = tile_seq.numel()
        out = torch.empty_like(q) if tq == total_q else torch.zeros_like(q)
        if n_tiles == 0:
            return out
        # A window bounds the keys a program reads, which is what the split plan weighs.
        splits = self._splits(n_tiles * hkv,
                              max_k if window is None else min(max_k, window + block_m), block_m)
        interp = _interpreting()
        kv_fp8 = _KV_FP8.get(key_cache.dtype, 0)
        # Tensor-core dots need K/V in the query's 16-bit dtype: fp8 widens to it exactly,
        # but a different 16-bit cache (bf16 under fp16 or back) would round, so go fp32.
        dot_f32 = (interp or q.dtype == torch.float32
                   or (not kv_fp8 and key_cache.dtype != q.dtype))
        key_cache, value_cache = storage_view(key_cache), storage_view(value_cache)
        block_n = self.block_n or (32 if interp or d > 64 else 64)
        if splits > 1:
            part_acc = torch.empty(tq * hq * splits * d, dtype=torch.float32, device=q.device)
            part_ml = torch.empty(tq * hq * splits * 2, dtype=torch.float32, device=q.device)
        else:
            part_acc = part_ml = out  # unused: NUM_SPLITS == 1 writes `out` directly
        bt = block_table.to(torch.int32)
        sink_arg = out if sinks is None else sinks.to(q.device, torch.float32).contiguous()
        _paged_attention_kernel[(n_tiles, hkv, splits)](
            q, key_cache, value_cache, out, part_acc, part_ml, sink_arg,
            bt, cu_q, seq_lens_k, tile_seq, tile_qoff,
            scale * _LOG2E, scale / (softcap or 1.0), (softcap or 0.0) * _LOG2E, hq, bsz,
            _NO_WINDOW if window is None else min(window, _NO_WINDOW),
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
            bt.stride(0),
            G=group, HEAD_DIM=d, BLOCK_D=next_pow2(max(d, 16)),
            BLOCK_M=block_m, BLOCK_Q=block_m // group, BLOCK_N=block_n, NUM_SPLITS=splits, DOT_F32=dot_f32,
            KV_FP8=kv_fp8, SOFTCAP=softcap is not None, SINKS=sinks is not None,
            num_warps=self.num_warps or (4 if block_m <= 64 else 8),
            **self._stages(n_tiles * hkv, splits, block_m),
        )
        if splits > 1:
            _combine_kernel[(tq, hq)](
                out, part_acc, part_ml, sink_arg, hq, out.stride(0), out.stride(1),
                HEAD_DIM=d, BLOCK_D=next_pow2(d), NUM_SPLITS=splits, SPLITS_P2=next_pow2(splits),
                SINKS=sinks is not None,
            )
        return out

    def _stages(self, programs: int, splits: int, block_m: int) -> dict[str, int]:
        """``num_stages`` for a launch: the override, else 2 for decode tiles (fewer than
        64 rows) whose ``programs x splits`` grid spans ``DECODE_FULL_WAVES`` waves, else
        Triton's own."""
        if self.num_stages is not None:
            return {"num_stages": self.num_stages}
        sms = self._sms()
        if block_m < 64 and sms and programs * splits >= DECODE_FULL_WAVES * sms:
            return {"num_stages": 2}
        return {}

    @staticmethod
    def _block_m(group: int, max_q: int) -> int:
        """Rows per program: G heads x as many query positions as fit (>=16 for tl.dot)."""
        if max_q <= 1:
            return max(16, next_pow2(group))
        return max(64, next_pow2(group))

    def decode_attention(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        cache_seqlens: torch.Tensor,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        s = q.shape[0]
        dev = q.device
        group = q.shape[1] // key_cache.shape[2]
        ar = torch.arange(s + 1, device=dev, dtype=torch.int32)
        return self._launch(
            q, key_cache, value_cache, block_table, ar,
            cache_seqlens.to(dev, torch.int32), ar[:s], torch.zeros(s, dtype=torch.int32, device=dev),
            self._block_m(group, 1), block_table.shape[1] * key_cache.shape[1], s, scale,
            window, softcap, sinks,
        )

    def varlen_attention(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        md: VarlenMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        dev = q.device
        q_lens = md.host_query_lens()
        group = q.shape[1] // key_cache.shape[2]
        block_m = self._block_m(group, max(q_lens, default=0))
        block_q = block_m // group
        per_seq = torch.tensor([-(-lq // block_q) for lq in q_lens], dtype=torch.int64)
        seq_ids = torch.arange(len(q_lens))
        tile_seq = torch.repeat_interleave(seq_ids, per_seq)
        first = torch.cumsum(per_seq, 0) - per_seq
        tile_qoff = (torch.arange(tile_seq.numel()) - first[tile_seq]) * block_q
        return self._launch(
            q, key_cache, value_cache, block_table,
            md.cu_seq_lens_q.to(dev, torch.int32), md.seq_lens_k.to(dev, torch.int32),
            tile_seq.to(dev, torch.int32), tile_qoff.to(dev, torch.int32),
            block_m, md.max_length_k, sum(q_lens), scale, window, softcap, sinks,
        )


def plan_splits(programs: int, max_k: int, block_m: int, num_sms: int) -> int:
    """Split-K factor for a grid of ``programs`` (tiles x KV heads) on ``num_sms`` SMs.

    Fewer programs than SMs: split towards two waves (>= ``_MIN_KEYS_PER_SPLIT`` keys
    each, at most 16 splits). Decode tiles (``block_m`` < 64) short of
    ``DECODE_FULL_WAVES`` waves: split up to that (>= ``_MIN_KEYS_PER_FILL_SPLIT`` keys
    each), since a short grid of long programs leaves HBM idle behind its slowest
    programs. Prefill tiles past one wave are compute-bound and stay whole: their
    partials would be as large as the output.
    """
    if programs < num_sms:
        want = min(triton.cdiv(2 * num_sms, programs), triton.cdiv(max_k, _MIN_KEYS_PER_SPLIT))
        return max(1, min(16, 1 << int(math.log2(max(want, 1)))))
    full = DECODE_FULL_WAVES * num_sms
    if block_m >= 64 or programs >= full:
        return 1
    cap = max_k // _MIN_KEYS_PER_FILL_SPLIT
    if cap < 2:
        return 1
    return min(next_pow2(triton.cdiv(full, programs)), 1 << int(math.log2(cap)))


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """Make each token's [Hkv, D] row contiguous (a strided token dim is fine)."""
    d = x.shape[2]
    if x.stride(2) == 1 and x.stride(1) == d:
        return x
    return x.contiguous()
