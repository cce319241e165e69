"""int4 weights on a GPU: the W4A16 Triton GEMM against cuBLAS on the 16-bit weights.

For Llama-3-8B's projection shapes (q/k/v fused, o, gate/up fused, down) and a few row
counts (decode batches to a prefill chunk), times ``kernels.triton_w4a16.linear`` and
``F.linear`` on the bf16 weights it stands for, side by side in one run (CUDA events,
median of ``--reps``), and prints each one's time, the int4 kernel's weight bandwidth
(bytes of codes, scales and minimums read / time) as a share of the device's peak, and
the ratio. Decode (few rows) is bound by reading the weights, where 4.5 bits against 16
should show; large batches by tensor-core math, where rebuilding weights costs.

    python bench/w4a16.py [--rows 1,16,64,256,1024] [--reps 50] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

# Llama-3-8B, one rank: (name, outputs, inputs).
SHAPES = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
          ("down", 4096, 14336))
PEAK_GBPS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0}


def timed(fn, reps: int) -> float:
    """Median milliseconds of ``fn`` over ``reps`` CUDA-event timings (after warm-up)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,16,64,256,1024")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/w4a16.py needs a CUDA device (the kernel's CPU checks are the tests)")
        sys.exit(0)
    from pagedserve.kernels import cpu_int8, triton_w4a16

    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_GBPS.items() if k in name), None)
    print(f"{name}; peak HBM {peak or '?'} GB/s")
    print(f"{'shape':>8} {'rows':>5} {'bf16 ms':>8} {'int4 ms':>8} {'int4/bf16':>9} "
          f"{'int4 GB/s':>9} {'of peak':>7}")
    rows_out = []
    for shape, n, k in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        w4 = triton_w4a16.make(*cpu_int8.quantize_asymmetric4(w), dtype=torch.bfloat16)
        dense = w4.dequantize().to(torch.bfloat16)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ms_dense = timed(lambda: F.linear(x, dense), args.reps)  # noqa: B023
            ms_int4 = timed(lambda: triton_w4a16.linear(x, w4), args.reps)  # noqa: B023
            gbps = w4.nbytes / (ms_int4 * 1e-3) / 1e9
            share = f"{gbps / peak:.0%}" if peak else "?"
            print(f"{shape:>8} {m:>5} {ms_dense:>8.4f} {ms_int4:>8.4f} "
                  f"{ms_int4 / ms_dense:>9.2f} {gbps:>9.0f} {share:>7}", flush=True)
            rows_out.append({"shape": shape, "n": n, "k": k, "rows": m, "bf16_ms": ms_dense,
                             "int4_ms": ms_int4, "int4_gbps": gbps})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
