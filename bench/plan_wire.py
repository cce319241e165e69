"""A decode step's plan on its way to a Ray rank: whole, or as changes (plan_wire).

Every step the Ray executor puts the plan in the object store and every rank
reads it back: the driver pays the pickling on the engine's step thread, each
rank the unpickling before its forward. This times both ways over the same run
of decode steps (``--num-seqs`` rows at ``--context`` tokens, blocks of
``--block-size``, each row's table growing a block every ``block_size`` steps,
sampling parameters per row as the scheduler sends them), interleaved, and
prints the bytes and the driver's and a rank's time per step, and the ratios.

    python bench/plan_wire.py [--num-seqs 256] [--context 8192] [--steps 64] [--reps 5]
"""

from __future__ import annotations

import argparse
import pickle
import time

from pagedserve.scheduler.outputs import ScheduledRequest, SchedulerOutput
from pagedserve.scheduler.plan_wire import PlanDecoder, PlanEncoder
from pagedserve.scheduler.sampling_params import SamplingParams


def plans(num_seqs: int, context: int, block_size: int, steps: int) -> list[SchedulerOutput]:
    """``steps`` consecutive decode plans (fresh row objects each step, as the scheduler
    builds them; the same ``SamplingParams`` object per request throughout)."""
    params = [SamplingParams(temperature=0.7, top_p=0.9, max_tokens=1024, seed=i)
              for i in range(num_seqs)]
    width = -(-context // block_size)
    out = []
    for step in range(steps):
        rows = []
        for i in range(num_seqs):
            n = context + step
            table = list(range(i * (width + steps), i * (width + steps) + -(-n // block_size)))
            rid = f"req-{i}"
            rows.append(ScheduledRequest(rid, [17], n - 1, table, [rid], {rid: params[i]},
                                         num_output_tokens=step))
        out.append(SchedulerOutput(step, rows))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    run = plans(args.num_seqs, args.context, args.block_size, args.steps)
    best = {"whole": [float("inf")] * 2, "changes": [float("inf")] * 2}
    size = {}
    for _ in range(args.reps):
        for way in best:
            enc, dec = PlanEncoder(), PlanDecoder()
            drive = rank = 0.0
            nbytes = 0
            for plan in run:
                t0 = time.perf_counter()
                blob = pickle.dumps(plan if way == "whole" else enc.encode(plan), protocol=5)
                t1 = time.perf_counter()
                got = pickle.loads(blob)
                if way == "changes":
                    got = dec.decode(got)
                t2 = time.perf_counter()
                drive, rank, nbytes = drive + t1 - t0, rank + t2 - t1, nbytes + len(blob)
            # The first plan goes whole either way; the steady state is the rest.
            best[way] = [min(best[way][0], drive / len(run)), min(best[way][1], rank / len(run))]
            size[way] = nbytes / len(run)
    assert got == run[-1]
    print(f"{args.num_seqs} decode rows x {args.context} tokens (blocks of {args.block_size}), "
          f"{args.steps} steps, best of {args.reps} (interleaved)")
    for way, (drive, rank) in best.items():
        print(f"  {way:8s} {size[way] / 1e3:8.1f} KB/step  driver {drive * 1e3:6.2f} ms  "
              f"rank {rank * 1e3:6.2f} ms")
    w, c = best["whole"], best["changes"]
    print(f"  whole / changes: bytes {size['whole'] / size['changes']:.1f}x, "
          f"driver {w[0] / c[0]:.2f}x, rank {w[1] / c[1]:.2f}x, "
          f"both {(w[0] + w[1]) / (c[0] + c[1]):.2f}x")


if __name__ == "__main__":
    main()
