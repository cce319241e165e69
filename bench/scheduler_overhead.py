"""Scheduler CPU overhead per step: ``schedule()`` + ``update_from_output()``.

Steady-state decode with N running requests (block size 16, prefix caching
on), the runner replaced by a table lookup so only scheduler time is counted.
Goals on the 2-core dev machine: < 1 ms per step at 256, < 4 ms at 1024.

``--kv-groups G`` plans for a hybrid model's G KV cache groups (one full, G - 1
sliding through ``--window`` tokens: Gemma 3 4B is 7 groups, 1,024), one block table
each, beside the one-table scheduler in the same run (ratio printed).

    python bench/scheduler_overhead.py [--steps 200]
    python bench/scheduler_overhead.py --kv-groups 7 --window 64
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


def measure(num_running: int, steps: int,
            groups: tuple[int | None, ...] = ()) -> float:
    """Milliseconds per steady decode step of ``num_running`` requests (with a table
    per KV cache group when ``groups`` names their windows)."""
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=num_running,
            max_num_batched_tokens=max(num_running, 8192),
            max_model_len=4096,
        ),
        CacheConfig(num_gpu_blocks=num_running * 40 * max(1, len(groups)), block_size=16,
                    model_id="bench", kv_group_windows=groups),
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
    ap.add_argument("--kv-groups", type=int, default=0, help="hybrid model's groups (>= 2)")
    ap.add_argument("--window", type=int, default=1024, help="sliding groups' window")
    args = ap.parse_args()
    if args.kv_groups:
        if args.kv_groups < 2:
            raise SystemExit("--kv-groups needs 2 groups or more")
        configure_gc_for_serving()
        groups = (None,) + (args.window,) * (args.kv_groups - 1)
        print(f"{'running':>8} {'1 table':>9} {f'{args.kv_groups} groups':>10} {'ratio':>6}")
        for n in (256, 1024):
            one, many = measure(n, args.steps), measure(n, args.steps, groups)
            print(f"{n:>8} {one:>9.3f} {many:>10.3f} {many / one:>6.2f}")
        return
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
