"""KV memory: paged blocks vs contiguous reservations, and fork sharing for n=3.

Part 1 counts how many requests fit a fixed KV budget when each holds
``B * ceil(n / B)`` slots (paged) versus a max-length reservation, on the
seed-004 lengths and on a long-tailed (log-normal) mix.
Part 2 runs the real scheduler: peak blocks of one ``n=3`` request with a long
prompt versus three independent requests (prefix caching off, and on).
Part 3, the same scheduler: peak blocks of a long request to a model whose every
layer slides (Mistral v0.1's 4,096-token window), blocks behind the window kept
versus released (``--window``).
Part 4, the same scheduler: peak KV bytes of a long request to a model that mixes
full and sliding layers (Gemma 3 4B's shape: 34 layers, every sixth full, a
1,024-token window), one block table for every layer versus one per KV cache group
(``scheduler.kv_groups``), counted in layer-blocks (a block of one layer).

    python bench/memory.py
"""

from __future__ import annotations

import argparse
import random

from pagedserve.scheduler.config import CacheConfig, SchedulerConfig
from pagedserve.scheduler.kv_groups import plan_kv_groups
from pagedserve.scheduler.memory import allocated_slots
from pagedserve.scheduler.outputs import ModelRunnerOutput, SampledToken
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler

SEED_004 = [37, 91, 128, 201, 511]


def fits(lengths: list[int], budget_slots: int, slots_of) -> int:
    """How many requests, taken in order (cycling), fit the budget."""
    used = count = 0
    while True:
        need = slots_of(lengths[count % len(lengths)])
        if used + need > budget_slots:
            return count
        used += need
        count += 1


def concurrency_table(max_len: int, budget_slots: int, seed: int) -> None:
    rng = random.Random(seed)
    mixes = {
        "seed-004": SEED_004,
        "long-tail": [min(max_len, max(8, int(rng.lognormvariate(5.0, 1.0)))) for _ in range(500)],
    }
    print(f"KV budget {budget_slots} token slots, max length {max_len}")
    print(f"{'mix':<10} {'scheme':<22} {'requests':>9} {'utilisation':>12} {'vs reserve':>11}")
    for name, lengths in mixes.items():
        schemes = {
            f"reserve {max_len}": lambda n: max_len,
            "paged B=16": lambda n: allocated_slots(n, 16),
            "paged B=32": lambda n: allocated_slots(n, 32),
        }
        base = None
        for label, slots_of in schemes.items():
            k = fits(lengths, budget_slots, slots_of)
            toks = sum(lengths[i % len(lengths)] for i in range(k))
            held = sum(slots_of(lengths[i % len(lengths)]) for i in range(k))
            base = base or k
            print(f"{name:<10} {label:<22} {k:>9} {100 * toks / held:>11.2f}% {k / base:>10.2f}x")


def peak_blocks(prompt_len: int, max_tokens: int, n: int, copies: int, caching: bool,
                window: int | None = None, budget: int = 8192,
                groups: tuple[int | None, ...] = ()) -> int:
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_model_len=32768),
        CacheConfig(
            num_gpu_blocks=16384, block_size=16, enable_prefix_caching=caching,
            model_id="bench", sliding_window=window, kv_group_windows=groups,
        ),
    )
    prompt = [(7 * j) % 30000 + 1 for j in range(prompt_len)]
    params = SamplingParams(n=n, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for c in range(copies):
        sched.add_request(sched.make_request(f"r{c}", prompt, params))
    peak = 0
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        out = ModelRunnerOutput(
            plan.step_id,
            {
                sid: SampledToken(1 + sum(map(ord, sid)) % 100)
                for sr in plan.scheduled
                for sid in sr.sample_ids
            },
        )
        peak = max(peak, sched.memory_stats().num_used_blocks)
        sched.update_from_output(plan, out)
    return peak


def fork_table(prompt_len: int, max_tokens: int) -> None:
    forked = peak_blocks(prompt_len, max_tokens, n=3, copies=1, caching=True)
    alone = peak_blocks(prompt_len, max_tokens, n=1, copies=3, caching=False)
    alone_cached = peak_blocks(prompt_len, max_tokens, n=1, copies=3, caching=True)
    print(f"\nprompt {prompt_len} tokens, {max_tokens} generated per sample, block 16")
    print(f"{'scheme':<40} {'peak blocks':>11} {'saving':>8}")
    print(f"{'3 independent requests, no prefix cache':<40} {alone:>11} {'':>8}")
    print(
        f"{'3 together, prefix cache':<40} {alone_cached:>11} "
        f"{100 * (1 - alone_cached / alone):>7.1f}%"
    )
    print(
        f"{'one n=3 request (fork + copy-on-write)':<40} {forked:>11} "
        f"{100 * (1 - forked / alone):>7.1f}%   goal >= 55%"
    )


def window_table(prompt_len: int, max_tokens: int, window: int) -> None:
    kept = peak_blocks(prompt_len, max_tokens, 1, 1, True, budget=2048)
    released = peak_blocks(prompt_len, max_tokens, 1, 1, True, window=window, budget=2048)
    print(f"\nsliding window {window}: prompt {prompt_len} tokens, {max_tokens} generated, "
          "block 16, 2,048-token steps")
    print(f"{'blocks behind the window':<40} {'peak blocks':>11}")
    print(f"{'kept':<40} {kept:>11}")
    print(f"{'released':<40} {released:>11}   {kept / released:.2f}x fewer")


def hybrid_table(prompt_len: int, max_tokens: int, num_layers: int, pattern: int,
                 window: int) -> None:
    layers = [None if (i + 1) % pattern == 0 else window for i in range(num_layers)]
    layout = plan_kv_groups(layers)
    one = peak_blocks(prompt_len, max_tokens, 1, 1, True, budget=2048) * num_layers
    grouped = peak_blocks(prompt_len, max_tokens, 1, 1, True, budget=2048,
                          groups=layout.windows) * layout.group_size
    full = sum(w is None for w in layers)
    print(f"\n{num_layers} layers ({full} full, {num_layers - full} sliding over {window}): "
          f"prompt {prompt_len} tokens, {max_tokens} generated, block 16, 2,048-token steps")
    print(f"KV cache groups: {layout.num_groups} of {layout.group_size} layers "
          f"(unused slots: {layout.num_groups * layout.group_size - num_layers})")
    print(f"{'block tables':<40} {'peak layer-blocks':>17}")
    print(f"{'one for every layer':<40} {one:>17}")
    print(f"{'one per KV cache group':<40} {grouped:>17}   {one / grouped:.2f}x fewer")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--budget-slots", type=int, default=65536)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--window-prompt-len", type=int, default=16384)
    args = ap.parse_args()
    concurrency_table(args.max_len, args.budget_slots, args.seed)
    fork_table(args.prompt_len, args.max_tokens)
    window_table(args.window_prompt_len, 512, args.window)
    hybrid_table(args.window_prompt_len, 512, 34, 6, 1024)


if __name__ == "__main__":
    main()
