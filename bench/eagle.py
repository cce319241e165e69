"""What an EAGLE head's guesses cost, side by side in one run on one machine: pagedserve
with ``speculative_config={"method": "eagle"}``, with a draft model
(``"draft_model"``) and without guesses, against Hugging Face ``generate`` with and
without assisted generation (``assistant_model``), greedy, fp32 on CPU.

No trained head is on this machine (released heads are for 7B+ targets, and nothing
is downloaded), so the acceptance a real head reaches is not measured here. What is
measured is the other half of the trade: the cost per guess at equal acceptance.
The target is SmolLM2-135M-shaped (30 layers, hidden 576, random weights) and built
so that its next token depends on its last token only, with a one-layer head that
computes exactly that (``worker.testing_eagle.write_guessing_pair``); the draft
model and HF's assistant are the target itself. Every guess of all three is kept,
so the differences are what drafting costs: one layer a guess for the head, 30 for
the draft. A real head keeps fewer, which scales the gain over plain decoding down
with the tokens kept a step, not the cost of a guess.

Requests run one at a time (latency; assisted generation takes batch 1 only), and
pagedserve also runs the prompts as one batch. Prints output tokens/s of each, the
head's speed-up over plain decoding, over the draft model and over HF's assisted
generation, the share of guesses kept, and whether all greedy tokens agree.

    python bench/eagle.py --json bench/figures/eagle.json
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
from provenance import machine, tree_commit, write_figures  # sibling scripts
from spec_decode import run_pagedserve


def run_hf(model, prompts: list[list[int]], max_tokens: int, assistant=None
           ) -> tuple[float, list[list[int]]]:
    """HF ``generate`` one prompt at a time, to ``max_tokens`` whatever it says; with
    ``assistant``, assisted generation."""
    outs = []
    kw = {} if assistant is None else {"assistant_model": assistant}
    t0 = time.perf_counter()
    with torch.inference_mode():
        for p in prompts:
            x = torch.tensor([p])
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                               max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                               pad_token_id=0, **kw)
            outs.append(y[0, len(p):].tolist())
    return sum(map(len, outs)) / (time.perf_counter() - t0), outs


def _kept(llm, before: dict) -> float:
    after = llm.engine.get_stats()["spec_decode"]
    sent = after["num_draft_tokens"] - before["num_draft_tokens"]
    return (after["num_accepted_tokens"] - before["num_accepted_tokens"]) / max(sent, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    commit = tree_commit()
    from transformers import AutoModelForCausalLM

    from pagedserve.cluster import LLM
    from pagedserve.worker.testing import SMOLLM2_135M
    from pagedserve.worker.testing_eagle import write_guessing_pair

    shape = {k: v for k, v in SMOLLM2_135M.items() if k != "num_hidden_layers"}
    target, head = write_guessing_pair(tempfile.mkdtemp(), None, num_layers=args.layers,
                                       **shape)
    prompts = [[(97 * i + 13 * j) % 40000 + 100 for j in range(24 + 8 * i)]
               for i in range(args.num_prompts)]
    k = args.num_speculative_tokens
    specs = {"plain": None,
             "draft_model": {"model": target, "num_speculative_tokens": k},
             "eagle": {"method": "eagle", "model": head, "num_speculative_tokens": k}}
    rows: dict[str, dict] = {}
    tokens: dict[str, list[list[int]]] = {}
    for name, spec in specs.items():
        llm = LLM(model=target, dtype="float32", speculative_config=spec)
        try:
            run_pagedserve(llm, prompts[:2], 8, False, ignore_eos=True)  # warm-up
            before = llm.engine.get_stats().get("spec_decode") or {}
            seq, tokens[name] = run_pagedserve(llm, prompts, args.max_tokens, False,
                                                ignore_eos=True)
            kept = _kept(llm, before) if spec else None
            batch, _ = run_pagedserve(llm, prompts, args.max_tokens, True, ignore_eos=True)
        finally:
            llm.shutdown()
        rows[name] = {"one_at_a_time_tok_s": seq, "batch_tok_s": batch, "kept": kept}
        print(f"pagedserve {name:12s} one at a time {seq:7.1f} tok/s   batch of "
              f"{len(prompts)} {batch:7.1f} tok/s" + (f"   kept {kept:.0%}" if spec else ""),
              flush=True)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    assistant = copy.deepcopy(model)
    assistant.generation_config.num_assistant_tokens = k
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    hf_plain, tokens["hf"] = run_hf(model, prompts, args.max_tokens)
    hf_assist, tokens["hf_assisted"] = run_hf(model, prompts, args.max_tokens, assistant)
    print(f"HF generate            one at a time {hf_plain:7.1f} tok/s")
    print(f"HF assisted (self)     one at a time {hf_assist:7.1f} tok/s")
    eagle, draft = rows["eagle"], rows["draft_model"]
    ratios = {
        "eagle_over_plain": eagle["one_at_a_time_tok_s"] / rows["plain"]["one_at_a_time_tok_s"],
        "eagle_over_draft_model": eagle["one_at_a_time_tok_s"] / draft["one_at_a_time_tok_s"],
        "eagle_over_hf_assisted": eagle["one_at_a_time_tok_s"] / hf_assist,
        "eagle_over_hf_plain": eagle["one_at_a_time_tok_s"] / hf_plain,
        "eagle_over_plain_batch": eagle["batch_tok_s"] / rows["plain"]["batch_tok_s"],
        "eagle_over_draft_model_batch": eagle["batch_tok_s"] / draft["batch_tok_s"],
    }
    agree = len({str(t) for t in tokens.values()}) == 1
    for key, v in ratios.items():
        print(f"{key:30s} {v:5.2f}x")
    print(f"greedy tokens agree across all five: {agree}   ({machine()}, {commit})")
    if args.json:
        write_figures(args.json, args, commit, rows=rows, hf_tok_s=hf_plain,
                      hf_assisted_tok_s=hf_assist, ratios=ratios, tokens_agree=agree)


if __name__ == "__main__":
    main()
