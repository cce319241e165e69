"""KV cache dtype: what a narrower pool buys under one memory budget, and what it costs.

Same machine, same model (SmolLM2-135M, fp32 weights on CPU), same requests,
one run per ``--kv-dtypes`` entry, each with the same KV byte budget
(``--kv-mib``, small enough that an fp32 pool cannot hold every sequence):

- capacity: blocks and tokens the budget holds;
- throughput: ``--num-prompts`` greedy requests of ``--out-len`` tokens
  submitted at once, output tokens/s, the largest running batch and the
  preemptions the pool forced;
- fidelity: the fp32-KV run's sequences (prompt + output) scored teacher-forced
  through each pool (``prompt_logprobs``): how often its top-1 token is the
  fp32-KV pool's, and the mean |logprob difference| of the fp32 run's tokens.

``NAME+scales`` runs an fp8 pool with ``calculate_kv_scales`` (per-layer scales
from the engine's start-up calibration text).

Prints each row and the ratios to the fp32 ("auto") pool.

    python bench/kv_cache_dtype.py
    python bench/kv_cache_dtype.py --kv-dtypes auto,float16,bfloat16,fp8,fp8+scales,fp8_e5m2 \
        --json bench/figures/kv_cache_dtype.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from offline import make_prompts  # the offline benchmark's prompts

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def run_one(kv: str, prompts: list[list[int]], out_len: int, kv_bytes: int,
            reference: list[list[int]] | None) -> dict[str, Any]:
    from pagedserve.cluster import LLM, SamplingParams

    name, _, scales = kv.partition("+")
    llm = LLM(kv_cache_dtype=name, calculate_kv_scales=scales == "scales",
              kv_cache_memory_bytes=kv_bytes, max_num_seqs=len(prompts),
              max_num_batched_tokens=4096)
    eng = llm.engine
    try:
        mem = eng.scheduler.memory_stats()
        row: dict[str, Any] = {"kv_cache_dtype": eng.model_info["kv_cache_dtype"]
                               + ("+scales" if scales else ""),
                               "blocks": mem.num_gpu_blocks,
                               "tokens": mem.num_gpu_blocks * eng.scheduler.block_size}
        llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=4),
                     use_tqdm=False)
        params = SamplingParams(temperature=0.0, max_tokens=out_len, min_tokens=out_len)
        before = dict(eng.scheduler.num_preemptions)
        ids = [eng.add_request(p, params) for p in prompts]
        outs: dict[str, list[int]] = {}
        peak = 0
        t0 = time.perf_counter()
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = o.outputs[0].token_ids
            peak = max(peak, len(eng.scheduler.running))
        dt = time.perf_counter() - t0
        seqs = [outs[i] for i in ids]
        row.update(tok_s=sum(map(len, seqs)) / dt, seconds=dt, peak_running=peak,
                   preemptions=sum(eng.scheduler.num_preemptions.values())
                   - sum(before.values()))
        row["scores"] = teacher_forced(llm, prompts, reference or seqs)
        row["sequences"] = seqs
        return row
    finally:
        llm.shutdown()


def teacher_forced(llm: Any, prompts: list[list[int]], outputs: list[list[int]]
                   ) -> list[list[tuple[int, float]]]:
    """(top-1 token, logprob of the given token) at each output position of prompt +
    output, scored through ``llm`` (``prompt_logprobs``)."""
    from pagedserve.cluster import SamplingParams

    full = [p + s for p, s in zip(prompts, outputs, strict=True)]
    scored = llm.generate(full, SamplingParams(max_tokens=1, prompt_logprobs=1),
                          use_tqdm=False)
    return [[(max(d, key=d.get), d[tok]) for d, tok in zip(o.prompt_logprobs[len(p):],
                                                          f[len(p):], strict=True)]
            for o, p, f in zip(scored, prompts, full, strict=True)]


def write_figures(path: str, args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """The run's rows with the CPU, thread count and arguments, as JSON."""
    with open(path, "w") as f:
        json.dump({"cpu": platform.processor() or platform.machine(),
                   "threads": torch.get_num_threads(), "args": vars(args), "rows": rows},
                  f, indent=1)


def fidelity(row: dict[str, Any], ref: dict[str, Any]) -> tuple[float, float]:
    """Top-1 agreement with the fp32 pool and mean |logprob difference|, teacher-forced."""
    same = total = 0
    diff = 0.0
    for mine, theirs in zip(row["scores"], ref["scores"], strict=True):
        for (top, lp), (ref_top, ref_lp) in zip(mine, theirs, strict=True):
            same += top == ref_top
            diff += abs(lp - ref_lp)
            total += 1
    return same / total, diff / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-dtypes", default="auto,bfloat16,fp8")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--out-len", type=int, default=64)
    ap.add_argument("--kv-mib", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    from pagedserve.worker.loaders import load_tokenizer, resolve_model

    dtypes = args.kv_dtypes.split(",")
    if dtypes[0] != "auto":
        dtypes.insert(0, "auto")
    prompts = make_prompts(load_tokenizer(resolve_model(None)), args.num_prompts, args.seed)
    rows: list[dict[str, Any]] = []
    for kv in dtypes:
        rows.append(run_one(kv, prompts, args.out_len, args.kv_mib << 20,
                            rows[0]["sequences"] if rows else None))
    ref = rows[0]
    print(f"SmolLM2-135M fp32, {args.num_prompts} prompts x {args.out_len} tokens, "
          f"KV budget {args.kv_mib} MiB")
    print(f"{'kv_cache_dtype':>16} {'blocks':>7} {'tokens':>7} {'peak batch':>10} "
          f"{'preempt':>7} {'tok/s':>7} {'x fp32':>6} {'top-1 agree':>11} {'|dlogp|':>8}")
    report = []
    for r in rows:
        agree, dlp = fidelity(r, ref)
        ratio = r["tok_s"] / ref["tok_s"]
        print(f"{r['kv_cache_dtype']:>16} {r['blocks']:>7} {r['tokens']:>7} "
              f"{r['peak_running']:>10} {r['preemptions']:>7} {r['tok_s']:>7.1f} "
              f"{ratio:>6.2f} {agree:>11.4f} {dlp:>8.4f}")
        report.append({k: v for k, v in r.items() if k not in ("scores", "sequences")}
                      | {"throughput_vs_fp32": ratio, "top1_agreement": agree,
                         "mean_abs_logprob_diff": dlp,
                         "identical_sequences": sum(a == b for a, b in zip(
                             r["sequences"], ref["sequences"], strict=True))})
    if args.json:
        write_figures(args.json, args, report)


if __name__ == "__main__":
    main()
