"""Our paged forward equals Hugging Face's dense forward on random tiny checkpoints.

Each case runs three steps through the real loader and runner: a mixed prefill
(one prompt split into chunks), a step mixing decodes with the final chunk,
and a pure decode step, all over shuffled, interleaved block tables.
"""

from __future__ import annotations

import logging

import pytest
import torch

from pagedserve.worker.layers.packed import can_pack, slow_half_precision
from tests.worker.helpers import (
    BlockAllocator,
    all_logits,
    load_hf,
    make_worker,
    plan,
    request,
    save_tiny_model,
)

CASES = {
    "llama_untied": dict(model_type="llama", tie_word_embeddings=False),
    "llama3_rope_tied_bias": dict(
        model_type="llama", tie_word_embeddings=True, attention_bias=True,
        rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=16),
    ),
    "qwen2_qkv_bias": dict(model_type="qwen2", tie_word_embeddings=True),
    "mistral": dict(model_type="mistral", sliding_window=None),
    # Sliding windows shorter than the prompts: every layer (Mistral v0.1, Mixtral), or
    # only layers from max_window_layers on (Qwen2's use_sliding_window).
    "mistral_window": dict(model_type="mistral", sliding_window=5),
    "qwen2_window_upper_layers": dict(model_type="qwen2", use_sliding_window=True,
                                      sliding_window=4, max_window_layers=1),
    "mixtral_window": dict(model_type="mixtral", sliding_window=6),
    # Gemma 2: every other layer slides, attention scores and logits softcapped (caps small
    # enough that most scores pass them), no q/k norms.
    "gemma2_softcap": dict(model_type="gemma2", head_dim=16, query_pre_attn_scalar=24,
                           sliding_window=5, attn_logit_softcapping=0.02,
                           final_logit_softcapping=4.0),
    # Phi-3 / Phi-4: fused qkv_proj and gate_up_proj in the file, a sliding window.
    "phi3_fused_window": dict(model_type="phi3", sliding_window=6, pad_token_id=0),
    # Gemma 3: 1 + w norms, scaled embedding, GELU-tanh, a local RoPE base on the sliding
    # layers, a linearly scaled global one, query_pre_attn_scalar, a final logit softcap.
    "gemma3": dict(model_type="gemma3_text", head_dim=16, query_pre_attn_scalar=24,
                   sliding_window=5, layer_types=["sliding_attention", "full_attention"],
                   rope_scaling=dict(rope_type="linear", factor=4.0),
                   final_logit_softcapping=3.0),
    # Qwen3: per-head q/k RMSNorm, head_dim wider than hidden / heads.
    "qwen3_qk_norm_tied": dict(model_type="qwen3", tie_word_embeddings=True, head_dim=32),
    # YaRN over a 16-position "pre-training" length, so the test's positions are stretched.
    "qwen2_yarn_rope": dict(
        model_type="qwen2",
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16),
    ),
    "llama_mha_linear_rope": dict(
        model_type="llama", num_key_value_heads=4,
        rope_scaling=dict(rope_type="linear", factor=2.0),
    ),
    # Mixtures of experts: 4 experts, top 2, over the flat mixed batch.
    "mixtral": dict(model_type="mixtral"),
    # A gated shared expert beside the routed ones, top-2 weights not renormalised.
    "qwen2_moe_shared_expert": dict(model_type="qwen2_moe", tie_word_embeddings=True),
    # Renormalised top-3 of 8; layer 1 keeps a dense MLP (``mlp_only_layers``).
    "qwen3_moe_dense_layer": dict(model_type="qwen3_moe", num_experts=8,
                                  num_experts_per_tok=3, mlp_only_layers=[1]),
    # DeepSeek-V3: latent attention (a low-rank query, interleaved RoPE) under its YaRN
    # (mscale_all_dim scales every score), sigmoid routing with a bias over 4 groups.
    "deepseek_v3_yarn": dict(
        model_type="deepseek_v3", num_key_value_heads=4,
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16,
                          mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1)),
    # Prompt chunks over keys and values rebuilt per head (``mla_prefill``) at any length
    # (0.5: every row of a step with a chunk; 4: chunks of 5+, beside latent rows).
    "deepseek_v3_rebuilt_keys": dict(model_type="deepseek_v3", num_key_value_heads=4,
                                     decompress_above=0.5),
    "deepseek_v2_rebuilt_keys_mixed": dict(model_type="deepseek_v2", num_key_value_heads=4,
                                           decompress_above=4),
    # RoPE in halves; a 40-number latent, which the native CPU kernel does not take.
    "deepseek_v3_halves_torch_attention": dict(model_type="deepseek_v3", rope_interleave=False,
                                               kv_lora_rank=32, num_key_value_heads=4),
    # DeepSeek-V2-Lite's shape: one query matrix, softmax routing limited to 2 groups.
    # (HF's MLA counts num_key_value_heads = num_attention_heads)
    "deepseek_v2_lite": dict(model_type="deepseek_v2", num_key_value_heads=4),
    # DeepSeek-V2's plain top-k of all experts, weights scaled (HF's V2 never
    # renormalises; every V2 release says norm_topk_prob false).
    "deepseek_v2_greedy": dict(model_type="deepseek_v2", num_key_value_heads=4,
                               topk_method="greedy", n_group=None, topk_group=None,
                               routed_scaling_factor=3.0),
}


def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


@pytest.mark.parametrize("case", [*CASES, "qwen3_torch_ops"])
def test_paged_forward_matches_hf(tmp_path, case, monkeypatch):
    if case == "qwen3_torch_ops":  # no native library: the torch ops that GPUs also run
        from pagedserve.kernels import cpu_native

        monkeypatch.setattr(cpu_native, "_tried", True)
        monkeypatch.setattr(cpu_native, "_lib", None)
        case = "qwen3_qk_norm_tied"
    kw = dict(CASES[case])
    model_type = kw.pop("model_type")
    above = kw.pop("decompress_above", None)
    path = save_tiny_model(tmp_path / case, model_type, seed=1, **kw)
    hf = load_hf(path)
    worker = make_worker(path, num_blocks=48, block_size=4)
    if above is not None:
        for layer in worker.model.layers:
            layer.self_attn.decompress_above = above
    alloc = BlockAllocator(48, 4, seed=3, groups=worker.kv_layout.num_groups)
    g = torch.Generator().manual_seed(0)
    seqs = {r: torch.randint(3, 101, (n,), generator=g).tolist()
            for r, n in (("a", 7), ("b", 13), ("c", 5))}

    def check(p, spans):
        got = all_logits(worker, p)
        off = 0
        for rid, start, n in spans:
            ref = _hf_logits(hf, seqs[rid][: start + n])[start:]
            torch.testing.assert_close(got[off:off + n], ref, atol=2e-5, rtol=1e-4)
            off += n

    # Step 0: prefill a and c; b's prompt is chunked (first 8 tokens, no sample).
    check(plan(0, [request(alloc, "a", seqs["a"], 0), request(alloc, "b", seqs["b"][:8], 0,
                                                              sample=False),
                   request(alloc, "c", seqs["c"], 0)]),
          [("a", 0, 7), ("b", 0, 8), ("c", 0, 5)])
    for r in ("a", "c"):
        seqs[r].append(int(torch.randint(3, 101, (1,), generator=g)))
    # Step 1: decodes of a and c mixed with b's last chunk (varlen path).
    check(plan(1, [request(alloc, "a", seqs["a"][7:], 7), request(alloc, "b", seqs["b"][8:], 8),
                   request(alloc, "c", seqs["c"][5:], 5)]),
          [("a", 7, 1), ("b", 8, 5), ("c", 5, 1)])
    for r in seqs:
        seqs[r].append(int(torch.randint(3, 101, (1,), generator=g)))
    # Step 2: pure decode (decode_attention path) with cached context.
    n = {r: len(s) - 1 for r, s in seqs.items()}
    check(plan(2, [request(alloc, r, seqs[r][n[r]:], n[r]) for r in ("b", "a", "c")]),
          [("b", n["b"], 1), ("a", n["a"], 1), ("c", n["c"], 1)])


def test_greedy_generation_matches_hf_generate(tmp_path):
    """End to end through execute(): greedy tokens equal HF generate's."""
    path = save_tiny_model(tmp_path / "m", "llama", seed=2)
    hf = load_hf(path)
    worker = make_worker(path, num_blocks=32, block_size=4)
    alloc = BlockAllocator(32, 4, seed=5)
    prompts = {"x": [5, 9, 17, 33, 4], "y": [8, 8, 70, 12, 44, 90, 3, 61, 22]}
    steps = 6
    out = {r: [] for r in prompts}
    reqs = [request(alloc, r, p, 0) for r, p in prompts.items()]
    for step in range(steps):
        res = worker.execute_model(plan(step, reqs))
        reqs = []
        for r, p in prompts.items():
            tok = res.sampled[r].token_id
            out[r].append(tok)
            reqs.append(request(alloc, r, [tok], len(p) + len(out[r]) - 1))
    hf.generation_config.eos_token_id = None  # our plan never stops early either
    for r, p in prompts.items():
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=steps, do_sample=False)
        assert out[r] == ref[0, len(p):].tolist()


def test_bfloat16_runs_close_to_fp32(tmp_path, caplog):
    """bf16 weights and KV cache (native decode and row ops on CPU): logits within bf16
    error of HF fp32; a CPU that would emulate bf16 matmuls says so at load."""
    path = save_tiny_model(tmp_path / "m", "qwen2", seed=3)
    hf = load_hf(path)
    with caplog.at_level(logging.WARNING, logger="pagedserve.worker.worker"):
        worker = make_worker(path, num_blocks=16, block_size=4, dtype="bfloat16")
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert any("--quantization int8" in r.message for r in caplog.records) != native
    assert slow_half_precision(torch.device("cpu"), torch.float32) is None
    assert worker.kv_cache.key_caches[0].dtype == torch.bfloat16
    # Where the CPU has bf16 dot products the projections are oneDNN-packed in bf16 too.
    assert worker.packed_weights == can_pack(torch.device("cpu"), torch.bfloat16)
    alloc = BlockAllocator(16, 4)
    prompt = [5, 9, 17, 33, 4, 12, 7, 40, 41]
    got = all_logits(worker, plan(0, [request(alloc, "a", prompt, 0)]))
    ref = _hf_logits(hf, prompt)
    assert got.dtype == torch.bfloat16
    scale = ref.abs().max().item()
    assert (got.float() - ref).abs().max().item() < 0.05 * scale + 1e-2
    out = worker.execute_model(plan(1, [request(alloc, "a", [3], len(prompt))]))
    assert 0 <= out.sampled["a"].token_id < 101


def test_packed_and_plain_weights_agree(tmp_path):
    """The oneDNN-packed CPU path and plain F.linear give the same logits (tied head kept)."""
    path = save_tiny_model(tmp_path / "m", "llama", seed=7, tie_word_embeddings=True)
    packed = make_worker(path, num_blocks=16, block_size=4)
    plain = make_worker(path, num_blocks=16, block_size=4, cpu_packed_weights=False)
    assert packed.get_model_info()["packed_weights"]
    assert not plain.get_model_info()["packed_weights"]
    # The embedding still reads the shared weight; projections dropped their plain copy.
    assert packed.model.embed_tokens.weight.numel() == 101 * 64
    assert packed.model.layers[0].mlp.down_proj.weight.numel() == 0
    prompt = [5, 9, 17, 33, 4, 12, 7, 40, 41]
    got = [all_logits(w, plan(0, [request(BlockAllocator(16, 4), "a", prompt, 0)]))
           for w in (packed, plain)]
    torch.testing.assert_close(got[0], got[1], atol=2e-5, rtol=1e-4)
