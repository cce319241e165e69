"""Mamba-1's native CPU kernels against its torch paths, side by side in one engine.

The same random Jamba-shaped model as ``bench/moe.py --kind jamba`` (8 layers, hidden
512, one attention layer, 32 experts 256 wide in every other layer, 16 state
dimensions a channel), one engine, the same requests run in alternating rounds with
``kernels.cpu_mamba``'s kernels all on ("native"), with the SSM's off ("torch": the
chunked prefix scan, the gather / update / scatter of ``layers.mamba1``) and with
only the causal convolution's step off ("torch conv": ``layers.causal_conv``'s
gather / concatenate / scatter, which every recurrent mixer runs). Prints each
round's tokens/s, each path's median against the native one, and whether every path
gave the same greedy tokens.

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
    native, conv = cpu_mamba.available, cpu_mamba.conv_available
    llm = LLM(model=path, num_gpu_blocks=4096, block_size=16)
    rates: dict[str, list[float]] = {"native": [], "torch": [], "torch conv": []}
    tokens: dict[str, list[list[int]]] = {}
    try:
        llm.generate(prompts[:4], params, use_tqdm=False)  # (warm-up: build, first steps)
        for _ in range(args.rounds):
            for name in rates:
                cpu_mamba.available = (lambda ssm: False) if name == "torch" else native
                cpu_mamba.conv_available = (lambda *a: False) if name == "torch conv" \
                    else conv
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                rate = args.num_prompts * args.output_len / (time.perf_counter() - start)
                rates[name].append(rate)
                tokens[name] = [o.outputs[0].token_ids for o in outs]
                print(f"{name}: {rate:.1f} tokens/s", flush=True)
    finally:
        cpu_mamba.available, cpu_mamba.conv_available = native, conv
        llm.shutdown()
        scratch.cleanup()
    medians = {name: statistics.median(r) for name, r in rates.items()}
    ratios = {name: medians["native"] / m for name, m in medians.items() if name != "native"}
    same = tokens["native"] == tokens["torch"] == tokens["torch conv"]
    print(f"\n{args.num_prompts} prompts (10-75 tokens), {args.output_len} new tokens each, "
          f"{args.rounds} rounds a path; native / torch (medians): {ratios['torch']:.2f}x, "
          f"native / torch conv: {ratios['torch conv']:.2f}x; same tokens: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "tokens_per_s": rates, "ratios": ratios,
                       "same_tokens": same}, f, indent=2)


if __name__ == "__main__":
    main()
