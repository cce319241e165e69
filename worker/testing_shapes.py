"""The shapes ``worker.testing`` writes its random checkpoints in: the default model's,
each family's small defaults (experts, hybrid layers), and the scalars that must
matter. Kept apart so the writer stays readable as families are added."""

from __future__ import annotations

from typing import Any

# SmolLM2-135M-Instruct's architecture (the default model), from its config.json.
SMOLLM2_135M: dict[str, Any] = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
)

# Small mixtures of experts; Mixtral's experts take ``intermediate_size``.
MOE_DEFAULTS: dict[str, dict[str, Any]] = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True),
    # DeepSeek: MLA shapes (a 64-number latent cache: the native CPU kernel's) and 8
    # experts in 4 groups, of which each token may use 2; V2-Lite's one-matrix query.
    "deepseek_v3": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                        n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1,
                        kv_lora_rank=56, q_lora_rank=48, qk_rope_head_dim=8,
                        qk_nope_head_dim=16, v_head_dim=16, routed_scaling_factor=2.5,
                        norm_topk_prob=True),
    # GPT-OSS: sliding and full layers alternating (a 12-token window), sinks, YaRN.
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                    head_dim=16, sliding_window=12),
    # Granite's MoE (4 experts stacked; the shared variant's always-on expert).
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
    "granitemoeshared": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                             shared_intermediate_size=64),
    # Granite 4.0-H: Mamba-2 layers around one attention layer, two groups of B / C, a
    # chunk of 8 tokens (prompts span several), Granite's experts and shared MLP.
    "granitemoehybrid": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                             shared_intermediate_size=64, num_hidden_layers=4,
                             layer_types=["mamba", "attention", "mamba", "mamba"],
                             mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
                             mamba_n_groups=2, mamba_chunk_size=8, mamba_d_conv=4),
    # Bamba: Mamba-2 layers around one attention layer (RoPE on half of its 16-wide heads).
    "bamba": dict(num_hidden_layers=4, attn_layer_indices=[1], mamba_n_heads=8,
                  mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=8,
                  head_dim=16),
    # Falcon-H1: a Mamba-2 mixer (8 heads of 8, two B / C groups, 8-token chunks) beside
    # each attention, every muP multiplier away from 1, the gated norm after the gate.
    "falcon_h1": dict(num_hidden_layers=3, head_dim=16, mamba_d_ssm=64, mamba_n_heads=8,
                      mamba_d_head=8, mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=8,
                      mamba_rms_norm=True, mamba_norm_before_gate=False,
                      embedding_multiplier=2.0, lm_head_multiplier=0.5,
                      attention_in_multiplier=1.2, key_multiplier=0.8,
                      attention_out_multiplier=0.9, ssm_in_multiplier=0.7,
                      ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.3], ssm_out_multiplier=1.4,
                      mlp_multipliers=[1.5, 0.7]),
    # Jamba: Mamba-1, attention, Mamba-1, Mamba-1 layers (128 channels, 8 state dims), the
    # second and fourth MLPs 4 experts (top 2, unnormalised).
    "jamba": dict(num_hidden_layers=4, attn_layer_period=4, attn_layer_offset=1,
                  expert_layer_period=2, expert_layer_offset=1, num_experts=4,
                  num_experts_per_tok=2, intermediate_size=32, mamba_d_state=8),
    # Attention-free: three Mamba-1 blocks (128 channels, 8 state dims; Falcon-Mamba's
    # weightless inner norms), or three Mamba-2 blocks (8 heads of 16, two B / C groups,
    # chunks of 8 tokens).
    "mamba": dict(num_hidden_layers=3, state_size=8),
    "falcon_mamba": dict(num_hidden_layers=3, state_size=8, mixer_rms_eps=1e-5),
    "mamba2": dict(num_hidden_layers=3, num_heads=8, head_dim=16, state_size=16, n_groups=2,
                   chunk_size=8),
    # Nemotron-H: Mamba, MLP, attention, MLP, Mamba, MLP blocks; two B / C groups, chunks
    # of 8 tokens.
    "nemotron_h": dict(hybrid_override_pattern="M-*-M-", num_hidden_layers=6,
                       mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2,
                       chunk_size=8, head_dim=16),
    # Qwen3-Next: three gated DeltaNet layers (2 key heads of 16, 4 value heads of 8)
    # before a gated attention layer; Qwen2-MoE's experts with a gated shared expert.
    "qwen3_next": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, num_hidden_layers=4, head_dim=16,
                       linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=16, linear_value_head_dim=8),
    # Qwen3.5's multimodal files (the decoder's fields go in ``text_config``): Qwen3-Next's
    # layers with the DeltaNet projections unfused; dense, and with experts.
    "qwen3_5": dict(num_hidden_layers=4, head_dim=16, linear_num_key_heads=2,
                    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8),
    "qwen3_5_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=48, num_hidden_layers=4, head_dim=16,
                        linear_num_key_heads=2, linear_num_value_heads=4,
                        linear_key_head_dim=16, linear_value_head_dim=8),
    # LFM2: conv, conv, attention, conv layers (3-tap convolutions), its MLP width adjusted.
    "lfm2": dict(num_hidden_layers=4, layer_types=["conv", "conv", "full_attention", "conv"]),
    "lfm2_moe": dict(num_hidden_layers=4, layer_types=["conv", "conv", "full_attention", "conv"],
                     num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                     num_dense_layers=1, routed_scaling_factor=1.5),
    # GLM-4.5: DeepSeek-V3's experts (8 in 4 groups), biased q/k/v, per-head q/k norms,
    # RoPE on half of each 16-wide head.
    "glm4_moe": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                     n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1,
                     routed_scaling_factor=2.5, head_dim=16, use_qk_norm=True,
                     attention_bias=True),
    # Ernie 4.5 MoE: 8 experts (the first layer dense), two shared, a routing bias.
    "ernie4_5_moe": dict(moe_num_experts=8, moe_k=2, moe_intermediate_size=32,
                         moe_num_shared_experts=2, moe_layer_start_index=1, head_dim=16),
    "deepseek_v2": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                        n_shared_experts=2, n_group=4, topk_group=2,
                        topk_method="group_limited_greedy", first_k_dense_replace=1,
                        kv_lora_rank=56, q_lora_rank=None, qk_rope_head_dim=8,
                        qk_nope_head_dim=16, v_head_dim=16, routed_scaling_factor=2.0),
}


# Kinds whose RMSNorms scale by ``1 + weight`` (the weights init to 0: randomised).
ZERO_CENTERED_NORMS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
# Qwen3.5's vision encoder, as small as it goes (never run by pagedserve).
QWEN3_5_VISION: dict[str, Any] = dict(depth=1, hidden_size=32, intermediate_size=64,
                                      num_heads=2, out_hidden_size=64)

# Granite's four scalars, away from 1 (and the attention scale from head_dim ** -0.5) so
# that a model ignoring one gives other tokens.
GRANITE_SCALES: dict[str, float] = dict(embedding_multiplier=2.0, attention_multiplier=0.2,
                                        residual_multiplier=1.5, logits_scaling=4.0)
