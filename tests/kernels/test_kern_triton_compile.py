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
    """Three compiler processes side by side (a cold cache takes minutes): sm_90's
    launches, sm_90's launch sweep, sm_80's launches."""
    script = Path(__file__).with_name("_aot_compile.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    jobs = (["90", "--only", "base"], ["90", "--only", "sweep"], ["80"])
    procs = [subprocess.Popen([sys.executable, str(script), *job], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for job in jobs]
    outs = [p.communicate(timeout=300) for p in procs]
    stdout = "".join(out for out, _ in outs)
    for p, (out, err) in zip(procs, outs, strict=True):
        if p.returncode != 0 and "ptxas" in err and "not found" in err:
            pytest.skip("triton's bundled ptxas is missing")
        assert p.returncode == 0, out[-2000:] + err[-4000:]
    from pagedserve.kernels.triton_backend import LAUNCH_SWEEP

    # Ten default launches per target, three with Gemma 2's softcap, two with GPT-OSS's
    # sinks and their split-K merge, and the --sweep grid plus the split two-stage
    # decode for two shapes on sm_90; then the narrow-cache (fp8 / mixed 16-bit)
    # variants, store and copy included.
    assert stdout.count("ok sm_") == 2 * 16 + 2 * (len(LAUNCH_SWEEP) + 1)
    assert stdout.count("ok kv sm_") == 32
    assert stdout.count("ok moe sm_") == 2 * 9  # gate/up and down: three dtypes, GPT-OSS;
    # Nemotron 3's squared-ReLU gate/up
    assert stdout.count("ok w4 sm_") == 2 * 6  # int4 GEMM: three dtypes, two tiles
    assert stdout.count("ok gdn sm_") == 2 * 2  # the delta rule's decode: two head shapes
    assert stdout.count("ok mamba1 sm_") == 2 * 2  # Mamba-1's update and scan
