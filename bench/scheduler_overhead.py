"""Scheduler CPU overhead per step: ``schedule()`` + ``update_from_output()``.

Steady-state decode with N running requests (block size 16, prefix caching
on), the runner replaced by a table lookup so only scheduler time is counted.
Goals on the 2-core dev machine: < 1 ms per step at 256, < 4 ms at 1024.

``--kv-groups G`` plans for a hybrid model's G KV cache groups (one full, G - 1
sliding through ``--window`` tokens: Gemma 3 4B is 7 groups, 1,024), one block table
each, beside the one-table scheduler in the same run (ratio printed).

``--spec`` times the scheduler with n-gram and suffix speculation beside none, the
runner replaced by a stand-in that writes each request's answer from eight
1,000-token templates (from a random place among its first 100 tokens, one token in
40 varied per request) and keeps the guesses that match it: what the proposers cost per step and per output token.

    python bench/scheduler_overhead.py [--steps 200]
    python bench/scheduler_overhead.py --kv-groups 7 --window 64
    python bench/scheduler_overhead.py --spec
"""

from __future__ import annotations

import argparse
import gc
import random
import time

from pagedserve.cluster.async_engine import configure_gc_for_serving
from pagedserve.scheduler.config import CacheConfig, SchedulerConfig
from pagedserve.scheduler.outputs import ModelRunnerOutput, SampledToken
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.scheduler.spec_decode import SpeculativeConfig


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


def measure_spec(num_running: int, steps: int, spec: dict | None) -> tuple[float, float]:
    """(milliseconds per step, per output token) of steady decode with ``spec``'s
    guesses, answers written from shared templates (see the module docstring)."""
    rng = random.Random(0)
    templates = [[rng.randrange(1, 30000) for _ in range(1000)] for _ in range(8)]
    answers = {}
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=num_running, max_num_batched_tokens=max(num_running, 8192),
                        max_model_len=4096),
        CacheConfig(num_gpu_blocks=num_running * 90, block_size=16, model_id="bench"),
        speculative_config=SpeculativeConfig.from_dict(spec))
    params = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
    for i in range(num_running):
        start = rng.randrange(0, 100)  # requests run at different places of a template
        answers[f"r{i}"] = [t if j % 40 else rng.randrange(1, 30000)
                            for j, t in enumerate(templates[i % 8][start:] * 2)]
        prompt = [rng.randrange(1, 30000) for _ in range(128)]
        sched.add_request(sched.make_request(f"r{i}", prompt, params))

    def one_step() -> int:
        plan = sched.schedule()
        sampled, spec_tokens, made = {}, {}, 0
        for sr in plan.scheduled:
            req = sched.requests[sr.request_id]
            answer = answers[sr.request_id][req.num_output_tokens:]
            if sr.draft_token_ids:
                kept = 0
                while kept < len(sr.draft_token_ids) and sr.draft_token_ids[kept] == answer[kept]:
                    kept += 1
                spec_tokens[sr.request_id] = [SampledToken(t) for t in answer[:kept + 1]]
                made += kept + 1
            elif sr.sample_ids:
                sampled[sr.request_id] = SampledToken(answer[0])
                made += 1
        sched.update_from_output(plan, ModelRunnerOutput(plan.step_id, sampled,
                                                         spec_tokens=spec_tokens))
        return made

    for _ in range(3):  # prefill + warm-up
        one_step()
    made = 0
    t0 = time.perf_counter()
    for _ in range(steps):
        made += one_step()
    elapsed = (time.perf_counter() - t0) * 1e3
    return elapsed / steps, elapsed / max(1, made)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--kv-groups", type=int, default=0, help="hybrid model's groups (>= 2)")
    ap.add_argument("--window", type=int, default=1024, help="sliding groups' window")
    ap.add_argument("--spec", action="store_true",
                    help="n-gram and suffix speculation beside none")
    args = ap.parse_args()
    if args.spec:
        configure_gc_for_serving()
        print(f"{'running':>8} {'method':>7} {'ms/step':>9} {'us/token':>9} "
              f"{'step vs none':>12} {'token vs none':>13}")
        for n in (64, 256):
            base = None
            for method in (None, "ngram", "suffix"):
                step_ms, token_ms = measure_spec(
                    n, args.steps, None if method is None else {"method": method})
                base = base or (step_ms, token_ms)
                print(f"{n:>8} {method or 'none':>7} {step_ms:>9.3f} {token_ms * 1e3:>9.1f} "
                      f"{step_ms / base[0]:>11.2f}x {token_ms / base[1]:>12.2f}x")
        return
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
