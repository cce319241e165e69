"""Multi-LoRA throughput: many adapters in one batch, against Hugging Face PEFT.

Same machine, same model (SmolLM2-135M, fp32 on CPU), same requests, one run:
``--num-prompts`` prompts of 8-60 words, each with one of ``--num-adapters``
random PEFT adapters (rank ``--rank`` on all seven projections), 64 greedy
tokens each.

- pagedserve, every prompt with its adapter in one continuous batch
  (``max_loras`` = the number of adapters);
- pagedserve, the same prompts on the base model: what the adapters cost;
- Hugging Face PEFT ``generate`` with ``adapter_names`` (its mixed-adapter
  batches), left-padded batches of ``--hf-batch``.

Prints tokens/s, the ratios, and how many sequences came out token for token
the same as PEFT's (EOS is masked in both, as HF's ``min_new_tokens`` does;
padding in HF's batches could still flip a near-tie).

    python bench/lora.py
    python bench/lora.py --num-adapters 8 --rank 8 --json bench/figures/lora.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from offline import left_pad, make_prompts  # the offline benchmark's prompts and padding

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def run_pagedserve(path: str, prompts: list[list[int]], out_len: int,
                   adapters: list[str] | None, rank: int) -> tuple[float, list[list[int]]]:
    from pagedserve.cluster import LLM, LoRARequest, SamplingParams

    kwargs = {}
    loras = None
    if adapters:
        kwargs = dict(enable_lora=True, max_loras=len(adapters), max_lora_rank=rank)
        reqs = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(adapters)]
        loras = [reqs[i % len(reqs)] for i in range(len(prompts))]
    llm = LLM(model=path, max_num_seqs=len(prompts), max_num_batched_tokens=4096, **kwargs)
    # min_tokens masks EOS as HF's min_new_tokens does (ignore_eos would let the argmax
    # be EOS and go on), so both pick the same tokens.
    params = SamplingParams(temperature=0.0, max_tokens=out_len, min_tokens=out_len)
    warm = SamplingParams(temperature=0.0, max_tokens=4)
    llm.generate(prompts[:4], warm, use_tqdm=False, lora_request=loras[:4] if loras else None)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    dt = time.perf_counter() - t0
    llm.shutdown()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return sum(map(len, tokens)) / dt, tokens


def run_peft(path: str, prompts: list[list[int]], out_len: int, adapters: list[str],
             batch: int) -> tuple[float, list[list[int]]]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, adapters[0], adapter_name="a0")
    for i, p in enumerate(adapters[1:], start=1):
        model.load_adapter(p, adapter_name=f"a{i}")
    model.eval()
    names = [f"a{i % len(adapters)}" for i in range(len(prompts))]
    model.generate(input_ids=torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False,
                   pad_token_id=0, adapter_names=names[:1])
    out: list[list[int]] = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            ids, mask = left_pad(prompts[i:i + batch])
            width = ids.shape[1]
            y = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                               max_new_tokens=out_len, min_new_tokens=out_len, pad_token_id=0,
                               adapter_names=names[i:i + batch])
            out += [row[width:].tolist() for row in y]
    dt = time.perf_counter() - t0
    return sum(map(len, out)) / dt, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--num-adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from pagedserve.worker.loaders import resolve_model
    from pagedserve.worker.testing import write_random_lora

    path = resolve_model(None).path
    prompts = make_prompts(AutoTokenizer.from_pretrained(path, local_files_only=True),
                           args.num_prompts, seed=0)
    scratch = tempfile.TemporaryDirectory(prefix="lora_bench_")
    # scale 1: random adapters that change the model without drowning it.
    adapters = [write_random_lora(path, os.path.join(scratch.name, f"a{i}"), TARGETS,
                                  r=args.rank, alpha=2 * args.rank, seed=i, scale=1.0)
                for i in range(args.num_adapters)]
    results: dict[str, float] = {}
    lora_tps, lora_tokens = run_pagedserve(path, prompts, args.output_len, adapters,
                                           args.rank)
    results["pagedserve_lora"] = lora_tps
    print(f"pagedserve, {args.num_adapters} adapters in one batch: {lora_tps:.1f} tokens/s",
          flush=True)
    results["pagedserve_base"], _ = run_pagedserve(path, prompts, args.output_len, None, 0)
    print(f"pagedserve, base model: {results['pagedserve_base']:.1f} tokens/s", flush=True)
    results["peft"], peft_tokens = run_peft(path, prompts, args.output_len, adapters,
                                            args.hf_batch)
    print(f"HF PEFT generate (adapter_names, batches of {args.hf_batch}): "
          f"{results['peft']:.1f} tokens/s", flush=True)
    same = sum(a == b for a, b in zip(lora_tokens, peft_tokens))
    print(f"\npagedserve with adapters / HF PEFT: {lora_tps / results['peft']:.2f}x")
    print(f"adapters' cost: {lora_tps / results['pagedserve_base']:.2f}x of the base "
          "model's throughput")
    print(f"sequences identical to PEFT's: {same}/{len(prompts)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens_per_s": results, "identical_sequences": same,
                       "args": vars(args)}, f, indent=2)


if __name__ == "__main__":
    main()
