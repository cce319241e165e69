"""AI21's Jamba (``jamba``): Mamba-1 layers around an attention layer without RoPE,
routed experts every other layer.

Through the engine, against Hugging Face's ``generate`` (its torch Mamba path) on files
its own classes wrote: greedy tokens equal over prompts of 3 to 48 tokens, each twice
in a batch, whole, in 8-token prefill chunks mixed with decodes, and through the torch
paths (the native kernels off) with the scan cut into 16-token chunks; a dense file
with biased projections, an unbiased convolution and tied embeddings; a conversation
continued from a prefix-cache snapshot. The scan alone against the token-by-token
recurrence; malformed fields named. TP=2
(``tests/worker/test_tensor_parallel.py``), pipeline stages
(``tests/worker/test_pipeline_stages.py``) and speculative decoding
(``test_hybrid_spec_decode.py``) cover it with the other hybrids."""

from __future__ import annotations

import pytest
import torch

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.kernels import cpu_mamba
from pagedserve.worker.config import ModelConfig
from pagedserve.worker.layers import mamba1
from pagedserve.worker.mamba1_config import jamba_mamba_config
from pagedserve.worker.moe_config import moe_config_from_hf
from pagedserve.worker.testing import write_random_checkpoint
from tests.cluster.conftest import hf_greedy
from tests.cluster.test_hf_parity import prompts_of_mixed_lengths

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_experts_file_equals_hugging_face_whole_in_chunks_and_from_snapshots(
        tmp_path, default_model_dir, monkeypatch) -> None:
    path = write_random_checkpoint(tmp_path / "jamba", "jamba", default_model_dir)
    available = cpu_mamba.available
    prompts = prompts_of_mixed_lengths(6)
    ref = hf_greedy(path, prompts, GREEDY.max_tokens)
    mc = ModelConfig.from_pretrained(path)
    assert (mc.mamba.layers, mc.mamba.attention, mc.moe.sparse_layers) == ((0, 2, 3), (1,),
                                                                          (1, 3))
    assert mc.nope_layers == (0, 1, 2, 3) and not mc.moe.renormalize
    llm = LLM(model=path, num_gpu_blocks=128, block_size=4, mamba_cache_mode="align")
    try:
        assert _tokens(llm.generate(prompts + prompts, GREEDY)) == ref + ref
        turn2 = [p + o + [7, 8, 9] for p, o in zip(prompts, ref, strict=True)]
        cont = llm.generate(turn2, GREEDY)  # (from the first round's last snapshots)
        assert [o.num_cached_tokens for o in cont] == [
            (len(p) + len(o) - 1) // 4 * 4 for p, o in zip(prompts, ref, strict=True)]
    finally:
        llm.shutdown()
    assert _tokens(cont) == hf_greedy(path, turn2, GREEDY.max_tokens)
    # Prefill chunks of 8 tokens beside decodes; and the torch paths (the native kernels
    # off), the scan in chunks of 16 (128 channels x 8 state dims a token): the
    # 48-token prompt spans three.
    monkeypatch.setattr(mamba1, "_SCAN_NUMBERS", 16 * 128 * 8)
    for budget, native in ((8, True), (64, False)):
        monkeypatch.setattr(cpu_mamba, "available", available if native else lambda s: False)
        llm = LLM(model=path, num_gpu_blocks=128, block_size=4,
                  max_num_batched_tokens=budget)
        try:
            assert _tokens(llm.generate(prompts, GREEDY)) == ref
        finally:
            llm.shutdown()


def test_dense_biased_tied_file_equals_hugging_face(tmp_path, default_model_dir) -> None:
    path = write_random_checkpoint(
        tmp_path / "dense", "jamba", default_model_dir, num_experts=1, mamba_proj_bias=True,
        mamba_conv_bias=False, tie_word_embeddings=True, attn_layer_period=2,
        attn_layer_offset=0, mamba_dt_rank=6, mamba_d_conv=3)
    prompts = prompts_of_mixed_lengths(5)
    ref = hf_greedy(path, prompts, GREEDY.max_tokens)
    mc = ModelConfig.from_pretrained(path)
    assert mc.moe is None and mc.mamba.attention == (0, 2) and mc.mamba.dt_rank == 6
    llm = LLM(model=path, num_gpu_blocks=128, block_size=4)
    try:
        assert _tokens(llm.generate(prompts, GREEDY)) == ref
    finally:
        llm.shutdown()


@pytest.mark.parametrize("length,chunk", [(1, 4), (5, 4), (16, 4), (37, 8), (37, None)])
def test_scan_equals_the_token_recurrence(length: int, chunk: int | None) -> None:
    """``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t``, ``y_t = h_t C_t``, one token at a
    time from a nonzero state, against the chunked prefix scan."""
    g = torch.Generator().manual_seed(length)
    d, n = 12, 5
    x, dt = torch.randn(length, d, generator=g), torch.rand(length, d, generator=g)
    a = -torch.rand(d, n, generator=g) * 3
    b, c = torch.randn(length, n, generator=g), torch.randn(length, n, generator=g)
    h = h0 = torch.randn(d, n, generator=g)
    ys = []
    for t in range(length):
        h = torch.exp(dt[t, :, None] * a) * h + (dt[t] * x[t])[:, None] * b[t]
        ys.append(h @ c[t])
    y, final = mamba1.selective_scan(x, dt, a, b, c, h0, chunk)
    torch.testing.assert_close(y, torch.stack(ys), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, h, rtol=1e-5, atol=1e-5)


def test_malformed_fields_are_named() -> None:
    base = {"hidden_size": 64, "num_hidden_layers": 4}
    with pytest.raises(ValueError, match="'attn_layer_offset' \\(8\\) must be smaller"):
        jamba_mamba_config({**base, "attn_layer_offset": 8}, 4)
    with pytest.raises(ValueError, match="'mamba_d_conv' must be >= 2"):
        jamba_mamba_config({**base, "mamba_d_conv": 1}, 4)
    with pytest.raises(ValueError, match="'mamba_dt_rank' must be a positive integer"):
        jamba_mamba_config({**base, "mamba_dt_rank": 0}, 4)
    with pytest.raises(ValueError, match="'hidden_act' must be 'silu'"):
        jamba_mamba_config({**base, "hidden_act": "gelu"}, 4)
    moe = {"intermediate_size": 32, "num_experts": 4}
    with pytest.raises(ValueError, match="'expert_layer_offset' \\(2\\) must be smaller"):
        moe_config_from_hf({**moe, "expert_layer_offset": 2}, "jamba", 4)
    with pytest.raises(ValueError, match="'num_experts_per_tok' \\(5\\) must be at most"):
        moe_config_from_hf({**moe, "num_experts_per_tok": 5}, "jamba", 4)
