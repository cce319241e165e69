"""Embedding throughput: pagedserve ``LLM.embed`` against Hugging Face ``AutoModel``.

Same machine, same model (SmolLM2-135M, fp32 on CPU), same inputs, one run:
``--num-inputs`` texts of ``--min-words`` to ``--max-words`` words, last-token
pooling, L2-normalised.

- pagedserve: every input submitted at once (continuous batching, chunked
  prefill packing inputs of any length into ``--max-num-batched-tokens`` steps);
- Hugging Face: ``AutoModel`` forwards over batches of ``--hf-batch`` inputs
  sorted by length (as sentence-transformers' ``encode`` does, so padding is
  small), right-padded with an attention mask, the last real token pooled.

Prints inputs/s and tokens/s of each, the ratio, and the largest difference
between the two sets of embeddings.

    python bench/embed.py
    python bench/embed.py --num-inputs 512 --max-words 400 --json bench/figures/embed.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from collections.abc import Iterator

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

WORDS = ("paged attention keeps every request's keys and values in fixed blocks anywhere "
         "in one pool while the scheduler batches prompts continuously and shares prefixes "
         "between requests that start alike so memory waste stays small").split()


def make_inputs(tokenizer, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))))
            for _ in range(n)]


def run_pagedserve(path: str, inputs: list[list[int]], step_tokens: int
                   ) -> tuple[float, torch.Tensor]:
    from pagedserve.cluster import LLM

    llm = LLM(model=path, max_num_seqs=256, max_num_batched_tokens=step_tokens,
              enable_prefix_caching=False)
    try:
        llm.embed(inputs[:4], use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        outs = llm.embed(inputs, use_tqdm=False)
        dt = time.perf_counter() - t0
        return dt, torch.tensor([o.outputs.embedding for o in outs])
    finally:
        llm.shutdown()


def padded_batch(inputs: list[list[int]], idx: list[int]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs ``idx`` right-padded to the longest, and their attention mask."""
    width = max(len(inputs[i]) for i in idx)
    ids = torch.zeros(len(idx), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, i in enumerate(idx):
        ids[r, : len(inputs[i])] = torch.tensor(inputs[i])
        mask[r, : len(inputs[i])] = 1
    return ids, mask


def sorted_batches(inputs: list[list[int]], batch: int
                   ) -> Iterator[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """Batches of ``batch`` inputs, longest first (as sentence-transformers' ``encode``
    sorts them, so padding is small): their indices, padded ids and mask."""
    order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i]))
    for s in range(0, len(order), batch):
        idx = order[s: s + batch]
        yield idx, *padded_batch(inputs, idx)


def run_hf(path: str, inputs: list[list[int]], batch: int, pool: str = "last"
           ) -> tuple[float, torch.Tensor]:
    """HF's time and embeddings: the last real token's state, or the first's (``cls``)."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    out = torch.empty(len(inputs), model.config.hidden_size)
    with torch.inference_mode():
        model(torch.tensor([inputs[0]]))  # warm-up
        t0 = time.perf_counter()
        for idx, ids, mask in sorted_batches(inputs, batch):
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
            rows = torch.zeros(len(idx), dtype=torch.long) if pool == "cls" else mask.sum(1) - 1
            out[idx] = torch.nn.functional.normalize(hidden[torch.arange(len(idx)), rows],
                                                     dim=1)
        dt = time.perf_counter() - t0
    return dt, out


def report(title: str, inputs: list[list[int]], args: argparse.Namespace,
           ps: tuple[float, torch.Tensor], hf: tuple[float, torch.Tensor],
           hf_name: str = "HF AutoModel", ps_name: str = "pagedserve LLM.embed") -> None:
    """Print both runs' rates, the ratio and the largest difference; ``--json`` too."""
    (ps_dt, ps_out), (hf_dt, hf_out) = ps, hf
    tokens = sum(map(len, inputs))
    diff = (ps_out - hf_out).abs().max().item()
    rows = {ps_name: ps_dt,
            f"{hf_name} (sorted batches of {args.hf_batch})": hf_dt}
    print(f"{title}, {len(inputs)} inputs, {tokens} tokens "
          f"({min(map(len, inputs))}-{max(map(len, inputs))} each)")
    for name, dt in rows.items():
        print(f"{name:>48}: {len(inputs) / dt:8.1f} inputs/s {tokens / dt:9.1f} tokens/s")
    print(f"pagedserve is {hf_dt / ps_dt:.2f}x Hugging Face; max |difference| {diff:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": platform.processor() or platform.machine(),
                       "threads": torch.get_num_threads(), "args": vars(args),
                       "tokens": tokens, "seconds": {"pagedserve": ps_dt, "hf": hf_dt},
                       "speedup": hf_dt / ps_dt, "max_abs_diff": diff}, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-inputs", type=int, default=256)
    ap.add_argument("--min-words", type=int, default=8)
    ap.add_argument("--max-words", type=int, default=200)
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    from pagedserve.worker.loaders import load_tokenizer, resolve_model

    resolved = resolve_model(None)
    inputs = make_inputs(load_tokenizer(resolved), args.num_inputs, args.min_words,
                         args.max_words, args.seed)
    report("SmolLM2-135M fp32, last-token pooling", inputs, args,
           run_pagedserve(resolved.path, inputs, args.max_num_batched_tokens),
           run_hf(resolved.path, inputs, args.hf_batch))


if __name__ == "__main__":
    main()
