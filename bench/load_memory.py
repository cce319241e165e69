"""Peak host memory of loading a quantised checkpoint with ``--quantization``: each layer
quantised as it loads (the engine now) against the whole model loaded in full precision
first (the engine before), side by side, each in a fresh process (peak RSS: the
process's ``VmHWM``), on a GPTQ int4 file of the default model written here (Linux).

    python bench/load_memory.py [--quantization int4] [--group-size 64]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path


def child(mode: str, path: str, quantization: str) -> None:
    """Load the model once (``mode``: "streamed" or "whole") and print the peak RSS."""
    from pagedserve.worker.models import llama
    from pagedserve.worker.worker import Worker
    from pagedserve.worker.worker_config import WorkerConfig

    if mode == "whole":  # no per-layer hook: every layer dense until the end
        load = llama.LlamaForCausalLM.load_weights
        llama.LlamaForCausalLM.load_weights = (
            lambda self, weights, on_layer=None: load(self, weights, None))
    worker = Worker(WorkerConfig(model=path, block_size=16, num_gpu_blocks=16,
                                 num_cpu_blocks=0, quantization=quantization))
    worker.load_model()
    # VmHWM, not getrusage: Linux carries ru_maxrss across execve, so a child would
    # report its parent's peak (the checkpoint writer's) where that was higher.
    status = Path("/proc/self/status").read_text()
    peak = int(next(ln for ln in status.splitlines() if ln.startswith("VmHWM:")).split()[1])
    print(f"{peak / 1024:.0f} {worker.weight_bytes / 2**20:.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quantization", default="int4", choices=("int4", "int8"))
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--child", nargs=2, metavar=("MODE", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.quantization)
        return
    from pagedserve.worker.loaders import resolve_model
    from pagedserve.worker.testing_prequant import write_gptq

    with tempfile.TemporaryDirectory() as tmp:
        gptq, _ = write_gptq(Path(resolve_model(None).path), Path(tmp) / "gptq", 4,
                             args.group_size)
        peaks = {}
        for mode in ("whole", "streamed"):
            out = subprocess.run([sys.executable, __file__, "--quantization", args.quantization,
                                  "--child", mode, str(gptq)], capture_output=True, text=True,
                                 check=True).stdout.split()
            peaks[mode] = float(out[-2])
            print(f"{mode:>9}: peak RSS {out[-2]} MiB, weights {out[-1]} MiB", flush=True)
    print(f"SmolLM2-135M GPTQ int4 file, --quantization {args.quantization}: quantising each "
          f"layer as it loads peaks at {peaks['streamed'] / peaks['whole']:.2f}x the memory "
          f"of quantising after the whole load ({peaks['whole'] - peaks['streamed']:.0f} MiB "
          "less; the process's own Python and torch included in both)")


if __name__ == "__main__":
    main()
