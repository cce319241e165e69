"""DeepSeek latent attention on a prompt chunk: scored in the latent (the absorbed
form every row used before) against keys and values rebuilt per head
(``worker/models/mla_prefill.py``), side by side in one run.

One MLA layer at DeepSeek-V3's per-head sizes (kv_lora_rank 512, rope 64, nope 128,
v 128; ``--heads`` heads, 128 in V3, fewer here so a CPU run stays short) over one
sequence: a chunk of ``n`` new tokens after ``--context`` cached ones, fp32 on CPU
(or ``--device cuda``). Each form's best of ``--reps`` timings of the layer's whole
forward (projections included), their outputs compared, and the ratio printed.

    python bench/mla_prefill.py
    python bench/mla_prefill.py --heads 128 --chunks 1024 --device cuda
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

from pagedserve.kernels import get_backend
from pagedserve.kernels.metadata import build_varlen_metadata
from pagedserve.worker.config import ModelConfig
from pagedserve.worker.layers.attention import AttentionMetadata
from pagedserve.worker.models.deepseek import MLAAttention
from pagedserve.worker.parallel import ParallelContext

BLOCK = 16


def layer(heads: int, device: str) -> MLAAttention:
    cfg = ModelConfig.from_hf_dict(dict(
        model_type="deepseek_v3", hidden_size=1024, num_attention_heads=heads,
        num_key_value_heads=heads, intermediate_size=1024, moe_intermediate_size=256,
        n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
        num_hidden_layers=1, vocab_size=1000, kv_lora_rank=512, q_lora_rank=384,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        max_position_embeddings=65536))
    dev = torch.device(device)
    attn = MLAAttention(cfg, ParallelContext(), get_backend(None, dev), torch.float32, dev, 0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_((torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1])).to(dev))
        for m in (attn.q_a_layernorm, attn.kv_a_layernorm):
            m.weight.fill_(1.0)
    return attn


def step(n: int, context: int, device: str) -> tuple[AttentionMetadata, torch.Tensor]:
    total = context + n
    blocks = -(-total // BLOCK)
    md = AttentionMetadata(
        slot_mapping=torch.arange(context, total, device=device),
        block_table=torch.arange(blocks, dtype=torch.int32, device=device)[None],
        seq_lens=torch.tensor([total], dtype=torch.int32, device=device), is_decode=False,
        varlen=build_varlen_metadata([n], [total], device))
    return md, torch.arange(context, total, device=device)


def timed(attn: MLAAttention, x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor,
          md: AttentionMetadata, reps: int, device: str) -> tuple[float, torch.Tensor]:
    cos, sin = ROTARY.cos_sin(positions, x.dtype)
    best, out = math.inf, x
    for _ in range(reps + 1):
        md.__dict__.pop("_mla_split", None)  # (each timing plans its step anew)
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = attn(x, cos, sin, (cache, cache), md)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    global ROTARY
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--chunks", type=int, nargs="+", default=[64, 256, 1024, 2048])
    ap.add_argument("--context", type=int, default=0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from pagedserve.worker.layers.rotary import RotaryEmbedding

    ROTARY = RotaryEmbedding(64, 10000.0, None, torch.device(args.device))
    attn = layer(args.heads, args.device)
    above = attn.decompress_above
    rows = []
    print(f"one MLA layer, {args.heads} heads of V3's sizes, {args.context} cached tokens; "
          f"rebuilt keys pay off above {above:.0f} queries")
    print(f"{'chunk':>6} {'latent ms':>10} {'rebuilt ms':>11} {'latent / rebuilt':>17} "
          f"{'max |diff|':>11}")
    for n in args.chunks:
        md, positions = step(n, args.context, args.device)
        blocks = int(md.block_table.shape[1])
        cache = torch.zeros(blocks, BLOCK, 1, 576, device=args.device)
        g = torch.Generator().manual_seed(n)
        if args.context:  # cached latents of the context, as earlier steps left them
            cache.view(-1, 576)[:args.context] = torch.randn(args.context, 576,
                                                             generator=g).to(args.device)
        x = torch.randn(n, 1024, generator=g).to(args.device)
        attn.decompress_above = math.inf
        t_lat, o_lat = timed(attn, x, positions, cache, md, args.reps, args.device)
        attn.decompress_above = 0
        t_reb, o_reb = timed(attn, x, positions, cache, md, args.reps, args.device)
        diff = float((o_lat - o_reb).abs().max())
        rows.append({"chunk": n, "latent_s": t_lat, "rebuilt_s": t_reb, "max_abs_diff": diff})
        print(f"{n:>6} {1e3 * t_lat:>10.1f} {1e3 * t_reb:>11.1f} {t_lat / t_reb:>16.2f}x "
              f"{diff:>11.2e}", flush=True)
    attn.decompress_above = above
    if args.json:
        write_figures(args.json, args, tree_commit(), rows=rows, machine=machine(),
                      threshold=above)
        print(json.dumps({"written": args.json}))


ROTARY = None

if __name__ == "__main__":
    main()
