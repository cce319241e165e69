"""Loading a pre-quantised projection under tensor parallelism: one rank's share against
the whole projection.

A column-parallel rank (q / k / v, gate / up) takes a slice of a projection's output
rows, a row-parallel one (o, down) a slice of its inputs. ``worker/loaders/
prequant_slices.py`` cuts the packed parts there when whole packed words and groups
allow, so the rank dequantises only its share; before, every rank dequantised the whole
projection and sliced it. This times, on random GPTQ parts of one Llama-3-8B MLP
projection (4,096 inputs, 14,336 outputs, 4 bits in groups of 128; side by side, best
of ``--reps``), the whole projection and one rank's rows (``tpN``) or inputs
(``tpN-in``) at TP = 2, 4 and 8, printed as a share of the whole's time (1 / TP would
be proportional).

    python bench/dequant_rows.py
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedserve.worker.loaders import prequant
from pagedserve.worker.loaders.prequant_config import prequant_config

N_IN, N_OUT, GROUP = 4096, 14336, 128


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    cfg = prequant_config({"quant_method": "gptq", "bits": 4, "group_size": GROUP,
                           "desc_act": False, "sym": True})
    g = torch.Generator().manual_seed(0)
    high = 2 ** 31 - 1
    parts = {
        "qweight": torch.randint(-high, high, (N_IN // 8, N_OUT), dtype=torch.int32,
                                 generator=g),
        "qzeros": torch.randint(-high, high, (N_IN // GROUP, N_OUT // 8), dtype=torch.int32,
                                generator=g),
        "scales": torch.rand(N_IN // GROUP, N_OUT, generator=g).half(),
    }
    cases: dict[str, object] = {"whole": slice(None)}
    for tp in (2, 4, 8):
        cases[f"tp{tp}"] = slice(0, N_OUT // tp)
        cases[f"tp{tp}-in"] = (slice(None), slice(0, N_IN // tp))
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(args.reps):  # interleaved: background load slows every case alike
        for name, rows in cases.items():
            weight = prequant._dequantizer(cfg, "proj", parts)
            t0 = time.perf_counter()
            weight[rows]
            best[name] = min(best[name], time.perf_counter() - t0)
    print(f"GPTQ 4-bit {N_OUT} x {N_IN}, group {GROUP}, {torch.get_num_threads()} threads")
    for name, t in best.items():
        print(f"  {name:8s} {t * 1e3:8.1f} ms  {t / best['whole']:.2f}x of the whole")


if __name__ == "__main__":
    main()
