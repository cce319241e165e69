"""Suffix decoding against n-gram lookup and plain decoding, side by side in one run
on one machine: pagedserve with ``speculative_config={"method": "suffix"}``, with
``{"method": "ngram"}`` (k = 4, 2-4 token n-grams: the defaults) and without
guesses, and Hugging Face ``generate`` with and without prompt lookup as the peer
(it has no suffix decoding); same model (SmolLM2-135M-Instruct, fp32 on CPU by
default), same chat prompts, greedy.

Four workloads, run in this order against the same three engines, so the suffix
engine's cache holds what a server's would:

- ``open``: open questions (nothing to guess from; what guessing costs);
- ``grounded``: answers that quote their prompt (n-gram lookup's home ground);
- ``agentic``: the same instruction over different records (JSON tool calls),
  whose answers share their shape with the answers before them;
- ``repeat``: the grounded prompts again, as a retry or self-refinement loop sends
  them (their answers are cached).

Requests run one at a time (latency; HF's prompt lookup only takes batch 1), and
pagedserve also runs each workload as one batch, on a second set of engines that
sees the workloads in the same order (so no batch is answered from the first set's
cache). Prints output tokens/s of each,
the suffix engine's speed-up over plain decoding, over n-gram lookup and over HF's
prompt lookup, the share of its guesses accepted, and whether greedy tokens agree.

    python bench/suffix_decode.py --json bench/figures/suffix_decode.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from spec_decode import GROUNDED, OPEN, chat_ids, run_hf, run_pagedserve  # sibling script

RECORDS = [("Alice", 31, "Paris", "engineer"), ("Bob", 27, "Berlin", "teacher"),
           ("Carol", 45, "Madrid", "doctor"), ("Dan", 19, "Rome", "student"),
           ("Erin", 52, "Vienna", "pilot"), ("Frank", 38, "Lisbon", "chef")]
AGENTIC = [f"Call the tool add_user. Reply with only a JSON object with keys \"name\", "
           f"\"age\", \"city\" and \"job\" for: {n} is {a}, lives in {c} and works as a {j}."
           for n, a, c, j in RECORDS]
WORKLOADS = (("open", OPEN), ("grounded", GROUNDED), ("agentic", AGENTIC),
             ("repeat", GROUNDED))
ARMS = ("plain", "ngram", "suffix")


def spec_delta(llm, before: dict) -> tuple[int, int]:
    after = llm.engine.get_stats()["spec_decode"]
    return (after["num_draft_tokens"] - before["num_draft_tokens"],
            after["num_accepted_tokens"] - before["num_accepted_tokens"])


def run_workload(name: str, prompts: list[list[int]], engines: dict, batch_engines: dict | None,
                 model, eos: list[int], max_tokens: int) -> dict:
    row: dict = {}
    toks: dict[str, list[list[int]]] = {}
    accepted = {}
    for arm in ARMS:
        llm = engines[arm]
        before = llm.engine.get_stats()["spec_decode"] if arm != "plain" else None
        row[arm], toks[arm] = run_pagedserve(llm, prompts, max_tokens, batched=False)
        if before is not None:
            drafted, acc = spec_delta(llm, before)
            accepted[arm] = acc / max(1, drafted)
        print(f"{name:9s} {arm:22s} {row[arm]:7.1f} tokens/s", flush=True)
    for label, lookup in (("hf_generate", None), ("hf_prompt_lookup", 4)):
        row[label], toks[label] = run_hf(model, prompts, max_tokens, lookup, eos)
        print(f"{name:9s} {label:22s} {row[label]:7.1f} tokens/s", flush=True)
    if batch_engines is not None:
        for arm in ARMS:
            label = f"{arm}_batch"
            row[label], toks[label] = run_pagedserve(batch_engines[arm], prompts, max_tokens,
                                                     batched=True)
            print(f"{name:9s} {label:22s} {row[label]:7.1f} tokens/s", flush=True)
        row["suffix_batch_vs_plain"] = row["suffix_batch"] / row["plain_batch"]
        row["suffix_batch_vs_ngram"] = row["suffix_batch"] / row["ngram_batch"]
    row["suffix_vs_plain"] = row["suffix"] / row["plain"]
    row["suffix_vs_ngram"] = row["suffix"] / row["ngram"]
    row["suffix_vs_hf_lookup"] = row["suffix"] / row["hf_prompt_lookup"]
    row["ngram_vs_plain"] = row["ngram"] / row["plain"]
    row["accepted"] = accepted
    ref = toks["plain"]
    row["same_tokens"] = {label: sum(a == b for a, b in zip(t, ref)) / len(ref)
                          for label, t in toks.items()}
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--no-batch", action="store_true", help="skip the batched runs")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedserve.cluster import LLM
    from pagedserve.worker.loaders import resolve_model

    path = resolve_model(None).path
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    configs = {"plain": None, "ngram": {"method": "ngram"}, "suffix": {"method": "suffix"}}
    sets = [{arm: LLM(dtype=args.dtype, num_gpu_blocks=512, speculative_config=cfg)
             for arm, cfg in configs.items()} for _ in range(1 if args.no_batch else 2)]
    engines, batch_engines = sets[0], (None if args.no_batch else sets[1])
    eos = list(engines["plain"].engine.eos_token_ids)
    warm = chat_ids(tok, ["Hi"])
    for llm in (llm for s in sets for llm in s.values()):
        run_pagedserve(llm, warm, 4, batched=False)
    run_hf(model, warm, 4, None, eos)
    run_hf(model, warm, 4, 4, eos)

    results = {name: run_workload(name, chat_ids(tok, texts), engines, batch_engines, model,
                                  eos, args.max_tokens)
               for name, texts in WORKLOADS}
    for llm in (llm for s in sets for llm in s.values()):
        llm.shutdown()

    print(f"\nSmolLM2-135M-Instruct, {args.dtype}, greedy, <= {args.max_tokens} new tokens, "
          f"{os.cpu_count()} CPUs; one request at a time unless 'batch'")
    print(f"{'workload':9s} {'suffix/plain':>12s} {'suffix/ngram':>12s} "
          f"{'suffix/HF lookup':>16s} {'ngram/plain':>11s} {'batch suffix/plain':>18s} "
          f"{'batch suffix/ngram':>18s} {'accepted s / n':>14s}")
    for name, r in results.items():
        acc = r["accepted"]
        print(f"{name:9s} {r['suffix_vs_plain']:11.2f}x {r['suffix_vs_ngram']:11.2f}x "
              f"{r['suffix_vs_hf_lookup']:15.2f}x {r['ngram_vs_plain']:10.2f}x "
              f"{r.get('suffix_batch_vs_plain', float('nan')):17.2f}x "
              f"{r.get('suffix_batch_vs_ngram', float('nan')):17.2f}x "
              f"{acc['suffix']:6.0%} / {acc['ngram']:4.0%}")
        print(f"          same greedy tokens as plain: {r['same_tokens']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
