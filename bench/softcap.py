"""Gemma 2's softcapped attention on CPU: the native kernel against the torch path.

Gemma 2 caps every scaled attention score ``s`` to ``cap * tanh(s / cap)`` before the
softmax, which SDPA has no hook for. The native kernel caps the scores in the softmax
its one-row and runs-of-rows paths share; before it did, every Gemma 2 layer on CPU
ran the torch path (scores written out, then masked softmax). This times one layer's
attention at Gemma 2 2B's shape (8 query heads, 4 KV heads, head size 256, cap 50,
bf16 cache), side by side in one process (calls interleaved, best of ``--reps``):

- ``native``: ``CpuNativeBackend`` (decode rows; prefill rows in runs);
- ``torch``: ``TorchBackend``, the path such layers took before.

for decode steps (``--seqs`` sequences at each context length) and single-prompt
prefills, and prints native / torch (< 1: native faster). Both results are checked
against each other first.

    python bench/softcap.py
    python bench/softcap.py --json bench/figures/softcap.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch

from pagedserve.kernels import build_varlen_metadata, cpu_native
from pagedserve.kernels.cpu_backend import CpuNativeBackend
from pagedserve.kernels.testing import make_paged_batch
from pagedserve.kernels.torch_ref import TorchBackend

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from prefill_rows import best_interleaved  # a sibling script
from provenance import tree_commit  # a sibling script

HQ, HKV, D, CAP = 8, 4, 256, 50.0  # Gemma 2 2B
SCALE = 256 ** -0.5  # query_pre_attn_scalar 256


def time_case(decode: bool, seqs: int, tokens: int, reps: int) -> dict[str, float]:
    """Best-of-reps seconds per call of each backend for one case."""
    q_lens = [1] * seqs if decode else [tokens] * seqs
    k_lens = [tokens] * seqs
    b = make_paged_batch(q_lens, k_lens, HQ, HKV, D, 16, extra_blocks=0, garbage=1.0,
                         kv_dtype=torch.bfloat16)
    b.q.mul_(4.0)  # scores large enough that the cap bites
    native, ref = CpuNativeBackend(), TorchBackend()  # (prefills <= 2,048 keys: native rows)
    if decode:
        lens = torch.tensor(k_lens, dtype=torch.int32)
        fns = {name: (lambda be=be: be.decode_attention(b.q, b.key_cache, b.value_cache,
                                                        b.block_table, lens, SCALE,
                                                        softcap=CAP))
               for name, be in (("native", native), ("torch", ref))}
    else:
        md = build_varlen_metadata(q_lens, k_lens)
        fns = {name: (lambda be=be: be.varlen_attention(b.q, b.key_cache, b.value_cache,
                                                        b.block_table, md, SCALE,
                                                        softcap=CAP))
               for name, be in (("native", native), ("torch", ref))}
    outs = {name: fn() for name, fn in fns.items()}  # warm-up, and the results agree
    err = (outs["native"].float() - outs["torch"].float()).abs().max().item()
    if err > 1e-4:
        raise AssertionError(f"native and torch softcapped attention differ by {err}")
    return best_interleaved(fns, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=8, help="decode batch")
    ap.add_argument("--context", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--prefill", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    if cpu_native.load() is None:
        raise SystemExit("the native CPU kernels did not build (no C compiler?)")
    print(f"Gemma 2 2B attention ({HQ}q/{HKV}kv x {D}, cap {CAP:g}, bf16 cache), "
          f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    rows = []
    cases = ([(True, args.seqs, n) for n in args.context]
             + [(False, 1, n) for n in args.prefill])
    for decode, seqs, tokens in cases:
        t = time_case(decode, seqs, tokens, args.reps)
        row = {"case": "decode" if decode else "prefill", "seqs": seqs, "tokens": tokens,
               "native_ms": round(t["native"] * 1e3, 3),
               "torch_ms": round(t["torch"] * 1e3, 3),
               "native_over_torch": round(t["native"] / t["torch"], 3)}
        rows.append(row)
        print(f"  {row['case']:7s} {seqs:2d} x {tokens:5d}: native {row['native_ms']:9.3f} ms"
              f"  torch {row['torch_ms']:9.3f} ms  native/torch {row['native_over_torch']:.3f}")
    if args.json:
        out = {"commit": tree_commit(), "machine": platform.machine(),
               "threads": torch.get_num_threads(), "rows": rows}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
