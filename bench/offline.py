"""Offline throughput: pagedserve ``LLM.generate`` vs Hugging Face ``generate``
(static padded batches) vs Hugging Face ``generate_batch`` (its continuous
batching), same machine, same model (SmolLM2-135M; fp32 on CPU, bf16 on CUDA), same
requests, one run.

Also measures the device's GEMM roofline in the same run: peak matmul
FLOP/s divided by the model's FLOPs per token (2 x parameters touched per
token), i.e. the decode throughput a perfectly batched engine could reach.
That roofline ignores the prompts, so each engine also gets the share of the
GEMM peak it sustains over the whole workload (prompt and output tokens' FLOPs
divided by its run time): the headroom any engine has left on this device.

    python bench/offline.py                 # 64 prompts x 64 new tokens
    python bench/offline.py --quick         # a smaller smoke run
    python bench/offline.py --random-weights --num-prompts 128   # on a GPU box (bf16)

``--random-weights`` writes a random checkpoint of SmolLM2-135M's exact shape
with a made-up tokenizer (for machines without the default model installed);
throughput does not depend on the weights' values, since every request
generates exactly ``--output-len`` tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def make_prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    """8-60 words of English each; random token ids of the same lengths without a tokenizer."""
    rng = random.Random(seed)
    if tokenizer is None:
        return [[rng.randrange(3, 49152) for _ in range(rng.randint(10, 75))] for _ in range(n)]
    words = ("the model serves many requests with paged attention while the scheduler "
             "shares blocks across prompts and keeps memory waste small").split()
    prompts = []
    for _ in range(n):
        k = rng.randint(8, 60)
        prompts.append(tokenizer.encode(" ".join(rng.choice(words) for _ in range(k))))
    return prompts


def gemm_peak_flops(device: str, dtype: torch.dtype, reps: int = 10, trials: int = 5) -> float:
    """Best of ``trials`` timings of ``reps`` square matmuls: a peak, so the best one.

    One timing on a shared 2-core box can land in a slow moment (seen: 111 against
    a usual 155-197 GFLOP/s), which would make every engine look closer to the peak.
    """
    size = 8192 if device == "cuda" else 1024
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    best = 0.0
    for _ in range(trials):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        _sync(device)
        best = max(best, 2 * size**3 * reps / (time.perf_counter() - t0))
    return best


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def flops_split(model) -> tuple[float, float]:
    """(body, head): 2 x the parameters one token multiplies below the LM head, and in it."""
    emb = model.get_input_embeddings().weight.numel()
    total = sum(p.numel() for p in model.parameters())
    head = model.get_output_embeddings().weight.numel()
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return 2.0 * (total - emb - (0 if tied else head)), 2.0 * head


def workload_flops(model, prompts: list[list[int]], out_len: int) -> float:
    """The GEMM FLOPs any engine must spend: every prompt token and every generated
    token but the last goes through the body, and each generated token needs the head.

    The output-token roofline ignores the prompts; this is the figure that says how
    close to the device's peak an engine runs on this workload.
    """
    body, head = flops_split(model)
    body_tokens = sum(len(p) + out_len - 1 for p in prompts)
    return body_tokens * body + len(prompts) * out_len * head


def run_pagedserve(path: str, prompts: list[list[int]], out_len: int, device: str,
                   dtype: str, **engine_kw: Any) -> float:
    from pagedserve.cluster import LLM, SamplingParams

    llm = LLM(model=path, device=device, dtype=dtype, max_num_seqs=len(prompts),
              max_num_batched_tokens=4096, **engine_kw)
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    llm.shutdown()
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


def left_pad(chunk: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and attention mask of a batch, padded on the left as generation needs."""
    width = max(map(len, chunk))
    ids = torch.zeros(len(chunk), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(chunk):
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    return ids, mask


def run_hf_generate(model, prompts: list[list[int]], out_len: int, batch: int) -> float:
    dev = model.device
    model.generate(torch.tensor([prompts[0]], device=dev), max_new_tokens=4, do_sample=False,
                   pad_token_id=0)  # warm-up (CUDA context, kernels)
    tokens, t0 = 0, time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            chunk = prompts[i : i + batch]
            ids, mask = left_pad(chunk)
            ids, mask = ids.to(dev), mask.to(dev)
            y = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=out_len,
                               min_new_tokens=out_len, pad_token_id=0)
            tokens += (y.shape[1] - ids.shape[1]) * len(chunk)
    return tokens / (time.perf_counter() - t0)


def run_hf_generate_batch(model, prompts: list[list[int]], out_len: int) -> float:
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=out_len, do_sample=False, eos_token_id=-1,
                           pad_token_id=0)
    model.generate_batch(prompts[:4], generation_config=cfg, max_new_tokens=4)
    t0 = time.perf_counter()
    res = model.generate_batch(prompts, generation_config=cfg)
    dt = time.perf_counter() - t0
    return sum(len(r.generated_tokens) for r in res.values()) / dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-generate-batch", action="store_true")
    ap.add_argument("--json", type=str, default=None)
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--dtype", default=None, help="default float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--random-weights", action="store_true",
                    help="a random SmolLM2-135M-shaped checkpoint instead of the default model")
    args = ap.parse_args()
    if args.quick:
        args.num_prompts, args.output_len = 16, 16
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    dtype = getattr(torch, args.dtype)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.random_weights:
        from pagedserve.worker.testing import SMOLLM2_135M, write_random_checkpoint

        scratch = tempfile.TemporaryDirectory(prefix="smollm2_random_")  # removed at exit
        path = write_random_checkpoint(scratch.name, weight_scale=1.0, **SMOLLM2_135M)
        tok = None
    else:
        from pagedserve.worker.loaders import resolve_model

        path = resolve_model(None).path
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    prompts = make_prompts(tok, args.num_prompts, seed=0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(args.device).eval()

    peak = gemm_peak_flops(args.device, dtype)
    total_tokens = len(prompts) * args.output_len
    work = workload_flops(model, prompts, args.output_len)
    results: dict[str, float] = {}

    def record(name: str, tps: float) -> None:  # printed at once: a killed run keeps them
        results[name] = tps
        print(f"{name}: {tps:.1f} tokens/s", flush=True)

    record("pagedserve", run_pagedserve(path, prompts, args.output_len, args.device,
                                        args.dtype))
    record("hf_generate", run_hf_generate(model, prompts, args.output_len, args.hf_batch))
    if not args.skip_generate_batch:
        try:
            record("hf_generate_batch", run_hf_generate_batch(model, prompts, args.output_len))
        except Exception as e:  # report, don't hide: the ratio row says n/a
            print(f"hf generate_batch failed: {type(e).__name__}: {e}")
    peak = max(peak, gemm_peak_flops(args.device, dtype))  # measured before and after
    roofline = peak / sum(flops_split(model))
    where = (torch.cuda.get_device_name() if args.device == "cuda"
             else f"{torch.get_num_threads()} CPU threads")
    weights = "random weights" if args.random_weights else "its weights"
    lengths = "10-75 random token ids" if args.random_weights else "8-60 words"
    print(f"\n{args.num_prompts} prompts ({lengths}), {args.output_len} new tokens each, "
          f"SmolLM2-135M ({weights}) {args.dtype}, {where}")
    print(f"GEMM peak {peak / 1e9:.1f} GFLOP/s -> roofline {roofline:.0f} tokens/s; "
          f"the workload is {work / 1e12:.2f} TFLOP (prompts included)")
    print(f"{'engine':<20} {'tokens/s':>10} {'pagedserve x':>13} {'of roofline':>12} "
          f"{'of GEMM peak':>13}")
    for name, tps in results.items():
        ratio = results["pagedserve"] / tps
        busy = work / (total_tokens / tps) / peak  # all FLOPs over the run's time
        print(f"{name:<20} {tps:>10.1f} {ratio:>12.2f}x {100 * tps / roofline:>11.1f}% "
              f"{100 * busy:>12.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens_per_s": results, "gemm_flops": peak,
                       "roofline_tokens_per_s": roofline, "workload_flops": work,
                       "args": vars(args)}, f, indent=2)


if __name__ == "__main__":
    main()
