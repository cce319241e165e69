"""Draft-model speculative decoding, side by side in one run on one machine: pagedserve
with and without ``speculative_config={"model": ...}`` against Hugging Face ``generate``
with and without assisted generation (``assistant_model``), same target
(SmolLM2-135M-Instruct, fp32 on CPU), same chat prompts, greedy.

The draft is an int8 copy of the target, the one smaller model that shares its
tokenizer on this machine: pagedserve quantises it online
(``"quantization": "int8"``: 8-bit codes, int8 dot products); Hugging Face gets
``torch.ao.quantization.quantize_dynamic``'s int8 ``Linear`` copy, its own
cheapest int8 CPU path, as ``assistant_model`` with a constant number of guesses.

Requests run one at a time (latency: assisted generation takes batch 1 only);
pagedserve also runs the prompts as one batch, where guesses cost compute that
a wide step no longer has spare. A second workload samples at ``--temperature``
(unseeded): pagedserve draws those guesses from the draft's distribution and
verifies them by speculative sampling's rule, as HF's assisted sampling does.
Prints output tokens/s per engine, each engine's speculation over its own plain
decoding, pagedserve's over Hugging Face's, the share of drafts accepted, and
whether all four give the same greedy tokens.

    python bench/draft_model.py
    python bench/draft_model.py --num-speculative-tokens 5 --json bench/figures/draft_model.json
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
from provenance import machine, tree_commit, write_figures  # sibling scripts
from spec_decode import chat_ids, run_pagedserve

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Give three tips for staying healthy.",
    "Explain what a CPU cache is in two sentences.",
    "Explain what a hash table is.",
    "Describe the water cycle for a child.",
    "List the planets of the solar system.",
    "Why is the sky blue?",
]


def run_hf(model, prompts: list[list[int]], max_tokens: int, eos: list[int],
           assistant=None, temperature: float = 0.0) -> tuple[float, list[list[int]]]:
    outs = []
    kw: dict = {} if assistant is None else {"assistant_model": assistant}
    if temperature > 0:  # (assisted: speculative sampling with the assistant's probs)
        kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        kw.update(do_sample=False)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for p in prompts:
            x = torch.tensor([p])
            y = model.generate(x, attention_mask=torch.ones_like(x),
                               max_new_tokens=max_tokens, pad_token_id=0, eos_token_id=eos,
                               **kw)
            outs.append(y[0, len(p):].tolist())
    return sum(map(len, outs)) / (time.perf_counter() - t0), outs


def hf_int8_assistant(model, k: int):
    """The target's int8 dynamic-quantised copy, guessing ``k`` tokens every time."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch.ao.quantization's deprecation notice)
        draft = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {torch.nn.Linear},
                                                       dtype=torch.qint8)
    draft.generation_config.num_assistant_tokens = k
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    return draft


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=1.0,
                    help="the sampled workload's temperature (unseeded, no truncation)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    commit = tree_commit()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedserve.cluster import LLM
    from pagedserve.worker.loaders import resolve_model

    path = resolve_model(None).path
    tok = AutoTokenizer.from_pretrained(path)
    prompts = chat_ids(tok, PROMPTS)
    k = args.num_speculative_tokens
    spec_cfg = {"model": path, "num_speculative_tokens": k, "quantization": "int8"}
    rates: dict[str, float] = {}
    tokens: dict[str, list[list[int]]] = {}
    warm = chat_ids(tok, ["Hello"])
    for label, cfg in (("pagedserve", None), ("pagedserve_draft", spec_cfg)):
        llm = LLM(num_gpu_blocks=1024, max_num_seqs=16, speculative_config=cfg)
        try:
            run_pagedserve(llm, warm, 8, False)
            before = llm.engine.get_stats()["spec_decode"]
            for batched in (False, True):
                name = label + ("_batch" if batched else "")
                rates[name], tokens[name] = run_pagedserve(llm, prompts, args.max_tokens,
                                                           batched)
                print(f"{name:24s} {rates[name]:7.1f} tokens/s", flush=True)
            mid = llm.engine.get_stats()["spec_decode"]
            name = label + "_sampled"
            rates[name], _ = run_pagedserve(llm, prompts, args.max_tokens, False,
                                            args.temperature)
            print(f"{name:24s} {rates[name]:7.1f} tokens/s", flush=True)
            after = llm.engine.get_stats()["spec_decode"]
        finally:
            llm.shutdown()
    acceptance = _kept(before, mid)
    acceptance_sampled = _kept(mid, after)

    torch.set_num_threads(os.cpu_count() or 1)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    eos = [tok.eos_token_id]
    assistant = hf_int8_assistant(model, k)
    run_hf(model, warm, 8, eos)
    for name, helper in (("hf", None), ("hf_assisted", assistant)):
        rates[name], tokens[name] = run_hf(model, prompts, args.max_tokens, eos, helper)
        print(f"{name:24s} {rates[name]:7.1f} tokens/s", flush=True)
        rates[name + "_sampled"], _ = run_hf(model, prompts, args.max_tokens, eos, helper,
                                             args.temperature)
        print(f"{name + '_sampled':24s} {rates[name + '_sampled']:7.1f} tokens/s", flush=True)

    same = all(tokens[n] == tokens["hf"] for n in tokens)
    ratios = {
        "pagedserve_draft_over_plain": rates["pagedserve_draft"] / rates["pagedserve"],
        "pagedserve_draft_over_plain_batch": (rates["pagedserve_draft_batch"]
                                              / rates["pagedserve_batch"]),
        "hf_assisted_over_plain": rates["hf_assisted"] / rates["hf"],
        "pagedserve_draft_over_hf_assisted": rates["pagedserve_draft"] / rates["hf_assisted"],
        "sampled_pagedserve_draft_over_plain": (rates["pagedserve_draft_sampled"]
                                                / rates["pagedserve_sampled"]),
        "sampled_hf_assisted_over_plain": rates["hf_assisted_sampled"] / rates["hf_sampled"],
        "sampled_pagedserve_draft_over_hf_assisted": (rates["pagedserve_draft_sampled"]
                                                      / rates["hf_assisted_sampled"]),
    }
    for name, r in ratios.items():
        print(f"{name:36s} {r:5.2f}x")
    print(f"draft acceptance {acceptance:.0%} greedy, {acceptance_sampled:.0%} at temperature "
          f"{args.temperature}; same greedy tokens everywhere: {same}; "
          f"{machine()}, tree {commit}")
    if args.json:
        write_figures(args.json, args, commit, tokens_per_s=rates, ratios=ratios,
                      draft_acceptance=acceptance, draft_acceptance_sampled=acceptance_sampled,
                      same_tokens=same)


def _kept(before: dict[str, int], after: dict[str, int]) -> float:
    sent = after["num_draft_tokens"] - before["num_draft_tokens"]
    return (after["num_accepted_tokens"] - before["num_accepted_tokens"]) / max(1, sent)


if __name__ == "__main__":
    main()
