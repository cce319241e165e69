"""Host time per engine step outside the forward pass, by output kind.

On a GPU a small model's step is bound by this Python (scheduling, applying
tokens, detokenising, building outputs), not by the device: the H200 window ran
SmolLM2-135M at 0.6% of the GEMM roofline. Here the forward is a 1-layer,
64-wide random model with a 1,024-token vocabulary (SmolLM2's tokenizer
truncated), so what is left of a step is mostly that host work.

Three ways of running the same requests, interleaved in one process:
  ``cumulative``: a whole snapshot of every request each step, detokenised
                  through the transformers tokenizer's ``decode`` (the engine
                  before output kinds and the Rust decode path);
  ``delta``:      what an engine replica streams now: each output holds only
                  what is new, the Rust ``DecodeStream`` behind the tokenizer;
  ``final_only``: what ``LLM.generate`` does now: one output per request.
The figure is wall time minus the engine's ``execute_seconds``, per step. A
cumulative snapshot copies the whole output so far, so its cost grows with
``--output-len``; the other two do not.

    python bench/host_overhead.py [--num-seqs 128] [--output-len 128] [--reps 3]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from contextlib import nullcontext
from unittest import mock

import torch

from pagedserve.cluster import LLM, SamplingParams, detokenizer
from pagedserve.worker.testing import write_random_checkpoint

KINDS = ("cumulative", "delta", "final_only")


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, kind: str
        ) -> tuple[float, float, list[str]]:
    """(host ms per step, execute ms per step, texts) for one pass over ``prompts``."""
    eng = llm.engine
    patch = (mock.patch.object(detokenizer, "rust_decode", lambda tok: None)
             if kind == "cumulative" else nullcontext())
    with patch:
        e0, t0, steps = eng.stats["execute_seconds"], time.perf_counter(), 0
        ids = [eng.add_request(p, params, output_kind=kind) for p in prompts]
        texts: dict[str, str] = {}
        while eng.has_unfinished_requests():
            for out in eng.step():  # a stream's consumer: the text so far
                if out.delta:
                    texts[out.request_id] = texts.get(out.request_id, "") + out.outputs[0].text
                else:
                    texts[out.request_id] = out.outputs[0].text
            steps += 1
        wall = time.perf_counter() - t0
    execute = eng.stats["execute_seconds"] - e0
    return (wall - execute) / steps * 1e3, execute / steps * 1e3, [texts[i] for i in ids]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-seqs", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    path = tempfile.mkdtemp(prefix="host-overhead-")
    write_random_checkpoint(path, num_hidden_layers=1, vocab_size=1024,
                            max_position_embeddings=max(512, 128 + args.output_len))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(10, 75))]
               for _ in range(args.num_seqs)]
    llm = LLM(model=path, device="cpu", max_num_seqs=args.num_seqs)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    run(llm, prompts[:8], params, "final_only")  # warm-up
    best: dict[str, tuple[float, float]] = {}
    texts = {}
    for _ in range(args.reps):
        for kind in KINDS:
            host, execute, texts[kind] = run(llm, prompts, params, kind)
            if kind not in best or host < best[kind][0]:
                best[kind] = (host, execute)
    llm.shutdown()
    assert texts["cumulative"] == texts["delta"] == texts["final_only"], "texts differ"
    print(f"{args.num_seqs} sequences x {args.output_len} tokens, best of {args.reps} "
          f"(interleaved), 1 torch thread")
    for kind in KINDS:
        host, execute = best[kind]
        print(f"  {kind:10s} host {host:6.2f} ms/step  (forward + sampling {execute:6.2f} ms)"
              f"  cumulative / this: {best['cumulative'][0] / host:.2f}x")


if __name__ == "__main__":
    main()
