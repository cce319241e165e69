"""Mamba-1's native CPU kernels against its torch path, side by side in one engine.

The same random Jamba-shaped model as ``bench/moe.py --kind jamba`` (8 layers, hidden
512, one attention layer, 32 experts 256 wide in every other layer, 16 state
dimensions a channel), one engine, the same requests run in alternating rounds with
``kernels.cpu_mamba``'s kernels on (a prompt's scan and a batch's one-token update in
native passes) and off (``layers.mamba1``'s torch paths: the chunked prefix scan, the
gather / update / scatter). Prints each round's tokens/s, the ratio of the medians,
and whether both paths gave the same greedy tokens.

    python bench/mamba1_native.py
    python bench/mamba1_native.py --rounds 5 --json bench/figures/mamba1_native.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from moe import random_hybrid_checkpoint  # the MoE benchmark's model shapes

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from pagedserve.cluster import LLM, SamplingParams
    from pagedserve.kernels import cpu_mamba, cpu_native

    if cpu_native.load() is None:
        sys.exit("no C compiler: the native kernels are off, nothing to compare")
    scratch, path = random_hybrid_checkpoint("jamba", 512, 8, "mamba1-native-")
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 30000) for _ in range(rng.randrange(10, 76))]
               for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    native = cpu_mamba.available
    llm = LLM(model=path, num_gpu_blocks=4096, block_size=16)
    rates: dict[str, list[float]] = {"native": [], "torch": []}
    tokens: dict[str, list[list[int]]] = {}
    try:
        llm.generate(prompts[:4], params, use_tqdm=False)  # (warm-up: build, first steps)
        for _ in range(args.rounds):
            for name in ("native", "torch"):
                cpu_mamba.available = native if name == "native" else (lambda ssm: False)
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                rate = args.num_prompts * args.output_len / (time.perf_counter() - start)
                rates[name].append(rate)
                tokens[name] = [o.outputs[0].token_ids for o in outs]
                print(f"{name}: {rate:.1f} tokens/s", flush=True)
    finally:
        cpu_mamba.available = native
        llm.shutdown()
        scratch.cleanup()
    ratio = statistics.median(rates["native"]) / statistics.median(rates["torch"])
    same = tokens["native"] == tokens["torch"]
    print(f"\n{args.num_prompts} prompts (10-75 tokens), {args.output_len} new tokens each, "
          f"{args.rounds} rounds a path; native / torch (medians): {ratio:.2f}x; "
          f"same tokens: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "tokens_per_s": rates, "ratio": ratio,
                       "same_tokens": same}, f, indent=2)


if __name__ == "__main__":
    main()
