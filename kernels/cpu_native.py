"""Native CPU kernels: paged decode and fused row ops, compiled on first use, called
through ctypes.

Why: on CPU the torch path copies every context token of every decoding
sequence into a padded workspace once per layer, then SDPA reads the copy
again; at serving batch sizes that is about a fifth of the forward. The C
kernel (``cpu_paged_decode.c``) reads K/V (fp32, bf16, fp16 or fp8) straight from the
block pool. The same library carries RMSNorm-with-residual, SiLU-and-multiply
and RoPE (``cpu_fused_ops.c``, wrapped by ``cpu_fused``), each one pass where
torch makes several, and the multi-LoRA deltas of a batch (``cpu_lora.c``,
wrapped by ``cpu_lora``).

Why C + ctypes rather than a torch C++ extension: the kernel needs no torch
headers, so it compiles in seconds with the system C compiler (about 25 s on a
2-core AVX2 machine, sources compiled side by side) and no build-time torch (a
torch build dependency would make pip fetch a CUDA wheel). The shared object is cached under ``$PAGEDSERVE_CACHE_DIR`` (default
``~/.cache/pagedserve``) keyed by source, compiler flags and this CPU's
feature flags, because ``-march=native`` code must not move to another CPU.

No compiler, a failed build, or ``PAGEDSERVE_NATIVE_KERNELS=0``: ``load()``
returns None, the "cpu" backend reports itself unavailable, and the default
CPU backend is the pure-torch one.

:class:`~pagedserve.kernels.cpu_backend.CpuNativeBackend` puts these on the
attention path.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Sequence

import torch

from pagedserve.kernels.cpu_native_build import (
    HEADERS,
    SOURCES,
    build,
    build_lock,
    cache_dir,
    cpu_fingerprint,
    declare_signatures,
    library_path,
)
from pagedserve.kernels.kv_quant import quantize

__all__ = ["cache_dir", "library_path", "load", "paged_decode", "store_kv", "supports"]

logger = logging.getLogger(__name__)

# Query dtypes the decode kernel takes (it computes in fp32), and the cache dtypes it
# reads with their kernel codes (KV_* in cpu_paged_decode.c; each widened exactly).
_DECODE_DTYPES = (torch.float32, torch.bfloat16)
_MAX_HEAD_DIM = 576  # MAX_HEAD_DIM in cpu_kv.h (DeepSeek's latent: 512 + 64)
# Prefill rows of one sequence that read its K/V together (``row_chunks``).
ROWS_PER_CHUNK = 16
_KV_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2,
             torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def load() -> ctypes.CDLL | None:
    """The compiled kernel library, building it once per source/CPU; None if unavailable.

    A build that fails leaves a ``.failed`` note next to where the library would be,
    so later processes go straight to the torch path instead of compiling again;
    delete it (or change the sources) to retry.
    """
    global _lib, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("PAGEDSERVE_NATIVE_KERNELS", "1") in ("0", "false", "no"):
            return None
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if cc is None or not all(p.exists() for p in SOURCES + HEADERS):
            logger.info("native CPU kernels off: no C compiler found")
            return None
        path = library_path()
        failed = path.with_suffix(".failed")
        try:
            with build_lock(path):
                if failed.exists():
                    logger.warning("native CPU kernels off: an earlier build failed (%s)",
                                   failed)
                    return None
                if not path.exists():
                    try:
                        build(cc, path, cpu_fingerprint())
                    except (OSError, subprocess.SubprocessError) as e:
                        detail = getattr(e, "stderr", "") or str(e)
                        failed.write_text(f"{e}\n{detail}")
                        raise
            lib = ctypes.CDLL(str(path))
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            logger.warning("native CPU kernels off: build failed: %s", str(detail).strip()[:500])
            return None
        declare_signatures(lib)
        _lib = lib
        return _lib


def _loaded() -> ctypes.CDLL | None:
    """``load()`` without its lock once it has run: the row ops call this per layer."""
    return _lib if _tried else load()


def supports(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether the native kernel handles these tensors: CPU, fp32 or bf16 queries,
    contiguous fp32 / bf16 / fp16 / fp8 caches, query heads a multiple of KV heads."""
    return (q.device.type == "cpu" and value_cache.dtype == key_cache.dtype
            and key_cache.is_contiguous() and value_cache.is_contiguous()
            and unsupported_reason(q.dtype, key_cache.dtype, q.shape[1], key_cache.shape[2],
                                   key_cache.shape[3]) is None)


def unsupported_reason(q_dtype: torch.dtype, kv_dtype: torch.dtype, num_heads: int,
                       num_kv_heads: int, head_dim: int) -> str | None:
    """Why the native kernel would not take a model of this shape (None: it would);
    ``supports`` says the same of one call's tensors."""
    if q_dtype not in _DECODE_DTYPES:
        return f"queries in {q_dtype} (it takes float32 or bfloat16)"
    if kv_dtype not in _KV_KINDS:
        return f"a {kv_dtype} KV cache"
    if num_heads % num_kv_heads:
        return f"{num_heads} query heads over {num_kv_heads} KV heads"
    if head_dim > _MAX_HEAD_DIM or head_dim % 16:
        return f"head size {head_dim} (it takes multiples of 16 up to {_MAX_HEAD_DIM})"
    if _loaded() is None:
        return "the native kernels did not build (no C compiler?)"
    return None


def row_chunks(group_sizes: Sequence[int], rows: int = ROWS_PER_CHUNK) -> torch.Tensor:
    """Row offsets for :func:`paged_decode`'s ``chunks``: each group of consecutive rows
    (one sequence's rows, sharing its block table) cut into runs of at most ``rows``."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    offsets = [0]
    for size in group_sizes:
        end = offsets[-1] + size
        offsets.extend(range(offsets[-1] + rows, end, rows))
        if size > 0:
            offsets.append(end)
    return torch.tensor(offsets, dtype=torch.int32)


def paged_decode(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    lens: torch.Tensor,
    max_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    chunks: torch.Tensor | None = None,
    stats: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention [S, Hq, D] of ``q`` over keys ``[0, lens[s])``; zero rows for len 0.

    Caller checks :func:`supports` first; ``max_len`` is ``max(lens)``, known
    on the host. Block-table entries past a sequence's length are never read,
    so -1 padding there is fine; a needed entry out of range raises. ``out``
    (fp32, contiguous, ``q``'s shape; only for fp32 ``q``) receives the result
    instead of a fresh tensor: a prefill's rows then skip an allocation and a copy.
    ``chunks`` (int32 row offsets, ascending from 0 to S) groups rows that share a
    block table (one sequence's prefill rows): each group reads its K/V once for all
    its rows, with every row's result bit-identical to running it alone
    (:func:`row_chunks` builds them); None runs every row alone. ``stats`` (fp32,
    contiguous ``[S, Hq, 2]``) receives each row and head's softmax statistics, its
    largest scaled score and the sum of ``exp(score - max)``, for merging attention
    over split key ranges (``cpu_cascade.merge_attention``; rows of length 0 keep theirs).
    A sliding ``window`` starts row ``s`` at key ``lens[s] - window``; the blocks before
    it are not read, and a run of rows reads the union of its rows' windows once, each
    row still bit-identical to itself alone. A ``softcap`` caps each scaled score ``s``
    to ``softcap * tanh(s / softcap)`` before the softmax (Gemma 2; ``stats`` are then
    of the capped scores, so split key ranges still merge). ``sinks`` ``[Hq]`` (GPT-OSS)
    join each row's softmax as a zero-valued logit: the kernel's statistics give each
    row's ``log L``, and the output is scaled by ``sigmoid(log L - sink)`` after the
    call (``stats`` then stay the keys' own).
    """
    lib = _loaded()
    if lib is None:
        raise RuntimeError("the native CPU kernel is unavailable; check supports() first")
    s, hq, d = q.shape
    _, bsz, hkv, _ = key_cache.shape
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("native paged decode needs contiguous K/V caches")
    if value_cache.shape != key_cache.shape or key_cache.shape[3] != d:
        raise ValueError(f"K/V caches {tuple(key_cache.shape)} / {tuple(value_cache.shape)} "
                         f"do not fit queries of head size {d}")
    q32 = q.float().contiguous()  # narrow caches too: the math is fp32
    tables = block_table.to(torch.int32).contiguous()
    lens32 = lens.to(torch.int32).contiguous()
    if tables.dim() != 2 or tables.shape[0] != s or lens32.numel() != s:
        raise ValueError(
            f"block_table {tuple(block_table.shape)} / lens {tuple(lens.shape)} "
            f"do not match {s} queries"
        )
    if max_len > tables.shape[1] * bsz:
        raise ValueError(f"a sequence of {max_len} tokens overruns its block table "
                         f"({tables.shape[1]} blocks of {bsz})")
    if out is None or q.dtype != torch.float32:
        out = torch.empty_like(q32)
    elif out.shape != q.shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous fp32 tensor of shape {tuple(q.shape)}")
    if value_cache.dtype != key_cache.dtype or key_cache.dtype not in _KV_KINDS:
        raise ValueError(f"native paged decode reads {list(_KV_KINDS)} caches, got "
                         f"{key_cache.dtype} / {value_cache.dtype}")
    if stats is not None and (stats.shape != (s, hq, 2) or stats.dtype != torch.float32
                              or not stats.is_contiguous()):
        raise ValueError(f"stats must be a contiguous fp32 tensor of shape {(s, hq, 2)}")
    if sinks is not None and stats is None:
        stats = torch.empty((s, hq, 2), dtype=torch.float32)
    if sinks is not None:
        stats[..., 0].fill_(float("-inf"))  # rows of length 0 keep these: a zero share
        stats[..., 1].zero_()
    chunk_ptr, num_chunks = None, 0
    starts = None if window is None else (lens32 - window).clamp_min(0).to(torch.int32)
    if chunks is not None:
        chunks = chunks.to(torch.int32).contiguous()
        num_chunks = chunks.numel() - 1
        if chunks.dim() != 1 or num_chunks < 1 or int(chunks[0]) != 0 or int(chunks[-1]) != s:
            raise ValueError(f"chunks must be row offsets from 0 to {s}, got "
                             f"{chunks.tolist()[:8]}")
        chunk_ptr = chunks.data_ptr()
    rc = lib.paged_decode_kv(
        q32.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), key_cache.shape[0],
        tables.data_ptr(), tables.stride(0), lens32.data_ptr(),
        None if starts is None else starts.data_ptr(), s, chunk_ptr, num_chunks,
        hq, hkv, d, bsz, float(scale), out.data_ptr(), torch.get_num_threads(),
        _KV_KINDS[key_cache.dtype], None if stats is None else stats.data_ptr(),
        float(softcap or 0.0),
    )
    if rc == -2:
        raise ValueError(f"block table holds a block id outside [0, {key_cache.shape[0]})")
    if rc in (-4, -5):  # (-5: window starts outside their rows; never from here)
        raise ValueError(f"chunks / window starts out of range: {chunks}, {starts}")
    if rc == -3:
        raise ValueError(f"native paged decode takes head sizes <= {_MAX_HEAD_DIM} in "
                         f"multiples of 16, got {d}")
    if rc != 0:
        raise MemoryError("native paged decode could not allocate its score buffer")
    if sinks is not None:
        assert stats is not None
        log_l = stats[..., 0] + stats[..., 1].log()  # -inf for a row without keys
        out.mul_(torch.sigmoid(log_l - sinks.float()).unsqueeze(-1))
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    """Write ``key/value[t]`` into flat slot ``slot_mapping[t]`` (-1 skipped) in one
    native call; False, with nothing written, when these tensors are not for it
    (the caller runs the torch path). Narrower caches get the rounded rows
    (``kv_quant.quantize``), as the torch path stores them."""
    lib = _loaded()
    if (lib is None or key_cache.device.type != "cpu" or key.device.type != "cpu"
            or value_cache.dtype != key_cache.dtype or value_cache.shape != key_cache.shape
            or not (key_cache.is_contiguous() and value_cache.is_contiguous())):
        return False
    t = slot_mapping.numel()
    row = tuple(key_cache.shape[2:])
    new = []
    for x in (key, value):
        x = quantize(x.reshape(t, *row), key_cache.dtype)
        if x.stride(-1) != 1 or x.stride(-2) != row[-1]:
            x = x.contiguous()
        new.append(x)
    k, v = new
    slots = slot_mapping.to(torch.long).contiguous()
    es = key_cache.element_size()
    rc = lib.store_kv_rows(k.data_ptr(), k.stride(0) * es, v.data_ptr(), v.stride(0) * es,
                           slots.data_ptr(), t, key_cache.data_ptr(), value_cache.data_ptr(),
                           key_cache.shape[0] * key_cache.shape[1], row[0] * row[1] * es)
    if rc != 0:
        raise ValueError(f"slot_mapping holds a slot outside [-1, "
                         f"{key_cache.shape[0] * key_cache.shape[1]})")
    return True
