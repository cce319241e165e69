"""The Triton kernels compile to cubins for sm_90 and sm_80 (no GPU needed), within
each target's shared memory, including every launch setting the GPU sweep tries and
the fused MoE's kernels and the int4 GEMM."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton not installed"
)


def test_kernels_compile_for_nvidia_targets() -> None:
    script = Path(__file__).with_name("_aot_compile.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(script), "90", "80"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("triton's bundled ptxas is missing")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    from pagedserve.kernels.triton_backend import LAUNCH_SWEEP

    # Ten default launches per target and three with Gemma 2's softcap, and the --sweep
    # grid plus the split two-stage decode for two shapes on sm_90; then the
    # narrow-cache (fp8 / mixed 16-bit) variants, store and copy included.
    assert proc.stdout.count("ok sm_") == 2 * 13 + 2 * (len(LAUNCH_SWEEP) + 1)
    assert proc.stdout.count("ok kv sm_") == 32
    assert proc.stdout.count("ok moe sm_") == 2 * 6  # gate/up and down, three dtypes
    assert proc.stdout.count("ok w4 sm_") == 2 * 6  # int4 GEMM: three dtypes, two tiles
