"""What custom logits processors cost: the same generation with none loaded, with one
loaded that no request uses, and with every request using it, one run.

A loaded processor makes the scheduler ship each sampled row's prompt and output
ids every step (``SchedulerConfig.output_history``), keeps vLLM's persistent
batch for it on the sampling rank (``worker.logits_processors.ProcessorBatch``)
and copies the step's logits rows once; a request that uses it then pays its own
``apply``. Here the processor is Hugging Face's ``no_repeat_ngram_size`` through
vLLM's per-request adapter (``worker.testing_logits.NoRepeatNgramProcessor``), a
Python function per row and step, as most custom processors are.

    python bench/logits_processors.py
    python bench/logits_processors.py --num-prompts 64 --output-len 64 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from offline import make_prompts  # the offline benchmark's prompts

PROCESSOR = "pagedserve.worker.testing_logits:NoRepeatNgramProcessor"


def run(prompts: list[list[int]], out_len: int, loaded: bool, used: bool) -> float:
    """Seconds to generate ``out_len`` greedy tokens for every prompt."""
    from pagedserve.cluster import LLM, SamplingParams

    llm = LLM(logits_processors=[PROCESSOR] if loaded else None, max_num_seqs=256)
    extra = {"no_repeat_ngram_size": 3} if used else None
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True,
                            extra_args=extra)
    try:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        assert all(len(o.outputs[0].token_ids) == out_len for o in outs)
        return dt
    finally:
        llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    from pagedserve.worker.loaders import load_tokenizer, resolve_model

    prompts = make_prompts(load_tokenizer(resolve_model(None)), args.num_prompts, args.seed)
    configs = {"none loaded": (False, False), "loaded, unused": (True, False),
               "loaded, every request": (True, True)}
    # Each configuration runs --reps times, in turn, and keeps its best time: the
    # first engine of a process pays one-time costs the others do not.
    times: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.reps):
        for name, (loaded, used) in configs.items():
            times[name].append(run(prompts, args.output_len, loaded, used))
    runs = {name: min(ts) for name, ts in times.items()}
    tokens = args.num_prompts * args.output_len
    base = runs["none loaded"]
    print(f"SmolLM2-135M fp32, {args.num_prompts} prompts x {args.output_len} greedy tokens, "
          f"processor {PROCESSOR.rsplit(':', 1)[1]}")
    for name, dt in runs.items():
        print(f"{name:>24}: {tokens / dt:8.1f} tokens/s  {base / dt:5.2f}x of none loaded")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": platform.processor() or platform.machine(),
                       "threads": torch.get_num_threads(), "args": vars(args),
                       "tokens": tokens, "seconds": times,
                       "relative": {k: base / v for k, v in runs.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
