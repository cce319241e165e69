"""Checkpoints quantised ahead of time: pagedserve against transformers on the same file.

No GPTQ / AWQ / compressed-tensors model is on this machine, so the default model
(SmolLM2-135M, dequantised to fp32) is quantised here to 4 bits in groups of 64: by
compressed-tensors itself into its ``pack-quantized`` format (what llm-compressor saves
for a W4A16 model; min-max scales, no calibration data), and as an AutoGPTQ int4
checkpoint (``worker/testing_prequant.py``). Rows, one run, same prompts:

- pagedserve on the compressed-tensors file, its weights dequantised once at load
  (``ct``, fp32), then quantised for the CPU kernels (``ct+int8``, ``ct+int4``: int4
  keeps the file's own grid, ``cpu_int8.quantize_asymmetric4``);
- pagedserve on the GPTQ file with int4 (``gptq+int4``);
- transformers on the compressed-tensors file (``hf-ct``: its compressed-tensors
  integration, which unpacks each projection on every forward), ``generate`` in
  left-padded batches.

For each: seconds to load (engine or model ready), resident weight MiB, output tokens/s
of ``--num-prompts`` greedy requests at once and of one alone, and, on a fixed text none
of them wrote (``pydoc_data.topics``), perplexity and top-1 agreement with ``ct``.

    python bench/prequant.py [--num-prompts 32] [--out-len 32] [--json bench/figures/prequant.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kv_cache_dtype import teacher_forced, write_figures  # shared with that bench
from offline import make_prompts, run_hf_generate
from quant import hf_scores, text_chunks, text_fidelity

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

GROUP = 64  # SmolLM2's 576 and 1,536 inputs are whole groups of 64, not of 128


def run_pagedserve(name: str, path: Path, quant: str | None, prompts: list[list[int]],
                   out_len: int, chunks: list[list[int]]) -> dict[str, Any]:
    from pagedserve.cluster import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=str(path), dtype="float32", quantization=quant,
              max_num_seqs=len(prompts), max_num_batched_tokens=4096)
    load = time.perf_counter() - t0
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
        llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=4),
                     use_tqdm=False)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        tok_s = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        alone = llm.generate(prompts[:1], greedy, use_tqdm=False)
        single = len(alone[0].outputs[0].token_ids) / (time.perf_counter() - t0)
        return {"config": name, "load_s": load,
                "weight_mib": llm.engine.model_info["weight_bytes"] / 2**20,
                "tok_s": tok_s, "single_tok_s": single,
                "text_scores": teacher_forced(llm, [c[:1] for c in chunks],
                                              [c[1:] for c in chunks])}
    finally:
        llm.shutdown()


def run_hf(path: Path, prompts: list[list[int]], out_len: int, batch: int,
           chunks: list[list[int]]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    load = time.perf_counter() - t0
    unique = {t.data_ptr(): t for t in model.state_dict().values()}
    size = sum(t.numel() * t.element_size() for t in unique.values())
    return {"config": "hf-ct", "load_s": load, "weight_mib": size / 2**20,
            "tok_s": run_hf_generate(model, prompts, out_len, batch),
            "single_tok_s": run_hf_generate(model, prompts[:1], out_len, 1),
            "text_scores": hf_scores(model, [c[:1] for c in chunks], [c[1:] for c in chunks])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--out-len", type=int, default=32)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--text-chunks", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    from pagedserve.worker.loaders import load_tokenizer, resolve_model
    from pagedserve.worker.testing_prequant import write_compressed_tensors, write_gptq

    resolved = resolve_model(None)
    tokenizer = load_tokenizer(resolved)
    prompts = make_prompts(tokenizer, args.num_prompts, args.seed)
    chunks = text_chunks(tokenizer, "pydoc", args.text_chunks)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(resolved.path)
        t0 = time.perf_counter()
        ct = write_compressed_tensors(src, Path(tmp) / "ct", 4, "group", GROUP)
        gptq, _ = write_gptq(src, Path(tmp) / "gptq", 4, GROUP)
        print(f"wrote both checkpoints in {time.perf_counter() - t0:.0f} s", flush=True)
        rows = []
        for name, path, quant in (("ct", ct, None), ("ct+int8", ct, "int8"),
                                  ("ct+int4", ct, "int4"), ("gptq+int4", gptq, "int4")):
            rows.append(run_pagedserve(name, path, quant, prompts, args.out_len, chunks))
            print(f"{name}: {rows[-1]['tok_s']:.1f} tok/s", flush=True)
        rows.append(run_hf(ct, prompts, args.out_len, args.hf_batch, chunks))
    ref = rows[0]
    print(f"\nSmolLM2-135M at 4 bits in groups of {GROUP}, {args.num_prompts} prompts x "
          f"{args.out_len} greedy tokens, {torch.get_num_threads()} CPU threads "
          f"({platform.processor() or platform.machine()})")
    print(f"{'config':>10} {'load s':>7} {'weights MiB':>11} {'tok/s':>8} {'1 seq tok/s':>11} "
          f"{'text ppl':>8} {'agree w/ ct':>11}")
    report = []
    for r in rows:
        ppl, agree = text_fidelity(r, ref)
        print(f"{r['config']:>10} {r['load_s']:>7.1f} {r['weight_mib']:>11.1f} "
              f"{r['tok_s']:>8.1f} {r['single_tok_s']:>11.1f} {ppl:>8.3f} {agree:>11.4f}")
        report.append({k: v for k, v in r.items() if k != "text_scores"}
                      | {"text_perplexity": ppl, "text_top1_agreement_with_ct": agree})
    peer = rows[-1]
    for r in rows[:-1]:
        print(f"pagedserve {r['config']} / hf-ct: {r['tok_s'] / peer['tok_s']:.2f}x batch, "
              f"{r['single_tok_s'] / peer['single_tok_s']:.2f}x one sequence")
    if args.json:
        write_figures(args.json, args, report)


if __name__ == "__main__":
    main()
