"""Expert parallelism against tensor-parallel experts: one MoE layer's per-rank cost,
side by side in one run (``worker/layers/expert_placement.py``).

Both modes pay the same one all-reduce of ``[rows, hidden]`` per layer, so what differs
is each rank's expert work, and a step waits for the slowest rank. Each of ``W`` ranks
is built as a ``SparseMoE`` with that rank's ``ParallelContext`` (sharded: a
``1 / W`` slice of every expert; expert-parallel: whole experts, ``E / W`` of them),
timed alone on ``--threads`` threads (one rank's share of a machine), and the step's
cost taken as the slowest rank's best of ``--reps``. The ranks' outputs are summed in
each mode and compared, so both modes compute the same layer.

Default shapes: DeepSeek-V2-Lite's routed experts (64 experts of width 1,408, top 6,
hidden 2,048; softmax routing, no shared expert, whose cost is the same in both
modes), a random router over random rows, so routing is near uniform; a trained
model's skew would load some ranks more under expert parallelism.

    python bench/expert_parallel.py
    python bench/expert_parallel.py --world 2 --rows 1 64 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from provenance import machine, tree_commit, write_figures  # sibling scripts

from pagedserve.worker.config import ModelConfig
from pagedserve.worker.layers.moe import SparseMoE
from pagedserve.worker.parallel import ParallelContext


class _OwnSum(ParallelContext):
    """A rank timed alone: its all-reduce (the same in both modes) is left out."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


def checkpoint(args: argparse.Namespace) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    cfg = ModelConfig.from_hf_dict(dict(
        model_type="qwen3_moe", hidden_size=args.hidden, num_attention_heads=16,
        num_key_value_heads=4, intermediate_size=args.expert_width, num_hidden_layers=1,
        vocab_size=1000, num_experts=args.experts, num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.expert_width, norm_topk_prob=True))
    g = torch.Generator().manual_seed(0)
    h, i = args.hidden, args.expert_width
    tensors = {"gate.weight": torch.randn(args.experts, h, generator=g) / math.sqrt(h)}
    for e in range(args.experts):
        for name, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            tensors[f"experts.{e}.{name}.weight"] = torch.randn(shape, generator=g) \
                / math.sqrt(shape[1])
    return cfg, tensors


def ranks(cfg: ModelConfig, tensors: dict[str, torch.Tensor], world: int, ep: bool,
          placement: str, dtype: torch.dtype) -> list[SparseMoE]:
    out = []
    for r in range(world):
        ctx = _OwnSum(r, world, expert_parallel=ep, expert_placement=placement)
        layer = SparseMoE(cfg.hidden_size, cfg.moe, ctx, dtype, torch.device("cpu"))
        for name, t in tensors.items():
            layer.load(name, t)
        layer.pack()  # the native kernel where it takes the shapes, as the worker packs
        out.append(layer)
    return out


def timed(layer: SparseMoE, x: torch.Tensor, reps: int) -> tuple[float, torch.Tensor]:
    best, y = math.inf, x
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        with torch.inference_mode():
            y = layer(x)
        best = min(best, time.perf_counter() - t0)
    return best, y


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--expert-width", type=int, default=1408)
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 512])
    ap.add_argument("--placement", default="linear", choices=("linear", "round_robin"))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    cfg, tensors = checkpoint(args)
    print(f"one MoE layer: {args.experts} experts x {args.expert_width} wide, top "
          f"{args.top_k}, hidden {args.hidden}, {args.dtype}; each rank on {args.threads} "
          f"thread(s), {args.placement} placement; a step waits for the slowest rank")
    print(f"{'ranks':>5} {'rows':>5} {'sharded ms':>11} {'EP ms':>8} {'EP mean ms':>11} "
          f"{'sharded / EP':>13} {'max |diff|':>11}")
    rows_out = []
    for world in args.world:
        sharded = ranks(cfg, tensors, world, False, args.placement, dtype)
        expert = ranks(cfg, tensors, world, True, args.placement, dtype)
        for n in args.rows:
            x = torch.randn(n, args.hidden, generator=torch.Generator().manual_seed(n)).to(dtype)
            t_tp, y_tp = zip(*(timed(layer, x, args.reps) for layer in sharded), strict=True)
            t_ep, y_ep = zip(*(timed(layer, x, args.reps) for layer in expert), strict=True)
            diff = float((sum(y_tp).float() - sum(y_ep).float()).abs().max())
            row = {"ranks": world, "rows": n, "sharded_s": max(t_tp), "ep_s": max(t_ep),
                   "ep_mean_s": sum(t_ep) / world, "sharded_mean_s": sum(t_tp) / world,
                   "max_abs_diff": diff}
            rows_out.append(row)
            print(f"{world:>5} {n:>5} {1e3 * max(t_tp):>11.2f} {1e3 * max(t_ep):>8.2f} "
                  f"{1e3 * row['ep_mean_s']:>11.2f} {max(t_tp) / max(t_ep):>12.2f}x "
                  f"{diff:>11.2e}", flush=True)
        del sharded, expert
    if args.json:
        write_figures(args.json, args, tree_commit(), rows=rows_out, machine=machine())
        print(json.dumps({"written": args.json}))


if __name__ == "__main__":
    main()
