"""Mixture-of-experts throughput: pagedserve vs Hugging Face on one routed model.

Same machine, same random checkpoint, same requests, one run: a Qwen3-MoE
(``--kind``: or Mixtral, Qwen2-MoE, DeepSeek-V3 / V2 with latent attention, GPT-OSS,
Granite 4.0-H's Mamba-2 hybrid, Qwen3-Next's gated DeltaNet hybrid, LFM2-MoE's short
convolutions; Falcon-H1, dense, a Mamba-2 mixer beside each attention; Jamba's
Mamba-1 hybrid; the attention-free Mamba and Mamba-2, dense; Nemotron 3's Mamba-2 and
squared-ReLU expert blocks) of
``--layers`` layers, ``--experts`` experts of which each token takes ``--top-k``,
written with ``save_pretrained`` and loaded by both engines in ``--dtype`` (fp32
by default); ``--num-prompts`` prompts of 10-75 random token ids (or of
``--prompt-len`` each), ``--output-len`` greedy tokens each.

- pagedserve ``LLM.generate`` (continuous batching; each step groups its rows
  by expert);
- Hugging Face ``generate``, left-padded static batches of ``--hf-batch``;
- Hugging Face ``generate_batch`` (its continuous batching).

Also prints the GEMM roofline of this machine for the model's *active*
parameters (2 FLOPs per parameter a token touches: attention, the router,
its top-k experts, the LM head), and each engine's share of it.

    python bench/moe.py
    python bench/moe.py --kind mixtral --json bench/figures/moe_mixtral.json
    python bench/moe.py --dtype bfloat16      # bf16 weights (the kernel widens them)
    python bench/moe.py --quantization int8   # pagedserve with int8 experts
    python bench/moe.py --kind deepseek_v3 --prompt-len 1000   # MLA at long contexts
    python bench/moe.py --kind gpt_oss --json bench/figures/moe_gpt_oss.json
    python bench/moe.py --kind granitemoehybrid --json bench/figures/moe_granite_hybrid.json
    python bench/moe.py --kind qwen3_next --json bench/figures/moe_qwen3_next.json
    python bench/moe.py --kind lfm2_moe --json bench/figures/moe_lfm2_moe.json
    python bench/moe.py --kind falcon_h1 --json bench/figures/moe_falcon_h1.json
    python bench/moe.py --kind jamba --json bench/figures/moe_jamba.json
    python bench/moe.py --kind mamba --json bench/figures/moe_mamba.json
    python bench/moe.py --kind mamba2 --json bench/figures/moe_mamba2.json
    python bench/moe.py --kind nemotron_h --json bench/figures/moe_nemotron3.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from offline import (  # the offline benchmark's runners, prompts and GEMM peak
    gemm_peak_flops,
    make_prompts,
    run_hf_generate,
    run_hf_generate_batch,
    run_pagedserve,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def model_overrides(args: argparse.Namespace) -> dict:
    """Config fields of the benchmark model: a narrow Qwen3-30B-A3B-like shape."""
    cfg = dict(vocab_size=32000, hidden_size=args.hidden, num_hidden_layers=args.layers,
               num_attention_heads=8, num_key_value_heads=4, head_dim=args.hidden // 8,
               max_position_embeddings=4096, num_experts_per_tok=args.top_k,
               tie_word_embeddings=False)
    if args.kind.startswith("deepseek"):  # DeepSeek-V3's MLA proportions, narrowed
        h = args.hidden
        cfg.update(num_key_value_heads=8, n_routed_experts=args.experts,
                   moe_intermediate_size=args.expert_width,
                   intermediate_size=4 * args.expert_width, n_shared_experts=1, n_group=4,
                   topk_group=2, first_k_dense_replace=1, kv_lora_rank=h // 2,
                   q_lora_rank=3 * h // 4 if args.kind == "deepseek_v3" else None,
                   qk_rope_head_dim=h // 16, qk_nope_head_dim=h // 8, v_head_dim=h // 8,
                   norm_topk_prob=args.kind == "deepseek_v3", routed_scaling_factor=2.5)
        if args.kind == "deepseek_v2":
            cfg["topk_method"] = "group_limited_greedy"
        del cfg["head_dim"]
    elif args.kind == "mixtral":
        cfg.update(num_local_experts=args.experts, intermediate_size=args.expert_width)
    elif args.kind == "gpt_oss":  # sinks, biased clamped experts, 128-token windows
        cfg.update(num_local_experts=args.experts, intermediate_size=args.expert_width,
                   sliding_window=128)
    elif args.kind == "granitemoehybrid":  # Granite 4.0-H: Mamba-2, one layer in four attends
        cfg.update(num_local_experts=args.experts, intermediate_size=args.expert_width,
                   shared_intermediate_size=2 * args.expert_width,
                   layer_types=["attention" if i % 4 == 3 else "mamba"
                                for i in range(args.layers)],
                   mamba_n_heads=args.hidden * 2 // 64, mamba_d_head=64, mamba_d_state=128,
                   mamba_n_groups=1, mamba_chunk_size=256)
    elif args.kind == "qwen3_next":  # gated DeltaNet, one layer in four attends (gated)
        cfg.update(num_experts=args.experts, moe_intermediate_size=args.expert_width,
                   intermediate_size=4 * args.expert_width,
                   shared_expert_intermediate_size=args.expert_width,
                   layer_types=["full_attention" if i % 4 == 3 else "linear_attention"
                                for i in range(args.layers)],
                   linear_num_key_heads=args.hidden // 128,
                   linear_num_value_heads=args.hidden // 64,
                   linear_key_head_dim=64, linear_value_head_dim=64)
    elif args.kind == "lfm2_moe":  # LFM2-8B-A1B: short convolutions, one layer in four attends
        cfg.update(num_experts=args.experts, moe_intermediate_size=args.expert_width,
                   intermediate_size=4 * args.expert_width, num_dense_layers=1,
                   layer_types=["full_attention" if i % 4 == 3 else "conv"
                                for i in range(args.layers)])
    elif args.kind == "falcon_h1":  # dense: a Mamba-2 mixer beside every attention, muP
        cfg.update(intermediate_size=4 * args.expert_width, mamba_d_ssm=args.hidden,
                   mamba_n_heads=args.hidden // 64, mamba_d_head=64, mamba_d_state=128,
                   mamba_n_groups=1, mamba_chunk_size=256, mamba_rms_norm=True,
                   embedding_multiplier=5.6, lm_head_multiplier=0.04, key_multiplier=0.4,
                   ssm_multipliers=[0.3, 0.2, 0.4, 0.3, 0.6], mlp_multipliers=[0.9, 0.5])
    elif args.kind == "jamba":  # Jamba 1.5's rhythm: Mamba-1, one layer in eight attends,
        # experts every other layer (as wide as the dense MLPs), 16 state dims a channel
        cfg.update(num_experts=args.experts, intermediate_size=args.expert_width,
                   attn_layer_period=8, attn_layer_offset=4, expert_layer_period=2,
                   expert_layer_offset=1, mamba_d_state=16, mamba_expand=2,
                   mamba_dt_rank=args.hidden // 16)
    elif args.kind == "nemotron_h":  # Nemotron 3 Nano's rhythm: Mamba-2 and expert blocks
        # in turn, one attention block in eight; squared-ReLU experts and a shared one
        cfg.update(hybrid_override_pattern=("MEMEM*EM" * args.layers)[:args.layers],
                   n_routed_experts=args.experts, moe_intermediate_size=args.expert_width,
                   moe_shared_expert_intermediate_size=2 * args.expert_width,
                   routed_scaling_factor=2.5, n_group=1, topk_group=1,
                   mamba_num_heads=args.hidden * 2 // 64, mamba_head_dim=64,
                   ssm_state_size=128, n_groups=1, chunk_size=256,
                   intermediate_size=4 * args.expert_width)
    elif args.kind in ("mamba", "mamba2"):  # attention-free, dense: a mixer a layer, no MLP
        cfg.update(state_size=16 if args.kind == "mamba" else 128, expand=2,
                   intermediate_size=2 * args.hidden, num_heads=args.hidden * 2 // 64,
                   head_dim=64, n_groups=1, chunk_size=256)
    else:
        cfg.update(num_experts=args.experts, moe_intermediate_size=args.expert_width,
                   intermediate_size=4 * args.expert_width, norm_topk_prob=True)
    if args.kind == "qwen2_moe":
        cfg["shared_expert_intermediate_size"] = 2 * args.expert_width
    return cfg


def random_hybrid_checkpoint(kind: str, hidden: int, layers: int, prefix: str
                            ) -> tuple[tempfile.TemporaryDirectory, str]:
    """A random checkpoint of ``model_overrides``' shape for ``kind`` (top 4 of 32
    experts 256 wide where it routes), in a scratch directory the caller keeps alive."""
    from pagedserve.worker.testing import write_random_checkpoint

    shape = argparse.Namespace(kind=kind, hidden=hidden, layers=layers, top_k=4, experts=32,
                               expert_width=256)
    scratch = tempfile.TemporaryDirectory(prefix=prefix)
    return scratch, write_random_checkpoint(scratch.name, kind, weight_scale=1.0,
                                            **model_overrides(shape))


def active_params(model: torch.nn.Module, top_k: int, num_experts: int) -> float:
    """Parameters one token multiplies by: everything but the embedding, with the
    routed experts counted ``top_k / num_experts``."""
    total = 0.0
    for name, p in model.named_parameters():
        if "embed_tokens" in name:
            continue
        routed = ".experts." in name or name.endswith(("experts.gate_up_proj",
                                                       "experts.down_proj")) or (
            "block_sparse_moe." in name and "_linear" in name)  # (Granite's stacks)
        total += p.numel() * (top_k / num_experts if routed else 1.0)
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", choices=("qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v3",
                                       "deepseek_v2", "gpt_oss", "granitemoehybrid",
                                       "qwen3_next", "lfm2_moe", "falcon_h1", "jamba",
                                       "mamba", "mamba2", "nemotron_h"),
                    default="qwen3_moe")
    ap.add_argument("--prompt-len", type=int, default=None,
                    help="every prompt this many random token ids (default 10-75)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--expert-width", type=int, default=256)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--skip-generate-batch", action="store_true")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--quantization", choices=("int8", "int4"), default=None,
                    help="pagedserve only: int8 experts, int8 / int4 projections")
    ap.add_argument("--json", type=str, default=None)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from pagedserve.worker.testing import write_random_checkpoint

    scratch = tempfile.TemporaryDirectory(prefix="moe_bench_")  # removed at exit
    path = write_random_checkpoint(scratch.name, args.kind, weight_scale=1.0,
                                   **model_overrides(args))
    prompts = make_prompts(None, args.num_prompts, seed=0)
    prompts = [[t % 32000 for t in p] for p in prompts]
    if args.prompt_len:
        rng = random.Random(0)
        prompts = [[rng.randrange(3, 32000) for _ in range(args.prompt_len)]
                   for _ in prompts]
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    peak = gemm_peak_flops("cpu", dtype)
    results: dict[str, float] = {}

    def record(name: str, tps: float) -> None:  # printed at once: a killed run keeps them
        results[name] = tps
        print(f"{name}: {tps:.1f} tokens/s", flush=True)

    record("pagedserve", run_pagedserve(path, prompts, args.output_len, "cpu", args.dtype,
                                        quantization=args.quantization))
    record("hf_generate", run_hf_generate(model, prompts, args.output_len, args.hf_batch))
    if not args.skip_generate_batch:
        try:
            record("hf_generate_batch", run_hf_generate_batch(model, prompts, args.output_len))
        except Exception as e:  # report, don't hide: the table says which ran
            print(f"hf generate_batch failed: {type(e).__name__}: {e}")
    peak = max(peak, gemm_peak_flops("cpu", dtype))
    active = active_params(model, args.top_k, args.experts)
    roofline = peak / (2 * active)
    lengths = f"{args.prompt_len}" if args.prompt_len else "10-75"
    print(f"\n{args.num_prompts} prompts ({lengths} random token ids), {args.output_len} new tokens "
          f"each; random {args.kind}: {args.layers} layers, hidden {args.hidden}, "
          f"{args.experts} experts x {args.expert_width} wide, top {args.top_k}; {args.dtype}"
          f"{f' (pagedserve {args.quantization})' if args.quantization else ''}, "
          f"{torch.get_num_threads()} CPU threads")
    print(f"{active / 1e6:.1f}M active parameters per token; GEMM peak {peak / 1e9:.1f} "
          f"GFLOP/s -> roofline {roofline:.0f} tokens/s")
    print(f"{'engine':<20} {'tokens/s':>10} {'pagedserve x':>13} {'of roofline':>12}")
    for name, tps in results.items():
        print(f"{name:<20} {tps:>10.1f} {results['pagedserve'] / tps:>12.2f}x "
              f"{100 * tps / roofline:>11.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens_per_s": results, "gemm_flops": peak,
                       "active_params": active, "roofline_tokens_per_s": roofline,
                       "args": vars(args)}, f, indent=2)


if __name__ == "__main__":
    main()
