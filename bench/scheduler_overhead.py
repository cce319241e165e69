"""Scheduler CPU overhead per step: ``schedule()`` + ``update_from_output()``.

Steady-state decode with N running requests (block size 16, prefix caching
on), the runner replaced by a table lookup so only scheduler time is counted.
Goals on the 2-core dev machine: < 1 ms per step at 256, < 4 ms at 1024.

    python bench/scheduler_overhead.py [--steps 200]
"""

from __future__ import annotations

import argparse
import gc
import time

from pagedserve.cluster.async_engine import configure_gc_for_serving
from pagedserve.scheduler.config import CacheConfig, SchedulerConfig
from pagedserve.scheduler.outputs import ModelRunnerOutput, SampledToken
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler


def measure(num_running: int, steps: int) -> float:
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=num_running,
            max_num_batched_tokens=max(num_running, 8192),
            max_model_len=4096,
        ),
        CacheConfig(num_gpu_blocks=num_running * 40, block_size=16, model_id="bench"),
    )
    params = SamplingParams(max_tokens=100_000 // 100, temperature=0.0, ignore_eos=True)
    for i in range(num_running):
        prompt = [(i * 7 + j) % 30000 + 1 for j in range(128)]
        sched.add_request(sched.make_request(f"r{i}", prompt, params))
    tok = SampledToken(42)

    def one_step() -> None:
        plan = sched.schedule()
        out = ModelRunnerOutput(
            plan.step_id, {sid: tok for sr in plan.scheduled for sid in sr.sample_ids}
        )
        sched.update_from_output(plan, out)

    for _ in range(3):  # prefill + warm-up
        one_step()
    t0 = time.perf_counter()
    for _ in range(steps):
        one_step()
    return (time.perf_counter() - t0) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    default_gc = gc.get_threshold()
    print(f"{'running':>8} {'gc':>8} {'ms/step':>9} {'goal':>6}")
    for tuned in (False, True):
        if tuned:
            configure_gc_for_serving()  # what the engine does at start-up
        else:
            gc.set_threshold(*default_gc)
        for n, goal in ((256, 1.0), (1024, 4.0)):
            ms = measure(n, args.steps)
            verdict = "ok" if ms < goal else "MISSED"
            print(
                f"{n:>8} {'engine' if tuned else 'default':>8} {ms:>9.3f} {goal:>6.1f}  {verdict}"
            )


if __name__ == "__main__":
    main()
