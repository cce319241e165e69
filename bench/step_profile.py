"""Where a step's time goes: per-component milliseconds of the prefill and decode steps.

Queues the offline benchmark's prompts (SmolLM2, 64 by default), times the
prefill step (all prompts in one step), then ``--steps`` decode steps, with
the model's parts wrapped in timers: projections (GEMMs, LM head included),
paged attention (store K/V + kernel; the store also alone), RMSNorm, RoPE,
SiLU-and-multiply, sampling and input preparation. What is left of
``execute`` is Python and small ops.
The wrappers add a few microseconds per call, well under a step's noise.

    python bench/step_profile.py                    # fp32, 64 sequences
    python bench/step_profile.py --dtype bfloat16
    python bench/step_profile.py --quantization int8
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from offline import make_prompts  # the offline benchmark's prompts

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.kernels import cpu_fused
from pagedserve.kernels.cpu_backend import CpuNativeBackend
from pagedserve.worker import model_runner, sampler
from pagedserve.worker.layers import attention, norm, packed, rotary
from pagedserve.worker.loaders import load_tokenizer, resolve_model

PARTS = [  # (owner, attribute, label)
    (model_runner.ModelRunner, "execute", "execute (whole forward + sampling)"),
    (packed.PackableLinear, "matmul", "projections (GEMM)"),
    (attention.PagedAttention, "__call__", "attention (store + paged kernel)"),
    (CpuNativeBackend, "store_kv", "  of which the K/V store"),
    (norm.RMSNorm, "forward", "RMSNorm"),
    (rotary.RotaryEmbedding, "apply", "RoPE"),
    (cpu_fused, "silu_and_mul", "SiLU-and-multiply"),
    (sampler.Sampler, "sample", "sampling"),
    (model_runner.ModelRunner, "prepare_inputs", "input preparation"),
]


def instrument(spent: collections.Counter, calls: collections.Counter) -> None:
    """Wrap every part in a timer that adds to ``spent`` / ``calls``."""
    for owner, attr, label in PARTS:
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        def timed(*a, _fn=fn, _label=label, **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                spent[_label] += time.perf_counter() - t0
                calls[_label] += 1

        setattr(owner, attr, timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-seqs", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", choices=("int8", "int4"), default=None)
    args = ap.parse_args()
    path = resolve_model(None).path
    prompts = make_prompts(load_tokenizer(path), args.num_seqs, seed=0)
    llm = LLM(model=path, dtype=args.dtype, max_num_seqs=args.num_seqs,
              max_num_batched_tokens=4096, quantization=args.quantization)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 4, ignore_eos=True)
    spent: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    instrument(spent, calls)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    for p in prompts:
        engine.add_request(p, params)
    spent.clear()
    calls.clear()
    t0 = time.perf_counter()
    engine.step()  # the prefill
    prefill_ms = (time.perf_counter() - t0) * 1e3
    print(f"{args.num_seqs} sequences, {args.dtype}: prefill of {sum(map(len, prompts))} "
          f"prompt tokens {prefill_ms / 1e3:.2f} s (one step)")
    report(spent, calls, prefill_ms, 1)
    engine.step()  # first decode: workspaces
    spent.clear()
    calls.clear()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step_ms = (time.perf_counter() - t0) / args.steps * 1e3
    print(f"contexts {min(map(len, prompts))}-{max(map(len, prompts)) + args.steps + 2} "
          f"tokens: {step_ms:.1f} ms per decode step")
    report(spent, calls, step_ms, args.steps)
    llm.shutdown()


def report(spent: collections.Counter, calls: collections.Counter, total_ms: float,
           steps: int) -> None:
    """Each part's milliseconds per step, its share of ``total_ms`` and calls per step."""
    for _, _, label in PARTS:
        ms = spent[label] / steps * 1e3
        print(f"  {label:36s} {ms:8.2f} ms  {100 * ms / total_ms:5.1f}%  "
              f"{calls[label] / steps:5.0f} calls")


if __name__ == "__main__":
    main()
