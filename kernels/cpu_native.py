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

import contextlib
import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from pagedserve.kernels.kv_quant import quantize

logger = logging.getLogger(__name__)

_HERE = Path(__file__).parent
_SOURCES = [_HERE / "cpu_paged_decode.c", _HERE / "cpu_fused_ops.c", _HERE / "cpu_lora.c",
            _HERE / "cpu_moe.c", _HERE / "cpu_int8.c"]
_HEADERS = [_HERE / "cpu_math.h", _HERE / "cpu_vec.h", _HERE / "cpu_kv.h",
            _HERE / "cpu_paged_rows.h", _HERE / "cpu_int8_avx2.h"]
# Associative math lets the dot products vectorise; the kernel never forms inf/nan.
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno",
          "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-ffp-contract=fast"]
# Query dtypes the decode kernel takes (it computes in fp32), and the cache dtypes it
# reads with their kernel codes (KV_* in cpu_paged_decode.c; each widened exactly).
_DECODE_DTYPES = (torch.float32, torch.bfloat16)
_MAX_HEAD_DIM = 576  # MAX_HEAD_DIM in cpu_kv.h (DeepSeek's latent: 512 + 64)
# Prefill rows of one sequence that read its K/V together (``row_chunks``).
ROWS_PER_CHUNK = 16
_KV_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2,
             torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}
# Per source; a build that takes longer fails (and is not tried again, see ``load``).
_BUILD_TIMEOUT_S = 300
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def cache_dir() -> Path:
    """Where the compiled libraries (and ``.failed`` build notes) live."""
    root = os.environ.get("PAGEDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pagedserve"
    return Path(root) / "native"


def library_path() -> Path:
    """The library this checkout's sources build on this CPU (built or not): its name
    holds a digest of the sources, the compiler flags and the CPU's feature flags."""
    fingerprint = _cpu_fingerprint()
    key = hashlib.sha256(
        b"".join(p.read_bytes() for p in _SOURCES + _HEADERS)
        + " ".join(" ".join(_source_flags(p, fingerprint)) for p in _SOURCES).encode()
        + fingerprint.encode()
    ).hexdigest()[:16]
    return cache_dir() / f"cpu_kernels_{key}.so"


def _cpu_fingerprint() -> str:
    """Machine + CPU feature flags: what ``-march=native`` code depends on."""
    flags = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    return f"{platform.machine()}|{flags}"


def _has_wide_vectors(fingerprint: str) -> bool:
    """Whether this CPU has 512-bit vectors (or is not x86, where the flag does not apply)."""
    return platform.machine() not in ("x86_64", "AMD64") or " avx512f" in fingerprint


def _source_flags(source: Path, fingerprint: str) -> list[str]:
    """Compiler flags of one source on this CPU.

    The attention kernels hold sixteen-lane vectors of whole head rows in arrays. On
    an x86 CPU without AVX-512, GCC splits each into two 256-bit halves, and at -O2 /
    -O3 its redundancy-elimination passes then take minutes on the one file (357 s
    on a 2-core AVX2 EPYC), longer than the build may take. -O1 with complete loop
    peeling and unswitching (what the kernels' fixed-trip loops need to stay in
    registers) builds in seconds there and decodes as fast as the -O3 build
    (``bench/kernels.py --backends cpu``, both builds side by side on that machine).
    """
    if source.name == "cpu_paged_decode.c" and not _has_wide_vectors(fingerprint):
        return [f for f in _FLAGS if f != "-O3"] + ["-O1", "-fpeel-loops", "-funswitch-loops"]
    return _FLAGS


def _build(cc: str, out: Path, fingerprint: str) -> None:
    """Compile every source (at once, one process each) and link them into ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        objects = [Path(tmp) / f"{src.stem}.o" for src in _SOURCES]
        procs = [subprocess.Popen([cc, *_source_flags(src, fingerprint), "-c", f"-I{_HERE}",
                                   str(src), "-o", str(obj)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for src, obj in zip(_SOURCES, objects, strict=True)]
        try:
            for proc in procs:
                _, err = proc.communicate(timeout=_BUILD_TIMEOUT_S)
                if proc.returncode:
                    raise subprocess.CalledProcessError(proc.returncode, proc.args, stderr=err)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        # Link to a temp name and rename: another process never loads a half-written file.
        linked = Path(tmp) / out.name
        subprocess.run([cc, "-shared", "-fopenmp", *map(str, objects), "-o", str(linked), "-lm"],
                       check=True, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
        os.replace(linked, out)


@contextlib.contextmanager
def _build_lock(path: Path) -> Iterator[None]:
    """One process builds at a time: ranks starting together wait for the first build
    instead of each compiling the same library on the same cores."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


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
        if cc is None or not all(p.exists() for p in _SOURCES + _HEADERS):
            logger.info("native CPU kernels off: no C compiler found")
            return None
        path = library_path()
        failed = path.with_suffix(".failed")
        try:
            with _build_lock(path):
                if failed.exists():
                    logger.warning("native CPU kernels off: an earlier build failed (%s)",
                                   failed)
                    return None
                if not path.exists():
                    try:
                        _build(cc, path, _cpu_fingerprint())
                    except (OSError, subprocess.SubprocessError) as e:
                        detail = getattr(e, "stderr", "") or str(e)
                        failed.write_text(f"{e}\n{detail}")
                        raise
            lib = ctypes.CDLL(str(path))
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            logger.warning("native CPU kernels off: build failed: %s", str(detail).strip()[:500])
            return None
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.paged_decode_kv.argtypes = [ptr, ptr, ptr, i64, ptr, i64, ptr, ptr, i64, ptr,
                                        i64, i64, i64, i64, i64, ctypes.c_float, ptr,
                                        ctypes.c_int, ctypes.c_int, ptr, ctypes.c_float]
        lib.paged_decode_kv.restype = ctypes.c_int
        lib.store_kv_rows.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, ptr, i64, i64]
        lib.store_kv_rows.restype = ctypes.c_int
        lib.silu_and_mul_f32.argtypes = [ptr, i64, ptr, i64, i64, ctypes.c_int]
        lib.silu_and_mul_f32.restype = None
        for name in ("rms_norm_f32", "rms_norm_bf16"):
            getattr(lib, name).argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, i64,
                                           ctypes.c_float, ctypes.c_int]
            getattr(lib, name).restype = None
        lib.lora_sgmv.argtypes = [ptr, i64, ptr, i64, i64, i64, i64, ptr, i64, ptr, i64, i64,
                                  ctypes.c_int, ctypes.c_int]
        lib.lora_sgmv.restype = ctypes.c_int
        lib.moe_experts.argtypes = [ptr, i64, ptr, i64, i64, i64, i64, i64, i64, ptr, ptr,
                                    ptr, ptr, ptr, ptr, ptr, ctypes.c_int, ctypes.c_int]
        lib.moe_experts.restype = ctypes.c_int
        lib.int8_linear.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ctypes.c_int32, i64,
                                    ptr, i64, ctypes.c_int]
        lib.int8_linear.restype = ctypes.c_int
        lib.moe_int8.argtypes = [ptr, i64, ptr, i64, i64, i64, i64, i64, i64, ptr, ptr, ptr,
                                 ptr, ptr, ptr, ptr, ptr]
        lib.moe_int8.restype = ctypes.c_int
        lib.grid_steps4.argtypes = [ptr, i64, ptr]
        lib.grid_steps4.restype = None
        for name in ("rope_f32", "rope_bf16"):
            getattr(lib, name).argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64,
                                           ctypes.c_int]
            getattr(lib, name).restype = None
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
    of the capped scores, so split key ranges still merge).
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
