"""N-gram speculative decoding, side by side in one run on one machine: pagedserve
with and without ``speculative_config={"method": "ngram"}`` against Hugging Face
``generate`` with and without its prompt lookup (``prompt_lookup_num_tokens``),
same model (SmolLM2-135M-Instruct, fp32 on CPU by default), same chat prompts,
greedy.

Two workloads: prompts whose answers quote their input (repeat, correct,
reformat, edit code: where n-gram drafts pay), and open questions (where they
mostly miss; what speculation costs when it does not help). A third, JSON
under a schema (quote extraction), runs pagedserve alone with and without
guesses: the grammar masks every guessed position. Requests run one
at a time (latency: HF's prompt lookup only takes batch 1); pagedserve also
runs each workload as one batch. Prints output tokens/s, the speed-up of each
engine's speculation over its own plain decoding, pagedserve's over HF's, the
share of pagedserve's drafts accepted, and whether the greedy tokens agree.

    python bench/spec_decode.py                 # 64 new tokens per prompt at most
    python bench/spec_decode.py --max-tokens 128 --json bench/figures/spec_decode.json
    python bench/spec_decode.py --prompt-lookup-min 1   # single-token matches too
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

PASSAGE = ("The quick brown fox jumps over the lazy dog. Paged attention stores the key value "
           "cache in fixed size blocks so that memory waste stays below four percent, and the "
           "scheduler shares blocks between requests that have the same prefix.")
CODE = ("def mean(values):\n    total = 0\n    for v in values:\n        total = total + v\n"
        "    return total / len(values)\n")
GROUNDED = [
    f"Repeat this text exactly:\n{PASSAGE}",
    "Fix the spelling mistakes in this text:\nThe quick brown fox jumsp over the lazy dgo. "
    "Paged atention stores the key value cache in fixed size blocks.",
    f"Rewrite this text, replacing 'blocks' with 'pages':\n{PASSAGE}",
    f"Add a docstring to this Python function:\n{CODE}",
    f"Rename the variable 'total' to 'acc' in this code:\n{CODE}",
    "Convert this list to JSON with keys name and age: Alice 31, Bob 27, Carol 45, Dan 19.",
]
QUOTES = [  # JSON under a schema: structured outputs, guesses masked by the grammar
    ("Albert Einstein", "imagination is more important than knowledge"),
    ("Marie Curie", "nothing in life is to be feared, it is only to be understood"),
    ("Ada Lovelace", "the analytical engine weaves algebraic patterns just as the loom "
                     "weaves flowers and leaves"),
    ("Alan Turing", "we can only see a short distance ahead, but we can see plenty there "
                    "that needs to be done"),
]
QUOTE_SCHEMA = {"type": "object", "properties": {"quote": {"type": "string"},
                                                 "author": {"type": "string"}},
                "required": ["quote", "author"], "additionalProperties": False}
OPEN = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Give three tips for staying healthy.",
    "Explain what a CPU cache is in two sentences.",
]


def chat_ids(tok, texts: list[str]) -> list[list[int]]:
    return [list(tok.apply_chat_template([{"role": "user", "content": t}],
                                         add_generation_prompt=True, tokenize=True,
                                         return_dict=False)) for t in texts]


def run_pagedserve(llm, prompts: list[list[int]], max_tokens: int, batched: bool,
                   temperature: float = 0.0, ignore_eos: bool = False
                   ) -> tuple[float, list[list[int]]]:
    """(output tokens/s, tokens per prompt): one request at a time, or one batch."""
    from pagedserve.cluster import SamplingParams

    params = SamplingParams(temperature=temperature, max_tokens=max_tokens,
                            ignore_eos=ignore_eos)
    t0 = time.perf_counter()
    if batched:
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    else:
        outs = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids
                for p in prompts]
    return sum(map(len, outs)) / (time.perf_counter() - t0), outs


def run_structured(plain, spec, tok, max_tokens: int) -> dict[str, float]:
    """Quote extraction under a JSON schema, one request at a time, with and without
    guesses (HF ``generate`` has no grammar, so no peer here)."""
    from pagedserve.cluster import SamplingParams
    from pagedserve.scheduler.sampling_params import StructuredOutputs

    prompts = chat_ids(tok, [f"Return JSON with the sentence in 'quote' and who said it in "
                             f"'author': {who} said that {what}." for who, what in QUOTES])
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                            structured_outputs=StructuredOutputs(json=QUOTE_SCHEMA))
    before = spec.engine.get_stats()["spec_decode"]
    row: dict[str, float] = {}
    outs = {}
    for label, engine in (("pagedserve", plain), ("pagedserve_ngram", spec)):
        t0 = time.perf_counter()
        outs[label] = [engine.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids
                       for p in prompts]
        row[label] = sum(map(len, outs[label])) / (time.perf_counter() - t0)
        print(f"{'json':9s} {label:24s} {row[label]:7.1f} tokens/s", flush=True)
    after = spec.engine.get_stats()["spec_decode"]
    row["draft_acceptance"] = ((after["num_accepted_tokens"] - before["num_accepted_tokens"])
                               / max(1, after["num_draft_tokens"] - before["num_draft_tokens"]))
    row["ngram_speedup"] = row["pagedserve_ngram"] / row["pagedserve"]
    row["same_tokens"] = float(outs["pagedserve"] == outs["pagedserve_ngram"])
    return row


def run_hf(model, prompts: list[list[int]], max_tokens: int, lookup: int | None,
           eos: list[int]) -> tuple[float, list[list[int]]]:
    outs = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for p in prompts:
            x = torch.tensor([p])
            kw = {} if lookup is None else {"prompt_lookup_num_tokens": lookup}
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                               max_new_tokens=max_tokens, pad_token_id=0, eos_token_id=eos,
                               **kw)
            outs.append(y[0, len(p):].tolist())
    return sum(map(len, outs)) / (time.perf_counter() - t0), outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--prompt-lookup-min", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedserve.cluster import LLM
    from pagedserve.worker.loaders import resolve_model

    path = resolve_model(None).path
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    k = args.num_speculative_tokens
    plain = LLM(dtype=args.dtype, num_gpu_blocks=512)
    spec = LLM(dtype=args.dtype, num_gpu_blocks=512,
               speculative_config={"method": "ngram", "num_speculative_tokens": k,
                                   "prompt_lookup_min": args.prompt_lookup_min})
    eos = list(plain.engine.eos_token_ids)
    warm = chat_ids(tok, ["Hi"])
    for engine in (plain, spec):
        run_pagedserve(engine, warm, 4, batched=False)
    run_structured(plain, spec, tok, 4)  # compiles the schema's grammar once
    run_hf(model, warm, 4, None, eos)
    run_hf(model, warm, 4, k, eos)

    results: dict[str, dict] = {}
    for name, texts in (("grounded", GROUNDED), ("open", OPEN)):
        prompts = chat_ids(tok, texts)
        before = spec.engine.get_stats()["spec_decode"]
        row: dict[str, float] = {}
        toks: dict[str, list[list[int]]] = {}
        runs = (("pagedserve", plain, False), ("pagedserve_ngram", spec, False),
                ("hf_generate", None, None), ("hf_prompt_lookup", k, None),
                ("pagedserve_batch", plain, True), ("pagedserve_ngram_batch", spec, True))
        for label, engine, batched in runs:
            if batched is None:  # Hugging Face; ``engine`` is the lookup length
                row[label], toks[label] = run_hf(model, prompts, args.max_tokens, engine, eos)
            else:
                row[label], toks[label] = run_pagedserve(engine, prompts, args.max_tokens,
                                                         batched)
            print(f"{name:9s} {label:24s} {row[label]:7.1f} tokens/s", flush=True)
        after = spec.engine.get_stats()["spec_decode"]
        drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
        accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
        ref = toks["pagedserve"]
        row["draft_acceptance"] = accepted / max(1, drafted)
        row["ngram_speedup"] = row["pagedserve_ngram"] / row["pagedserve"]
        row["hf_lookup_speedup"] = row["hf_prompt_lookup"] / row["hf_generate"]
        row["ngram_vs_hf_lookup"] = row["pagedserve_ngram"] / row["hf_prompt_lookup"]
        row["ngram_batch_speedup"] = row["pagedserve_ngram_batch"] / row["pagedserve_batch"]
        row["same_tokens"] = {label: sum(a == b for a, b in zip(t, ref)) / len(ref)
                              for label, t in toks.items()}
        results[name] = row

    print(f"\nSmolLM2-135M-Instruct, {args.dtype}, greedy, <= {args.max_tokens} new tokens, "
          f"k = {k}, n-grams of {args.prompt_lookup_min}-4 tokens, {os.cpu_count()} CPUs")
    print(f"{'workload':9s} {'ngram/plain':>11s} {'HF lookup/HF':>12s} {'ngram/HF lookup':>15s}"
          f" {'batch ngram/plain':>17s} {'accepted':>8s}")
    for name, r in results.items():
        print(f"{name:9s} {r['ngram_speedup']:10.2f}x {r['hf_lookup_speedup']:11.2f}x "
              f"{r['ngram_vs_hf_lookup']:14.2f}x {r['ngram_batch_speedup']:16.2f}x "
              f"{r['draft_acceptance']:8.0%}")
        print(f"          same greedy tokens as pagedserve: {r['same_tokens']}")
    results["json"] = r = run_structured(plain, spec, tok, args.max_tokens)
    print(f"json (schema) ngram/plain {r['ngram_speedup']:.2f}x, {r['draft_acceptance']:.0%} "
          f"accepted, same tokens: {bool(r['same_tokens'])}")
    plain.shutdown()
    spec.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
