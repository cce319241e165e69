"""Building the native CPU kernels (``cpu_native``): the sources, the compiler flags
per source and CPU, the cached library's name and the one-build-at-a-time lock.

Kept apart from ``cpu_native``, which loads the library and wraps its calls: this
half runs once per CPU and source change, the other on every step.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import os
import platform
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).parent
SOURCES = [HERE / "cpu_paged_decode.c", HERE / "cpu_fused_ops.c", HERE / "cpu_lora.c",
            HERE / "cpu_moe.c", HERE / "cpu_int8.c", HERE / "cpu_mamba.c",
            HERE / "cpu_deltanet.c"]
HEADERS = [HERE / "cpu_math.h", HERE / "cpu_vec.h", HERE / "cpu_kv.h",
            HERE / "cpu_paged_rows.h", HERE / "cpu_int8_avx2.h"]
# Associative math lets the dot products vectorise; the kernel never forms inf/nan.
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno",
          "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-ffp-contract=fast"]
# Per source; a build that takes longer fails (and is not tried again, see ``load``).
_BUILD_TIMEOUT_S = 300


def cache_dir() -> Path:
    """Where the compiled libraries (and ``.failed`` build notes) live."""
    root = os.environ.get("PAGEDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pagedserve"
    return Path(root) / "native"


def library_path() -> Path:
    """The library this checkout's sources build on this CPU (built or not): its name
    holds a digest of the sources, the compiler flags and the CPU's feature flags."""
    fingerprint = cpu_fingerprint()
    key = hashlib.sha256(
        b"".join(p.read_bytes() for p in SOURCES + HEADERS)
        + " ".join(" ".join(source_flags(p, fingerprint)) for p in SOURCES).encode()
        + fingerprint.encode()
    ).hexdigest()[:16]
    return cache_dir() / f"cpu_kernels_{key}.so"


def cpu_fingerprint() -> str:
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


def source_flags(source: Path, fingerprint: str) -> list[str]:
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
        return [f for f in FLAGS if f != "-O3"] + ["-O1", "-fpeel-loops", "-funswitch-loops"]
    return FLAGS


def build(cc: str, out: Path, fingerprint: str) -> None:
    """Compile every source (at once, one process each) and link them into ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        objects = [Path(tmp) / f"{src.stem}.o" for src in SOURCES]
        procs = [subprocess.Popen([cc, *source_flags(src, fingerprint), "-c", f"-I{HERE}",
                                   str(src), "-o", str(obj)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for src, obj in zip(SOURCES, objects, strict=True)]
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
def build_lock(path: Path) -> Iterator[None]:
    """One process builds at a time: ranks starting together wait for the first build
    instead of each compiling the same library on the same cores."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def declare_signatures(lib: ctypes.CDLL) -> None:
    """Every exported function's ctypes argument and return types (what the C sources
    define; a mismatch is memory corruption, so they live beside the build)."""
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
    lib.mamba_state_update.argtypes = [ptr, i64, ptr, i64, i64, i64, i64, ptr, ptr, ptr,
                                       ptr, ptr, ctypes.c_int]
    lib.mamba_state_update.restype = ctypes.c_int
    lib.mamba1_state_update.argtypes = [ptr, i64, ptr, i64, i64, i64, ptr, ptr, ptr, ptr,
                                        ptr, ptr, ctypes.c_int]
    lib.mamba1_state_update.restype = ctypes.c_int
    lib.mamba1_scan.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr,
                                ctypes.c_int]
    lib.mamba1_scan.restype = None
    lib.conv_state_update.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64, ptr, ptr, ptr,
                                      ctypes.c_int, ctypes.c_int]
    lib.conv_state_update.restype = ctypes.c_int
    lib.delta_rule_update.argtypes = [ptr, i64, ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr,
                                      ptr, ptr, ctypes.c_int]
    lib.delta_rule_update.restype = ctypes.c_int
    lib.grid_steps4.argtypes = [ptr, i64, ptr]
    lib.grid_steps4.restype = None
    for name in ("rope_f32", "rope_bf16"):
        getattr(lib, name).argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64,
                                       ctypes.c_int]
        getattr(lib, name).restype = None
