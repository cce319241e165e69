"""Paged attention kernel benchmark: time and KV-read bandwidth per backend.

Decode (one query per sequence) over batch size x context length, and prefill
(no context, q_len == k_len). Bandwidth counts the K and V bytes a kernel must
read (sum of key lengths x Hkv x D x 2 x element size) over the call time.

On CPU each backend is compared with a naive contiguous baseline (per-sequence
SDPA over contiguous K/V tensors, i.e. what attention costs without paging);
ratio = baseline time / backend time (>1 means the paged path is faster). On a
GPU the bandwidth is also printed as a fraction of the device's peak.

    python bench/kernels.py --quick
    python bench/kernels.py --json bench/results/kernels.json
    python bench/kernels.py --sweep          # GPU: Triton decode launch settings
    python bench/kernels.py --backends cpu --decode-only --batches 64 --contexts 2048 \
        --kv-dtype fp8                       # a narrower KV pool (kv_cache_dtype)

``--sweep`` times Triton decode at long contexts for every launch setting in
``LAUNCH_SWEEP`` (keys per step, warps, pipeline stages) and names the fastest,
so one GPU window tells which defaults reach the HBM goal.
"""

from __future__ import annotations

if __name__ == "kernels":
    # ``python bench/<any>.py`` puts bench/ first on sys.path, so transformers' own
    # ``from kernels import ...`` (Hugging Face's distribution, which it depends on)
    # finds this script; give the name to the distribution, as ``pagedserve.kernels``
    # does for the checkout's folder.
    from pagedserve.kernels import hand_over_bare_name

    hand_over_bare_name()

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

from pagedserve.kernels import available_backends, build_varlen_metadata, get_backend
from pagedserve.kernels.kv_quant import kv_dtype_name, resolve_kv_cache_dtype
from pagedserve.kernels.testing import make_paged_batch

# HBM peak bandwidth (bytes/s) by device-name fragment, most specific first.
PEAK_BW = [("H200", 4.8e12), ("H100", 3.35e12), ("A100", 2.0e12), ("L40", 0.864e12),
           ("A10", 0.6e12), ("L4", 0.3e12), ("T4", 0.32e12)]


def device_peak(device: torch.device) -> tuple[str, float | None]:
    """Device name and its peak memory bandwidth (None when unknown or CPU)."""
    if device.type != "cuda":
        return "cpu", None
    name = torch.cuda.get_device_name(device)
    for frag, bw in PEAK_BW:
        if frag in name:
            return name, bw
    return name, None


def time_interleaved(fns: dict, device: torch.device, reps: int) -> dict[str, float]:
    """Seconds per call of each function.

    CPU: best of ``reps``, calls interleaved, which keeps the comparison fair on
    a shared, noisy machine (background load slows every candidate alike).
    CUDA: Triton's ``do_bench`` median, timed with CUDA events around each call
    after an L2 flush, so neither host launch latency nor a KV set that stays
    in the 60 MB L2 of an H200 inflates the bandwidth.
    """
    if device.type == "cuda":
        from triton.testing import do_bench

        return {k: do_bench(fn, warmup=5, rep=10 * reps, return_mode="median") / 1e3
                for k, fn in fns.items()}
    for fn in fns.values():
        fn()  # warm-up: workspaces, Triton compilation
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for key, fn in fns.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[key].append(time.perf_counter() - t0)
    return {k: min(v) for k, v in times.items()}


def naive_decode(q, ks, vs, hkv: int, scale: float):
    """Baseline: per-sequence SDPA over contiguous [1, Hkv, L, D] K/V, GQA folded."""
    s, hq, d = q.shape
    return [
        F.scaled_dot_product_attention(
            q[i].view(1, hkv, hq // hkv, d), ks[i], vs[i], scale=scale
        )
        for i in range(s)
    ]


def naive_prefill(q, ks, vs, lens: list[int], scale: float):
    """Baseline: per-sequence causal SDPA over contiguous K/V."""
    out, off = [], 0
    for i, n in enumerate(lens):
        qs = q[off : off + n].transpose(0, 1)[None]
        out.append(F.scaled_dot_product_attention(
            qs, ks[i], vs[i], is_causal=True, scale=scale, enable_gqa=True))
        off += n
    return out


def contiguous_kv(b, lens: list[int]):
    """Per-sequence contiguous [1, Hkv, L, D] copies of the batch's K/V."""
    ks, vs, off = [], [], 0
    for n in lens:
        ks.append(b.k[off : off + n].transpose(0, 1)[None].contiguous())
        vs.append(b.v[off : off + n].transpose(0, 1)[None].contiguous())
        off += n
    return ks, vs


def run_case(kind: str, q_lens, k_lens, args, device, backends, reps) -> list[dict]:
    """Time every backend (and on CPU the naive contiguous baseline) on one batch."""
    hq, hkv, d = args.heads, args.kv_heads, args.head_dim
    dtype = getattr(torch, args.dtype)
    kv_dtype = resolve_kv_cache_dtype(args.kv_dtype, dtype)
    scale = 1 / math.sqrt(d)
    kv_bytes = sum(k_lens) * hkv * d * 2 * torch.finfo(kv_dtype).bits // 8
    _, peak = device_peak(device)
    batches, fns = {}, {}
    for name in backends:
        bsz = 256 if name == "flash" else args.block_size
        if bsz not in batches:
            batches[bsz] = make_paged_batch(q_lens, k_lens, hq, hkv, d, bsz, dtype=dtype,
                                            device=device, extra_blocks=0, garbage=1.0,
                                            kv_dtype=kv_dtype)
        b = batches[bsz]
        be = get_backend(name, device)
        if kind == "decode":
            lens = torch.tensor(k_lens, dtype=torch.int32, device=device)
            fns[name] = lambda be=be, b=b, lens=lens: be.decode_attention(
                b.q, b.key_cache, b.value_cache, b.block_table, lens, scale)
        else:
            md = build_varlen_metadata(q_lens, k_lens, device=device)
            fns[name] = lambda be=be, b=b, md=md: be.varlen_attention(
                b.q, b.key_cache, b.value_cache, b.block_table, md, scale)
    if device.type == "cpu" and not args.no_baseline:
        b = next(iter(batches.values()))
        ks, vs = contiguous_kv(b, k_lens)
        if kind == "decode":
            fns["baseline"] = lambda: naive_decode(b.q, ks, vs, hkv, scale)
        else:
            fns["baseline"] = lambda: naive_prefill(b.q, ks, vs, k_lens, scale)
    times = time_interleaved(fns, device, reps)
    rows = []
    for name in backends:
        t = times[name]
        row = {"kind": kind, "backend": name, "kv_dtype": kv_dtype_name(kv_dtype),
               "batch": len(q_lens), "context": max(k_lens),
               "ragged": min(k_lens) != max(k_lens), "ms": t * 1e3,
               "kv_GBps": kv_bytes / t / 1e9, "peak_frac": kv_bytes / t / peak if peak else None}
        if "baseline" in times:
            row["baseline_ms"] = times["baseline"] * 1e3
            row["ratio_vs_baseline"] = times["baseline"] / t
        rows.append(row)
    return rows


SWEEP_SPLITS = (1, 2, 4, 8)


def sweep(args, device: torch.device, reps: int) -> list[dict]:
    """Triton decode for every ``LAUNCH_SWEEP`` setting, long contexts (tiny ones on CPU,
    where only the interpreter runs: a plumbing check, not a measurement).

    Each setting is printed as soon as it is timed (a time limit keeps what ran), and
    its output is checked against the default launch's, so a fast wrong one shows.
    """
    from pagedserve.kernels.triton_backend import LAUNCH_SWEEP, TritonBackend

    hq, hkv, d = args.heads, args.kv_heads, args.head_dim
    dtype = getattr(torch, args.dtype)
    scale = 1 / math.sqrt(d)
    _, peak = device_peak(device)
    # (64, 512): forced splits only. A captured decode graph plans for max_model_len,
    # so at 44-175 sequences it splits short contexts too: split 4 against 1 there is
    # what that costs (empty splits, the combine launch).
    shapes = (((256, 8192), (64, 8192), (64, 512), (256, 2048), (64, 2048))
              if device.type == "cuda" else ((2, 40),))
    splits_only = {(64, 512)} if device.type == "cuda" else set()
    if args.batches or args.contexts:
        shapes = tuple((s, c) for s in args.batches or [256, 64]
                       for c in args.contexts or [8192, 2048])
    launches = LAUNCH_SWEEP if device.type == "cuda" else LAUNCH_SWEEP[:2]
    # First the default launch with a forced K split (a time limit cuts the sweep's
    # tail). At 64 sequences x 3 KV heads the grid is 1.5 waves of an H200 unsplit, which
    # no launch setting fixed; the default now splits it in 4 (plan_splits), so
    # splits=1 is the old launch.
    settings = [{"num_splits": sp} for sp in (SWEEP_SPLITS if device.type == "cuda" else ())]
    settings += [{"block_n": n, "num_warps": w, "num_stages": st} for n, w, st in launches]
    rows = []
    for s, ctx in shapes:
        g = torch.Generator().manual_seed(s * ctx)
        k_lens = (ctx - torch.randint(0, args.block_size, (s,), generator=g)).tolist()
        b = make_paged_batch([1] * s, k_lens, hq, hkv, d, args.block_size, dtype=dtype,
                             device=device, extra_blocks=0, garbage=1.0)
        lens = torch.tensor(k_lens, dtype=torch.int32, device=device)
        kv_bytes = sum(k_lens) * hkv * d * 2 * torch.finfo(dtype).bits // 8
        args_ = (b.q, b.key_cache, b.value_cache, b.block_table, lens, scale)
        ref = TritonBackend(device).decode_attention(*args_).float()
        best = None
        for launch in settings:
            if (s, ctx) in splits_only and "num_splits" not in launch:
                continue
            be = TritonBackend(device, **launch)
            ok = torch.allclose(be.decode_attention(*args_).float(), ref, atol=2e-2, rtol=0)
            t = time_interleaved({"t": lambda be=be, a=args_: be.decode_attention(*a)}, device,
                                 reps)["t"]
            row = {"kind": "sweep", "batch": s, "context": ctx, **launch, "ms": t * 1e3,
                   "kv_GBps": kv_bytes / t / 1e9,
                   "peak_frac": kv_bytes / t / peak if peak else None, "matches": ok}
            label = " ".join(f"{k.removeprefix('num_')}={v}" for k, v in launch.items())
            frac = f"  {100 * row['peak_frac']:5.1f}% of peak" if peak else ""
            print(f"sweep batch={s:4d} ctx={ctx:5d} {label:30s} "
                  f"{row['ms']:8.3f} ms {row['kv_GBps']:8.1f} GB/s{frac}"
                  f"{'' if ok else '  WRONG OUTPUT'}", flush=True)
            rows.append(row)
            if ok and (best is None or t < best[0]):
                best = (t, label)
        if best is not None:
            print(f"sweep batch={s} ctx={ctx}: fastest {best[1]}", flush=True)
    return rows


def fmt(r: dict) -> str:
    lens = "ragged " if r["ragged"] else "uniform"
    s = (f"{r['kind']:7s} {r['backend']:6s} batch={r['batch']:4d} ctx<={r['context']:5d} {lens} "
         f"{r['ms']:9.3f} ms  {r['kv_GBps']:8.2f} GB/s")
    if r.get("peak_frac") is not None:
        s += f"  {100 * r['peak_frac']:5.1f}% of peak"
    if "ratio_vs_baseline" in r:
        s += f"  naive-contiguous {r['baseline_ms']:9.3f} ms  ratio {r['ratio_vs_baseline']:5.2f}x"
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small grid, few repetitions")
    ap.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backends", nargs="*", help="default: every available backend")
    ap.add_argument("--dtype", default=None, help="default float16 on CUDA, float32 on CPU")
    ap.add_argument("--heads", type=int, default=9)  # SmolLM2-135M
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--kv-dtype", default="auto",
                    help="KV cache element type (kv_cache_dtype): auto, float16, bfloat16, "
                         "fp8, fp8_e5m2")
    ap.add_argument("--batches", type=int, nargs="*", help="decode batch sizes")
    ap.add_argument("--contexts", type=int, nargs="*", help="decode context lengths")
    ap.add_argument("--decode-only", action="store_true")
    ap.add_argument("--sweep", action="store_true",
                    help="only time the Triton decode launch settings (LAUNCH_SWEEP)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    args.dtype = args.dtype or ("float16" if device.type == "cuda" else "float32")
    backends = args.backends or available_backends(device)
    if device.type == "cpu":
        backends = [n for n in backends if n != "triton"]  # the interpreter is not a benchmark
    gpu = device.type == "cuda"
    if args.quick:
        batches, contexts, reps = [64, 256], [256, 512], 5
        # (64, 64): a batch of chat-length prompts (the "cpu" backend's native rows).
        prefills = [(1, 512), (4, 256), (64, 64)] if not gpu else [(1, 2048), (8, 1024)]
        if gpu:
            contexts = [512, 2048, 8192]
    else:
        batches, contexts, reps = [16, 64, 256], [128, 512, 1024], 10
        prefills = [(1, 512), (4, 512), (1, 2048), (16, 256), (64, 64)]
        if gpu:
            contexts, reps = [512, 2048, 8192], 20
            prefills += [(1, 8192), (32, 1024)]
    batches, contexts = args.batches or batches, args.contexts or contexts
    if args.decode_only:
        prefills = []
    model_dtype = getattr(torch, args.dtype)
    kv_dtype = resolve_kv_cache_dtype(args.kv_dtype, model_dtype)
    backends = [n for n in backends  # flash-attn reads only the model's own 16-bit dtype
                if get_backend(n, device).supports_kv_cache_dtype(kv_dtype, model_dtype)]
    name, peak = device_peak(device)
    print(f"device={name} peak={peak} dtype={args.dtype} kv={kv_dtype_name(kv_dtype)} "
          f"Hq={args.heads} Hkv={args.kv_heads} "
          f"D={args.head_dim} B={args.block_size} threads={torch.get_num_threads()} "
          f"backends={backends}")
    if args.sweep:
        rows = sweep(args, device, 10 if gpu else 1)
        batches, prefills = [], []
    else:
        rows = []
    for s in batches:
        for ctx in contexts:
            # Lengths ctx - [0, B): realistic ragged decode batches need the key mask.
            g = torch.Generator().manual_seed(s * ctx)
            k_lens = (ctx - torch.randint(0, args.block_size, (s,), generator=g)).tolist()
            for r in run_case("decode", [1] * s, k_lens, args, device, backends, reps):
                print(fmt(r), flush=True)
                rows.append(r)
    for s, n in prefills:
        # One uniform batch, and for s > 1 a ragged one (lengths in (n/2, n]).
        g = torch.Generator().manual_seed(s * n)
        ragged = (n - torch.randint(0, n // 2, (s,), generator=g)).tolist()
        cases = [[n] * s] + ([ragged] if s > 1 else [])
        for lens in cases:
            for r in run_case("prefill", lens, lens, args, device, backends, max(3, reps // 3)):
                print(fmt(r), flush=True)
                rows.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "peak_Bps": peak, "dtype": args.dtype, "rows": rows},
                      f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
