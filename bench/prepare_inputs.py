"""Host time of a decode step's input tensors (``ModelRunner.prepare_inputs``).

Every rank turns the plan's Python lists into tensors each step; at long
contexts the block tables dominate (256 rows x 512 blocks at 8,192 tokens).
This times the method as it is (lists read by numpy's ``fromiter``,
``model_runner.int_tensor``) against the same method with ``torch.tensor`` on
the lists (what it did before), interleaved, and prints the ratio.

    python bench/prepare_inputs.py [--num-seqs 256] [--context 8192] [--reps 20]
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace
from unittest import mock

import numpy as np
import torch

from pagedserve.scheduler.outputs import ScheduledRequest, SchedulerOutput
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker import model_runner
from pagedserve.worker.model_runner import ModelRunner

_TORCH = {np.int32: torch.int32, np.int64: torch.int64}


def plan(num_seqs: int, context: int, block_size: int) -> SchedulerOutput:
    """A decode step: ragged contexts up to ``context``, scattered blocks."""
    width = -(-context // block_size)
    rows = []
    for i in range(num_seqs):
        n = context - (i * 37) % block_size
        rid = f"r{i}"
        table = [(i * 7919 + j * 104729) % 1_000_000 for j in range(width)]
        rows.append(ScheduledRequest(rid, [17], n - 1, table, [rid], {rid: SamplingParams()}))
    return SchedulerOutput(1, rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    p = plan(args.num_seqs, args.context, args.block_size)
    runner = SimpleNamespace(block_size=args.block_size, device=torch.device("cpu"))
    ways = {"fromiter": model_runner.int_tensor,
            "torch.tensor": lambda v, dt: torch.tensor(v, dtype=_TORCH[dt])}
    best = dict.fromkeys(ways, float("inf"))
    outs = {}
    for _ in range(args.reps):
        for name, fn in ways.items():
            with mock.patch.object(model_runner, "int_tensor", fn):
                t0 = time.perf_counter()
                outs[name] = ModelRunner.prepare_inputs(runner, p)
                best[name] = min(best[name], time.perf_counter() - t0)
    a, b = outs["fromiter"].md, outs["torch.tensor"].md
    assert torch.equal(a.block_table, b.block_table) and torch.equal(a.slot_mapping,
                                                                     b.slot_mapping)
    print(f"prepare_inputs, {args.num_seqs} decode rows x {args.context} tokens "
          f"(blocks of {args.block_size}), best of {args.reps} (interleaved)")
    for name, t in best.items():
        print(f"  {name:12s} {t * 1e3:7.2f} ms")
    print(f"  torch.tensor / fromiter: {best['torch.tensor'] / best['fromiter']:.2f}x")


if __name__ == "__main__":
    main()
