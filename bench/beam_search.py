"""Beam search: pagedserve ``LLM.beam_search`` against Hugging Face ``num_beams``.

Same machine, same model (SmolLM2-135M, fp32 on CPU), same prompts, one run:
``--num-prompts`` prompts of 8-60 words (the offline benchmark's), every beam
running ``--max-tokens`` new tokens (EOS off on both sides, so the work is
fixed and the beams comparable).

- pagedserve: all prompts in one ``beam_search`` call (each prompt one
  request whose beams fork on each other's KV blocks in the scheduler; each
  step computes one token per live beam);
- Hugging Face, one prompt at a time (``generate(num_beams=W)``, its KV cache
  reordered per step), and all prompts in one left-padded batch.

Prints seconds and generated tokens/s (beams x new tokens) of each, the
ratios, and how many prompts' best beams agree token for token with HF's.

    python bench/beam_search.py
    python bench/beam_search.py --num-prompts 16 --beam-width 4 --max-tokens 32 \
        --json bench/figures/beam_search.json
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


def run_pagedserve(path: str, prompts: list[list[int]], width: int, new: int,
                   block_size: int | None) -> tuple[float, list[list[int]]]:
    from pagedserve.cluster import LLM, BeamSearchParams

    llm = LLM(model=path, max_num_seqs=max(64, width * len(prompts)), block_size=block_size)
    try:
        llm.beam_search([{"prompt_token_ids": prompts[0]}],
                        BeamSearchParams(beam_width=2, max_tokens=2))  # warm-up
        t0 = time.perf_counter()
        outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                               BeamSearchParams(beam_width=width, max_tokens=new,
                                                ignore_eos=True))
        return time.perf_counter() - t0, [o.sequences[0].completion_token_ids for o in outs]
    finally:
        llm.shutdown()


def run_hf(path: str, prompts: list[list[int]], width: int, new: int, batched: bool
           ) -> tuple[float, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    kw = dict(num_beams=width, num_return_sequences=1, do_sample=False, max_new_tokens=new,
              pad_token_id=0, eos_token_id=None)
    best = []
    with torch.inference_mode():
        t0 = time.perf_counter()
        if batched:
            n = max(map(len, prompts))
            x = torch.tensor([[0] * (n - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in prompts])
            y = model.generate(x, attention_mask=mask, **kw)
            best = [row[n:].tolist() for row in y]
        else:
            for p in prompts:
                x = torch.tensor([p])
                y = model.generate(x, attention_mask=torch.ones_like(x), **kw)
                best.append(y[0, len(p):].tolist())
        return time.perf_counter() - t0, best


def main() -> None:
    from pagedserve.worker.loaders import load_tokenizer, resolve_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--beam-width", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=None,
                    help="pagedserve's KV block size (default: the engine's)")
    ap.add_argument("--skip-hf", action="store_true", help="pagedserve only")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model(None).path
    prompts = make_prompts(load_tokenizer(path), args.num_prompts, seed=0)
    w, new = args.beam_width, args.max_tokens
    runs = {"pagedserve": run_pagedserve(path, prompts, w, new, args.block_size)}
    if not args.skip_hf:
        runs["hf_sequential"] = run_hf(path, prompts, w, new, batched=False)
        runs["hf_batched"] = run_hf(path, prompts, w, new, batched=True)
    tokens = len(prompts) * w * new
    print(f"\n{len(prompts)} prompts, beam width {w}, {new} new tokens per beam, "
          f"SmolLM2-135M fp32, {args.threads} threads, {platform.processor() or 'CPU'}")
    print(f"{'engine':16s} {'seconds':>8s} {'beam tok/s':>11s} {'pagedserve x':>13s} "
          f"{'best beam = pagedserve':>23s}")
    ours_s, ours_best = runs["pagedserve"]
    result = {"args": vars(args), "seconds": {}, "best_beam_agreement": {}}
    for name, (s, best) in runs.items():
        agree = sum(a == b for a, b in zip(best, ours_best, strict=True))
        print(f"{name:16s} {s:8.2f} {tokens / s:11.1f} {s / ours_s:12.2f}x "
              f"{agree:>17d} / {len(prompts)}")
        result["seconds"][name] = s
        result["best_beam_agreement"][name] = agree
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
