"""Reranking throughput: pagedserve ``LLM.score`` against Hugging Face, one run.

The reranker is the default model (SmolLM2-135M, fp32 on CPU) read the way
Qwen3-Reranker is served, through vLLM's ``hf_overrides``: a classifier whose
one row is the LM head's "yes" row minus its "no" row, so a pair's score is the
softmax probability of "yes" against "no" at its last token.

- pagedserve: ``LLM.score(query, documents)`` for every query, all pairs
  submitted at once (continuous batching, chunked prefill, the query's prefix
  shared through the prefix cache unless ``--no-prefix-caching``);
- Hugging Face: the model card's recipe, ``AutoModelForCausalLM`` over batches
  of ``--hf-batch`` pairs sorted by length, left-padded, only the last
  position's logits computed (``logits_to_keep=1``), softmax over "no" / "yes".

Prints pairs/s of each, the ratio, and the largest difference between scores.

    python bench/rerank.py
    python bench/rerank.py --queries 8 --docs 32 --json bench/figures/rerank.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from offline import left_pad  # the offline benchmark's left padding

WORDS = ("paged attention keeps every request's keys and values in fixed blocks anywhere "
         "in one pool while the scheduler batches prompts continuously and shares prefixes "
         "between requests that start alike so memory waste stays small").split()
PREFIX = ("Judge whether the Document meets the requirements based on the Query. Note "
          "that the answer can only be \"yes\" or \"no\".\n<Query>: ")
OVERRIDES = {"architectures": ["LlamaForSequenceClassification"],
             "classifier_from_token": ["no", "yes"], "method": "from_2_way_softmax"}


def make_pairs(n_queries: int, n_docs: int, lo: int, hi: int, seed: int
               ) -> tuple[list[str], list[list[str]]]:
    rng = random.Random(seed)

    def text(a: int, b: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(a, b)))

    queries = [PREFIX + text(8, 24) + "\n<Document>: " for _ in range(n_queries)]
    return queries, [[text(lo, hi) for _ in range(n_docs)] for _ in queries]


def run_pagedserve(path: str, queries: list[str], docs: list[list[str]], step_tokens: int,
                   prefix_caching: bool) -> tuple[float, list[float]]:
    from pagedserve.cluster import LLM

    llm = LLM(model=path, hf_overrides=OVERRIDES, max_num_seqs=256,
              max_num_batched_tokens=step_tokens, enable_prefix_caching=prefix_caching)
    try:
        llm.score(queries[0], docs[0][:2])  # warm-up
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        firsts = [q for q, ds in zip(queries, docs, strict=True) for _ in ds]
        outs = llm.score(firsts, [d for ds in docs for d in ds], use_tqdm=False)
        return time.perf_counter() - t0, [o.outputs.score for o in outs]
    finally:
        llm.shutdown()


def run_hf(path: str, queries: list[str], docs: list[list[str]], batch: int
           ) -> tuple[float, list[float]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    no, yes = tok.convert_tokens_to_ids(["no", "yes"])
    pairs = [tok(q + d)["input_ids"] for q, ds in zip(queries, docs, strict=True)
             for d in ds]  # joined, as an LLM made a reranker reads a pair
    order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i]))
    scores = [0.0] * len(pairs)
    with torch.inference_mode():
        model(torch.tensor([pairs[0]]), logits_to_keep=1)  # warm-up
        t0 = time.perf_counter()
        for s in range(0, len(order), batch):
            idx = order[s: s + batch]
            ids, mask = left_pad([pairs[i] for i in idx])  # every row's last position last
            pos = (mask.cumsum(1) - 1).clamp(min=0)
            last = model(input_ids=ids, attention_mask=mask, position_ids=pos,
                         logits_to_keep=1).logits[:, -1]
            p = torch.softmax(last[:, [no, yes]], -1)[:, 1]
            for r, i in enumerate(idx):
                scores[i] = p[r].item()
        dt = time.perf_counter() - t0
    return dt, scores


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--queries", type=int, default=8)
    ap.add_argument("--docs", type=int, default=32, help="documents per query")
    ap.add_argument("--min-words", type=int, default=16)
    ap.add_argument("--max-words", type=int, default=160)
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    from pagedserve.worker.loaders import resolve_model

    path = resolve_model(None).path
    queries, docs = make_pairs(args.queries, args.docs, args.min_words, args.max_words,
                               args.seed)
    ps_dt, ps = run_pagedserve(path, queries, docs, args.max_num_batched_tokens,
                               not args.no_prefix_caching)
    hf_dt, hf = run_hf(path, queries, docs, args.hf_batch)
    n = len(ps)
    diff = max(abs(a - b) for a, b in zip(ps, hf, strict=True))
    print(f"SmolLM2-135M fp32 as a yes/no reranker, {args.queries} queries x {args.docs} "
          f"documents of {args.min_words}-{args.max_words} words")
    for name, dt in {"pagedserve LLM.score": ps_dt,
                     f"HF causal LM, sorted batches of {args.hf_batch}": hf_dt}.items():
        print(f"{name:>40}: {n / dt:8.1f} pairs/s")
    print(f"pagedserve is {hf_dt / ps_dt:.2f}x Hugging Face; max |score difference| "
          f"{diff:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": platform.processor() or platform.machine(),
                       "threads": torch.get_num_threads(), "args": vars(args), "pairs": n,
                       "seconds": {"pagedserve": ps_dt, "hf": hf_dt},
                       "speedup": hf_dt / ps_dt, "max_abs_diff": diff}, f, indent=1)


if __name__ == "__main__":
    main()
